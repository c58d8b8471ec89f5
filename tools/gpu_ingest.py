# Hand-written, not exported from a notebook.
"""What `tools/gpu_run.py --ingest DIR` does with a model or adapter a GPU sent back:
compare it with the shipped one on validation, by tools/ship_rules.py's rule, and only
if it ships, grade it once on test examples the ledger has never seen.

Each function takes the places it reads and writes (the shipped folder, the ledger,
the records' folder) and the grading function, so the tests run the whole decision
on tiny fakes and check which split and which examples every grade read.
"""

import json
import shutil
import tarfile
import tempfile
from pathlib import Path

import ship_rules

ROOT = Path(__file__).resolve().parents[1]
# validation scenes the segment ship decision reads, the same for every try: past
# the 64 that the part's own choice between its two runs read (0-63)
SEGMENT_SHIP_SCENES = (64, 300)
SEGMENT_TEST_SCENES = 300  # graded once, after a ship
SEGMENT_FILES = ("adapter_config.json", "adapter_model.safetensors")
# nano-real's decision: 300 examples of each new world (clothing: 100 scenes asked
# three questions), 200 of chapter 11's (shapes: 50 scenes asked four)
REAL_N, REAL_OLD = 300, 200
REAL_TEST_WORLDS = {"clothing": REAL_N // 3, "handwriting": REAL_N,
                    "shapes": REAL_OLD // 4, "ocr": REAL_OLD}  # fmt: skip


BY = "tools/gpu_run.py --ingest"
DECISION = ("model", "try", "decided on", "aims", "rises", "falls", "ships")


def note(ledger: Path, record: dict, where: str) -> None:
    "The decision into the ledger, as it was made, and where its record is"
    entry = {k: record[k] for k in DECISION} | {"records": [where]}
    ship_rules.record_decision(ledger, entry)
    print(json.dumps({k: record[k] for k in ("rises", "falls", "ships")}))


def ship_segment(
    tar: Path, stamp: str, *, evaluate=None, shipped=None, ledger=ship_rules.LEDGER,
    results=ROOT / "benchmarks" / "results",
) -> dict:  # fmt: skip
    """The segment adapter in `tar` against the `shipped` one, both on validation
    scenes SEGMENT_SHIP_SCENES; if it ships, into `shipped`, then graded once on
    SEGMENT_TEST_SCENES fresh test scenes. `evaluate(folder, split, start, n)` is
    tools/evaluate_segment.py's"""
    if evaluate is None:
        from evaluate_segment import evaluate
    if shipped is None:
        from paligemma_lib.adapters import resolve_adapter_path

        shipped = resolve_adapter_path("segment")
    ship_rules.check_undecided(ship_rules.read_ledger(ledger), "segment", stamp)
    work = Path(tempfile.mkdtemp()) / "segment"
    with tarfile.open(tar) as archive:
        archive.extractall(work, filter="data")
    start, n = SEGMENT_SHIP_SCENES
    new = evaluate(work, ship_rules.SHIP_SPLIT, start, n)
    old = evaluate(shipped, ship_rules.SHIP_SPLIT, start, n)
    decision = ship_rules.segment_decision(new["rows"], old["rows"])
    record = {
        "model": "segment", "try": stamp,
        "decided on": f"{ship_rules.SHIP_SPLIT} scenes {start}-{start + n - 1}",
        "new": new["metrics"], "shipped": old["metrics"],
        "meets the goal": ship_rules.meets_segment_goal(new["metrics"]),
    } | decision  # fmt: skip
    name = f"segment-gpu-validation-{stamp}.json"
    rows = {"rows": {"new": new["rows"], "shipped": old["rows"]}}
    (results / name).write_text(json.dumps(record | rows, indent=1) + "\n")
    note(ledger, record, f"benchmarks/results/{name}")
    if not record["ships"]:
        return record
    adapter_record = json.loads((work / "training_record.json").read_text())
    first = ship_rules.fresh_start(ship_rules.read_ledger(ledger), ["segments"])
    why = f"the {stamp} adapter's grade, once, after it shipped"
    ship_rules.spend(ledger, "segments", first, SEGMENT_TEST_SCENES, BY, why)
    # graded where it was unpacked: the package changes only once all of it is done
    test = evaluate(work, "test", first, SEGMENT_TEST_SCENES)
    for file in SEGMENT_FILES:
        shutil.copyfile(work / file, shipped / file)
    adapter_record["evaluations"] = {"segments/validation": new, "segments/test": test}
    (shipped / "training_record.json").write_text(
        json.dumps(adapter_record, indent=1) + "\n"
    )
    print(f"shipped into {shipped}; test {test['indices']}: {test['metrics']['mIoU']}")
    return record | {"test": test["metrics"]}


def ship_real(
    model: Path, stamp: str, *, evaluate=None, ship=None, ledger=ship_rules.LEDGER,
    records=ROOT / "paligemma_lib" / "assets" / "real",
) -> dict:  # fmt: skip
    """The model folder `model` against the shipped nano-real (and nano, for what
    chapter 11's skills must keep) on the same validation examples; if it ships,
    `ship(model)` puts it in the package and it is graded once on fresh test
    examples. `evaluate(n, split, old=, model=, start=)` is
    tools/evaluate_real_gap.py's"""
    if evaluate is None:
        from evaluate_real_gap import evaluate
    if ship is None:
        from ship_nano import DEST
        from ship_nano import ship as ship_to

        def ship(folder):
            return ship_to(folder, DEST.parent / "nano-real")

    ship_rules.check_undecided(ship_rules.read_ledger(ledger), "nano-real", stamp)
    split = ship_rules.SHIP_SPLIT
    graded = {
        name: evaluate(REAL_N, split, old=REAL_OLD, model=source)
        for name, source in (("new", model), ("shipped", "nano-real"), ("nano", "nano"))
    }
    nano = ship_rules.real_aggregate(graded["nano"]["rows"])
    decision = ship_rules.real_decision(
        graded["new"]["rows"], graded["shipped"]["rows"], nano
    )
    run = json.loads((model / "training_record.json").read_text())
    record = {
        "model": "nano-real", "try": stamp,
        "decided on": f"{split}: {REAL_N} examples of each new world, "
        f"{REAL_OLD} of chapter 11's",
        "command": graded["new"]["command"].replace(str(model), "MODEL"),
        "commit": graded["new"]["commit"],
        "model_sha256": {k: r["model_sha256"] for k, r in graded.items()},
        "trained": {"recipe": run.get("recipe", "base"),
                    "steps": run["steps"], "seconds": run["seconds"],
                    "batch_size": run["train_config"]["batch_size"],
                    "worlds": run["worlds"], "device": run["device"]},
        "measures": {"new": {m: c["new"] for m, c in decision["paired"].items()},
                     "shipped": {m: c["old"] for m, c in decision["paired"].items()},
                     "nano": nano},
    } | decision  # fmt: skip
    name = f"real-gpu-validation-{stamp}.json"
    (records / name).write_text(json.dumps(record, indent=1) + "\n")
    note(ledger, record, f"paligemma_lib/assets/real/{name}")
    if not record["ships"]:
        return record
    first = ship_rules.fresh_start(ship_rules.read_ledger(ledger), REAL_TEST_WORLDS)
    why = f"the {stamp} nano-real's grade, once, after it shipped"
    for world, n in REAL_TEST_WORLDS.items():
        ship_rules.spend(ledger, world, first, n, BY, why)
    # graded where it was unpacked: the package changes only once all of it is done
    test = evaluate(REAL_N, "test", old=REAL_OLD, model=model, start=first)
    out = records / f"real-after-gpu-{stamp}.json"
    out.write_text(json.dumps(test, indent=1) + "\n")
    print(ship(model))
    print(f"graded on test from index {first}: {out}")
    return record | {"test record": out.name}


# nano-448's decision (issue 52): the examples each grade reads, per task, from index
# 0 of validation or from the ledger's first fresh index of test
STAGE2_SIZES = {"detail": 150, "shapes": 100, "ocr": 200}  # 300, 200, 200 rows
STAGE2_NAME = "nano-448"


def ship_stage2(
    models: dict, stamp: str, *, grade=None, ship=None, ledger=ship_rules.LEDGER,
    records=ROOT / "paligemma_lib" / "assets" / "stage2", shipped=None,
    test_start=None, by=BY,
) -> dict:  # fmt: skip
    """The models a stage-2 run sent back ({'448': folder, '224': folder}) graded
    on the same validation examples beside nano at 224 and nano resampled to 448
    untrained (and a nano-448 `shipped` before, if any, which the new one must
    beat); the 448 model ships, by `ship(folder)`, only if it meets the issue's
    goals (ship_rules.stage2_decision); then it and nano at 224 are graded once
    on test examples from the ledger's first fresh index (or `test_start`),
    spent in the ledger before the grade. `grade(source, size, split, start,
    sizes)` is tools/gpu_stage2.py's; `by`, the command the ledger names (a
    run trained here: tools/stage2_local.py's). The records are named by where
    the 448 model trained: stage2-gpu-validation-STAMP.json, or -cpu-"""
    if grade is None:
        from gpu_stage2 import grade
    if ship is None:
        from ship_nano import DEST
        from ship_nano import ship as ship_to

        def ship(folder):
            return ship_to(folder, DEST.parent / STAGE2_NAME)

    if shipped is None:
        from ship_nano import DEST

        shipped = DEST.parent / STAGE2_NAME
    ship_rules.check_undecided(ship_rules.read_ledger(ledger), STAGE2_NAME, stamp)
    split, sizes = ship_rules.SHIP_SPLIT, STAGE2_SIZES
    asked = {"nano at 224": ("nano", 224), "nano at 448, untrained": ("nano", 448),
             "new at 448": (models["448"], 448)}  # fmt: skip
    if "224" in models:
        asked["control at 224"] = (models["224"], 224)
    before = (shipped / "model.safetensors").exists()
    if before:
        asked["shipped nano-448"] = (shipped, 448)
    graded = {
        k: grade(source, size, split, 0, sizes) for k, (source, size) in asked.items()
    }
    decision = ship_rules.stage2_decision(
        graded["new at 448"]["rows"], graded["nano at 224"]["rows"],
        graded["shipped nano-448"]["rows"] if before else None,
    )  # fmt: skip
    run = json.loads((models["448"] / "training_record.json").read_text())
    starts = run["segments"]  # the start and each resume: the steps each ran
    record = {
        "model": STAGE2_NAME, "try": stamp,
        "decided on": f"{split} from index 0: "
        + ", ".join(f"{n} a task of {w}" for w, n in sizes.items()),
        # a training record times its last start only: the whole run's seconds
        # are known when one start ran every step
        "trained": {"steps": run["steps"], "starts": len(starts),
                    "seconds": run["seconds"] if len(starts) == 1 else None,
                    "last start": {"steps": starts[-1]["steps"],
                                   "seconds": run["seconds"]},
                    "batch_size": run["train_config"]["batch_size"],
                    "lr": run["train_config"]["lr"], "worlds": run["worlds"],
                    "device": run["device"],
                    "control at 224": "224" in models},
        "measures": {k: g["measures"] for k, g in graded.items()},
        "model_sha256": {k: g["model_sha256"] for k, g in graded.items()},
    } | decision  # fmt: skip
    records.mkdir(parents=True, exist_ok=True)
    where = "gpu" if run["device"].startswith("cuda") else run["device"].split(":")[0]
    name = f"stage2-{where}-validation-{stamp}.json"
    (records / name).write_text(json.dumps(record, indent=1) + "\n")
    note(ledger, record, f"paligemma_lib/assets/stage2/{name}")
    if not record["ships"]:
        return record
    first = test_start
    if first is None:
        first = ship_rules.fresh_start(ship_rules.read_ledger(ledger), sizes)
    why = f"the {stamp} {STAGE2_NAME}'s grade, once, after it shipped"
    spent = ship_rules.read_ledger(ledger)
    for world, n in sizes.items():  # every range checked before one is spent
        if ship_rules.overlapping(spent, world, first, first + n - 1):
            raise ValueError(
                f"test indices {first}-{first + n - 1} of {world} were graded "
                f"before; grade from {ship_rules.fresh_start(spent, sizes)} on"
            )
    for world, n in sizes.items():
        ship_rules.spend(ledger, world, first, n, by, why)
    # graded where it was unpacked: the package changes only once all of it is done
    test = {
        "nano-448 at 448": grade(models["448"], 448, "test", first, sizes),
        "nano at 224": grade("nano", 224, "test", first, sizes),
    }
    out = records / f"stage2-after-{where}-{stamp}.json"
    out.write_text(json.dumps({"decided": name, "graded": test}, indent=1) + "\n")
    print(ship(models["448"]))
    print(f"graded on test from index {first}: {out}")
    return record | {"test record": out.name}
