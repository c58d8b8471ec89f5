# Hand-written, not exported from a notebook.
"""The rules that decide what ships (issue 49), in one small module the tests import.

A model or adapter that comes back from a GPU is compared with the one shipped on the
same VALIDATION examples, pair by pair. It ships only if

- a measure it aims at rises by more than MARGIN standard errors of the paired
  difference, and
- no measure falls by more than MARGIN of its own standard errors.

The standard errors come from the delete-a-group jackknife over examples: the rows
are dealt into GROUPS groups, each group is left out in turn, and the spread of the
difference between the two models' measures over those leave-outs gives its error.
It needs nothing of a measure but the function that computes it from rows, so mean
IoUs over objects, shares of digits and exact matches are all treated alike.

Test is graded once, after a model ships, on examples no grade has read: the LEDGER
(a record the package ships) lists every test range spent, by whom and why, and
`spend` refuses a range that overlaps one of them.
"""

import json
import math
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "paligemma_lib" / "assets" / "ledger.json"
MARGIN = 2.0  # standard errors, both ways
GROUPS = 30  # the jackknife's groups (29 degrees of freedom)
SHIP_SPLIT = "validation"  # the only split a ship decision reads


def paired_jackknife(
    new_rows, old_rows, aggregate, key, cluster=None, groups=GROUPS
) -> dict:
    """Two models' rows on the same examples (in the same order, `key(row)` naming
    the example) and `aggregate(rows) -> {measure: value}` -> for each measure, the
    new and old values, their difference and its jackknife standard error. Rows
    of one `cluster(row)` (one scene asked three questions) share a group"""
    if [key(r) for r in new_rows] != [key(r) for r in old_rows]:
        raise ValueError("the two models were not graded on the same examples")
    cluster = cluster or key
    first = {}  # each cluster's number, in order of first appearance
    group = [first.setdefault(cluster(r), len(first)) % groups for r in new_rows]
    if len(first) < groups:
        raise ValueError(f"{len(first)} examples: at least {groups} are needed")
    new, old = aggregate(new_rows), aggregate(old_rows)
    left_out = []  # the difference of every measure, each group left out in turn
    for g in range(groups):
        keep = [i for i in range(len(new_rows)) if group[i] != g]
        a = aggregate([new_rows[i] for i in keep])
        b = aggregate([old_rows[i] for i in keep])
        left_out.append({m: a[m] - b[m] for m in new})
    out = {}
    for m in new:
        diffs = [d[m] for d in left_out]
        if any(math.isnan(x) for x in [new[m], old[m], *diffs]):
            continue  # a measure some group cannot compute (no box at all)
        mean = sum(diffs) / groups
        var = (groups - 1) / groups * sum((d - mean) ** 2 for d in diffs)
        out[m] = {"new": new[m], "old": old[m], "difference": new[m] - old[m],
                  "standard error": var**0.5}  # fmt: skip
    return out


def decide(comparison: dict, aims: list) -> dict:
    """Ship if a measure of `aims` rises by more than MARGIN standard errors and
    no measure of `comparison` (higher is better) falls by more than MARGIN of
    its own"""
    missing = [m for m in aims if m not in comparison]
    if missing:
        raise ValueError(f"no paired comparison of {', '.join(missing)}")

    def z(m):
        c = comparison[m]
        se = c["standard error"]
        return c["difference"] / se if se > 0 else 0.0

    gains = [m for m in aims if z(m) > MARGIN]
    falls = [m for m in comparison if z(m) < -MARGIN]
    return {"margin (standard errors)": MARGIN, "aims": list(aims),
            "rises": gains, "falls": falls,
            "ships": bool(gains) and not falls}  # fmt: skip


# --- the segment adapter (chapter 12.1) ---

SEGMENT_MEASURES = ("mIoU", "mIoU circle", "mIoU square", "mIoU triangle",
                    "filled box mIoU")  # fmt: skip
SEGMENT_AIMS = ["mIoU"]
SEGMENT_GOAL = 0.75  # the mask mIoU, and 0.10 above the better baseline


def segment_aggregate(rows: list) -> dict:
    "Rows of tools/evaluate_segment.py (their grades) -> the measures compared"
    from paligemma_lib.segment_eval import summarize

    kinds = [r["prompt"].removeprefix("segment ") for r in rows]
    metrics = summarize(kinds, [r["grades"] for r in rows])
    return {m: metrics[m] for m in SEGMENT_MEASURES}


def segment_decision(new_rows: list, old_rows: list) -> dict:
    "The new adapter against the shipped one, graded on the same validation scenes"
    paired = paired_jackknife(
        new_rows, old_rows, segment_aggregate, key=lambda r: (r["seed"], r["prompt"])
    )
    return decide(paired, SEGMENT_AIMS) | {"paired": paired}


def meets_segment_goal(metrics: dict) -> bool:
    better = max(metrics["filled box mIoU"], metrics["class mask mIoU"])
    return metrics["mIoU"] >= SEGMENT_GOAL and metrics["mIoU"] >= better + 0.10


# --- nano-real (chapter 12.2) ---

GOALS = {"items named": 0.90, "3-digit numbers read": 0.90, "items counted": 0.97}
KEPT = ("ch. 11 shapes captioned", "ch. 11 boxes, IoU >= 0.5", "ch. 11 text read")
KEPT_LOSS = 0.02  # chapter 11's skills may fall this much below the shipped nano's


def shortfalls(measured: dict, nano: dict) -> dict:
    """How far a model is from each of chapter 12.2's goals (0 where met): the
    three thresholds, and chapter 11's skills within KEPT_LOSS of `nano`'s"""
    short = {k: max(0.0, goal - measured[k]) for k, goal in GOALS.items()}
    short |= {k: max(0.0, nano[k] - KEPT_LOSS - measured[k]) for k in KEPT}
    return {k: round(v, 4) for k, v in short.items()}


def real_aggregate(rows: list) -> dict:
    "Rows of tools/evaluate_real_gap.py -> chapter 12.2's measures (`measures`)"
    from paligemma_lib.evaluation import compute_metrics
    from paligemma_lib.real_images import measures

    worlds = sorted({r["world"] for r in rows})
    metrics = {w: compute_metrics([r for r in rows if r["world"] == w]) for w in worlds}
    return measures({"rows": rows, "metrics": metrics})


def real_decision(new_rows: list, old_rows: list, nano: dict) -> dict:
    """The new model against the shipped one on the same validation examples: it
    must raise a goal the shipped model has not met (every goal, if it met all)
    by the margin, and let no measure fall by more than its own"""
    paired = paired_jackknife(
        new_rows, old_rows, real_aggregate,
        key=lambda r: (r["world"], r["prompt"], r["seed"]),
        cluster=lambda r: (r["world"], r["seed"]),
    )  # fmt: skip
    old = {m: c["old"] for m, c in paired.items()}
    new = {m: c["new"] for m, c in paired.items()}
    short = shortfalls(old, nano)
    aims = [m for m, gap in short.items() if gap > 0] or list(GOALS)
    return decide(paired, aims) | {
        "shipped shortfalls": short,
        "new shortfalls": shortfalls(new, nano),
        "paired": paired,
    }


# --- nano-448, nano's stage 2 (chapter 11.4, issue 52) ---

SMALL_TEXT = "small text, 1 - CER"  # higher is better, as decide() reads
STAGE2_AIMS = [SMALL_TEXT]
STAGE2_KEPT = KEPT  # chapter 11's skills, as chapter 12.2 keeps them
CER_GOAL = 0.5  # the small text's CER at 448: at most half of nano's at 224


def stage2_measures(rows: list) -> dict:
    """Rows of tools/gpu_stage2.py's `grade` -> the measures compared: the
    detail world's text (1 - its character error rate, and lines read whole)
    and counts, and chapter 11's skills"""
    from paligemma_lib.evaluation import (
        character_error_rate,
        detection_metrics,
        exact_match,
    )

    def pairs(world, task):
        mine = [r for r in rows if r["world"] == world and r["task"] == task]
        return [r["prediction"] for r in mine], [r["answer"] for r in mine]

    text = pairs("detail", "ocr")
    return {
        SMALL_TEXT: 1 - character_error_rate(*text),
        "small text read": exact_match(*text),
        "small shapes counted": exact_match(*pairs("detail", "count")),
        "ch. 11 shapes captioned": exact_match(*pairs("shapes", "caption")),
        "ch. 11 boxes, IoU >= 0.5": detection_metrics(*pairs("shapes", "detect"))[
            "IoU >= 0.5"
        ],
        "ch. 11 text read": exact_match(*pairs("ocr", "ocr")),
    }


def stage2_shortfalls(measured: dict, nano: dict) -> dict:
    """How far a model at 448 is from each of the issue's goals (0 where met),
    against nano at 224: the small text's CER at most CER_GOAL of nano's, and
    chapter 11's skills within KEPT_LOSS of nano's"""
    cer, nano_cer = 1 - measured[SMALL_TEXT], 1 - nano[SMALL_TEXT]
    short = {"small text CER": max(0.0, cer - CER_GOAL * nano_cer)}
    short |= {k: max(0.0, nano[k] - KEPT_LOSS - measured[k]) for k in STAGE2_KEPT}
    return {k: round(v, 4) for k, v in short.items()}


def stage2_paired(new_rows: list, old_rows: list) -> dict:
    "The paired comparison of two grades of the same examples"
    return paired_jackknife(
        new_rows, old_rows, stage2_measures,
        key=lambda r: (r["world"], r["task"], r["index"]),
        cluster=lambda r: (r["world"], r["index"]),
    )  # fmt: skip


def stage2_decision(new_rows: list, nano_rows: list, shipped_rows=None) -> dict:
    """The model at 448 against nano at 224 on the same validation examples: it
    ships only if it meets every goal (stage2_shortfalls), reads the small text
    better by more than MARGIN standard errors, and lets no measure fall by more
    than its own MARGIN; with `shipped_rows` (a nano-448 shipped before), it must
    also beat that one by the same rule"""
    paired = stage2_paired(new_rows, nano_rows)
    new = {m: c["new"] for m, c in paired.items()}
    nano = {m: c["old"] for m, c in paired.items()}
    short = stage2_shortfalls(new, nano)
    meets = not any(short.values())
    decision = decide(paired, STAGE2_AIMS)
    out = decision | {"meets the goals": meets, "shortfalls": short, "paired": paired}
    ships = decision["ships"] and meets
    if shipped_rows is not None:
        against = stage2_paired(new_rows, shipped_rows)
        second = decide(against, STAGE2_AIMS)
        out["against the shipped nano-448"] = second | {"paired": against}
        ships = ships and second["ships"]
    return out | {"ships": ships}


# --- the ledger of test ranges spent ---


def read_ledger(path: Path = LEDGER) -> dict:
    return json.loads(path.read_text())


def overlapping(ledger: dict, world: str, start: int, stop: int) -> list:
    "The entries that spent some of test indices start..stop (inclusive) of world"
    return [
        e
        for e in ledger["test ranges spent"]
        if e["world"] == world and e["start"] <= stop and start <= e["stop"]
    ]


def fresh_start(ledger: dict, worlds, floor: int = 0) -> int:
    "The first test index at or after `floor` past every range spent in `worlds`"
    stops = [e["stop"] + 1 for e in ledger["test ranges spent"] if e["world"] in worlds]
    return max([floor, *stops])


def spend(path: Path, world: str, start: int, n: int, by: str, why: str) -> dict:
    """Write into the ledger that test indices start..start+n-1 of `world` are
    graded now, by `by` (a command or record), for `why`; refuse a range that
    overlaps one already spent. Called before the grade, so a grade that fails
    halfway still counts as spent"""
    ledger = read_ledger(path)
    stop = start + n - 1
    spent = overlapping(ledger, world, start, stop)
    if spent:
        before = "; ".join("{start}-{stop} by {by}".format(**e) for e in spent)
        raise ValueError(
            f"test indices {start}-{stop} of {world} were graded before "
            f"({before}); grade from {fresh_start(ledger, [world], start)} on"
        )
    entry = {"world": world, "start": start, "stop": stop, "by": by, "for": why,
             "date": datetime.now(UTC).strftime("%Y-%m-%d")}  # fmt: skip
    ledger["test ranges spent"].append(entry)
    path.write_text(json.dumps(ledger, indent=1) + "\n")
    return entry


def check_undecided(ledger: dict, model: str, stamp: str) -> None:
    """Refuse a try the ledger holds a decision for: each try is decided once (an
    ingest run twice would grade again, and overwrite the first decision's record)"""
    for d in ledger["ship decisions"]:
        if d.get("model") == model and d.get("try") == stamp:
            raise ValueError(
                f"{model}'s try {stamp} was decided before (ships: {d['ships']}; "
                f"{', '.join(d.get('records', []))}): a try is decided once"
            )


def record_decision(path: Path, decision: dict) -> None:
    "A ship decision, as it was made, appended to the ledger's list"
    ledger = read_ledger(path)
    ledger["ship decisions"].append(decision)
    path.write_text(json.dumps(ledger, indent=1) + "\n")
