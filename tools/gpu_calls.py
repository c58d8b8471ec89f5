# Hand-written, not exported from a notebook.
"""What each GPU call bought: every training part that a call of tools/gpu_run.py
ran (its record, benchmarks/results/gpu-run-*.json), beside the ship decision that
the ledger (paligemma_lib/assets/ledger.json) holds for it, matched by the part's
start to the minute. tools/speed_page.py prints the table on the speed page; issue
49 asks for it: GPU minutes are rare, and each must show what it bought.

    python tools/gpu_calls.py        # the table, as the speed page shows it
"""

import json
import re
from datetime import datetime
from pathlib import Path

from gpu_ingest import SEGMENT_SHIP_SCENES
from gpu_run import SEGMENT_VALIDATION

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LEDGER = ROOT / "paligemma_lib" / "assets" / "ledger.json"
# the parts that train a model or adapter, and the name its ship decisions carry
TRAINING = {"segment": "segment", "real": "nano-real", "stage2": "nano-448"}
SHOWN_GOALS = ("items named", "3-digit numbers read")  # nano-real's two missed
CHOICE = f"0-{SEGMENT_VALIDATION - 1}"  # the scenes a segment part chooses on
SHIP = f"{SEGMENT_SHIP_SCENES[0]}-{sum(SEGMENT_SHIP_SCENES) - 1}"
MONTHS = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()
HEADER = ["call (UTC)", "GPU", "part", "steps \u00d7 batch", "examples a second",
          "on validation", "shipped"]  # fmt: skip


def minute(text: str) -> str:
    """A part's start or a try's stamp, to the minute: '2026-11-26T04:38:11+00:00',
    '2026-11-26 04:38 (H200)' and '20261126-0438' are all '202611260438'"""
    return re.sub(r"\D", "", text)[:12]


def day_and_time(started: str) -> str:
    "'2026-11-26T04:38:11+00:00' -> '26 Nov 2026, 04:38' (no hyphen to break a cell)"
    at = datetime.fromisoformat(started)
    return f"{at.day} {MONTHS[at.month - 1]} {at.year}, {at:%H:%M}"


def short_gpu(device: str) -> str:
    "'NVIDIA H100 80GB HBM3' -> 'H100'"
    found = re.search(r"\b([A-Z]\d{2,4})\b", device)
    return found.group(1) if found else device


def calls(results: Path = RESULTS) -> list[tuple[str, dict]]:
    "(file name, record) of every real call (no rehearsal), oldest first"
    found = sorted(results.glob("gpu-run-*.json"))  # named by date: in order
    records = [(p.name, json.loads(p.read_text())) for p in found]
    return [(name, r) for name, r in records if not r.get("rehearsal")]


def trained_here(entry: dict) -> bool:
    "A try trained on a CPU (tools/stage2_local.py): its records are named -cpu-"
    return any("-cpu-" in Path(r).name for r in entry.get("records", []))


def decisions(ledger: dict) -> dict[tuple[str, str], dict]:
    "(model, minute of its try) -> the ship decision, for the GPU tries"
    found = {}
    for entry in ledger["ship decisions"]:
        when = minute(entry["try"])
        # a try stamped to the minute is a GPU call's part, unless it trained here
        if len(when) == 12 and not trained_here(entry):
            found[entry["model"], when] = entry
    return found


def number(value, spec: str) -> str:
    "A measure as the table prints it; a run that wrote none (it failed): -"
    return "-" if value is None else format(value, spec)


def rates(part: dict) -> str:
    "Each run's examples a second"
    runs = part.get("runs") or part.get("models")
    if isinstance(runs, dict):
        return "; ".join(
            f"{n} {number(r.get('examples_per_s'), ',.0f')}" for n, r in runs.items()
        )
    return number(part.get("examples_per_s"), ",.0f")


def on_validation(name: str, part: dict, entry: dict | None, root: Path) -> str:
    """What the part's runs scored on validation, or what the decision compared:
    short, with no range or date in it (a narrow cell breaks those at hyphens)"""
    if "error" in part:  # its words go under the table (`details`)
        return "-"
    if name == "segment":
        scores = ", ".join(
            f"{n} {number(r.get('validation', {}).get('mIoU'), '.3f')}"
            for n, r in part["runs"].items()
        )
        return f"{scores}; chose {part.get('chosen on validation', 'none')}"
    if entry is None or not entry.get("records"):
        return "-"
    record = json.loads((root / entry["records"][0]).read_text())
    if name == "real":
        new, old = record["measures"]["new"], record["measures"]["shipped"]
        now = ", ".join(f"{new[m]:.3f}" for m in SHOWN_GOALS)
        return f"{now} (was {', '.join(f'{old[m]:.3f}' for m in SHOWN_GOALS)})"
    return "rose: " + (", ".join(entry.get("rises", [])) or "nothing")


def answer(part: dict, entry: dict | None) -> str:
    "The table's last cell: yes, no, not decided, failed"
    if "error" in part:
        return "failed"
    if entry is None:
        return "not decided"
    return "yes" if entry["ships"] else "no"


def details(part: dict, entry: dict | None) -> str:
    "The decision as the ledger words it (under the table), or why there is none"
    if "error" in part:
        return "the part failed: " + " ".join(str(part["error"]).split())
    if entry is None:
        return "the ledger holds no decision on it"
    said = f"decided on {entry['decided on']}"
    if "new" in entry and "shipped" in entry:  # the tries before the paired rule
        said += f", {entry['new']:.3f} against {entry['shipped']:.3f}"
    if "rises" in entry:  # the paired rule's words: what moved by the margin
        rose = ", ".join(entry["rises"]) or "nothing"
        fell = ", ".join(entry.get("falls", [])) or "nothing"
        said += f"; rose by the margin: {rose}; fell by it: {fell}"
    if "sent back" in entry:
        said += f"; sent back: {entry['sent back']}"
    return said


def rows(results: Path = RESULTS, ledger: Path = LEDGER, root: Path = ROOT) -> list:
    "One row a training part, oldest first; a part a later record repeats, once"
    decided, seen, out = decisions(json.loads(ledger.read_text())), set(), []
    for file, call in calls(results):
        for name, model in TRAINING.items():
            part = call["parts"].get(name)
            # a part's call: its start (a part an --only call kept from an earlier
            # call carries that call's); a part that failed untrained is shown too
            started = None if part is None else part.get("started", call["started"])
            if part is None or (name, started) in seen:
                continue
            seen.add((name, started))
            entry = decided.get((model, minute(started)))
            when = day_and_time(started)
            steps, batch = part.get("steps", 0), part.get("batch_size", 0)
            out.append({
                "record": file, "started": started,
                "seconds": part.get("part seconds", 0.0),
                "examples": steps * batch * len(part.get("finished", [])),
                "ships": bool(entry and entry["ships"]),
                "cells": [when, short_gpu(call["environment"]["device"]), model,
                          f"{steps:,} \u00d7 {batch}" if steps else "-",
                          rates(part), on_validation(name, part, entry, root),
                          answer(part, entry)],
                "details": f"{when}, {model}: {details(part, entry)}.",
            })  # fmt: skip
    return out


def table(found: list) -> str:
    "The rows as a Markdown table, then each row's decision as the ledger words it"
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row["cells"]) + " |" for row in found]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {r['details']}" for r in found)


def summary(found: list) -> str:
    "The totals: minutes, examples, models shipped"
    minutes = sum(r["seconds"] for r in found) / 60
    examples = sum(r["examples"] for r in found)
    ships = sum(r["ships"] for r in found)
    return (
        f"{len(found)} training parts in all, {minutes:.0f} GPU minutes, "
        f"{examples:,} examples trained on (each run of a part counted); "
        f"{ships} shipped."
    )


if __name__ == "__main__":
    found = rows()
    print(table(found) + "\n\n" + summary(found))
