# Hand-written, not exported from a notebook.
"""Train the nano model on one GPU within a time budget: three learning rates side by
side, graded on the VALIDATION split only (tools/gpu_driver.py holds the shared driver).
It grades no test example: test is graded once, on the dev machine, on a range the
ledger (paligemma_lib/assets/ledger.json) has never seen (tools/evaluate_fresh.py), and
nothing ships without the paired margin of tools/ship_rules.py.

    OUT=/tmp/out python tools/train_nano_gpu.py [--budget 500] [--config nano]

Each run is the documented command, `python -m paligemma_lib train --config nano ...`,
with its step count chosen here: a 90-step run of each (discarded) measures steps per
second on this machine, and the real runs get as many steps as fit in what is left of
the budget, less the time the evaluations need. Back in $OUT: the chosen model folder as
a tar archive in parts of at most 15 MB (`cat nano.tar.part* | tar x`), every run's
record with its validation metrics, and the log.
`tools/ship_nano.py` then copies the model into the package.

The shipped nano model predates this rule: its learning rate was chosen on test indices
0-479 (shapes) and 0-199 (OCR). Chapter 11.3 therefore reports it on test indices from
5000 on (tools/evaluate_fresh.py), which no choice looked at.
"""

import argparse
import json
import os
import sys
import tarfile
from pathlib import Path

from gpu_driver import Driver, choose

RUNS = {
    "lr-1e-3": ["--lr", "1e-3"],
    "lr-2e-3": ["--lr", "2e-3"],
    "lr-5e-4": ["--lr", "5e-4"],
}
SHIPPED = (
    "config.json",
    "model.safetensors",
    "tokenizer.model",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "training_record.json",
)
PART = 15 * 2**20
LIMITS = {"shapes": 480, "ocr": 200}  # examples per world, for choosing and reporting


def score(metrics: dict) -> float:
    "One number per run: the mean of the five tasks' headline metrics (higher better)"
    m = {}
    for world_metrics in metrics.values():
        m |= world_metrics
    parts = [
        m["caption"]["exact match"],
        m["count"]["exact match"],
        m["colour"]["exact match"],
        m["detection"]["mean IoU"],
        max(0.0, 1 - m["ocr"]["character error rate"]),
    ]
    return sum(parts) / len(parts)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=500, help="seconds in all")
    parser.add_argument("--config", default="nano")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=7, help="per run")
    parser.add_argument("--runs", default=",".join(RUNS), help="which of RUNS")
    parser.add_argument("--eval-reserve", type=float, default=150, help="seconds")
    parser.add_argument("--work", type=Path, default=Path("/tmp/nano-gpu"))
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    work = args.work
    base = [
        "--config", args.config, "--batch-size", str(args.batch_size),
        "--worlds", "shapes=0.7,ocr=0.3", "--train-size", "5000000",
        "--workers", str(args.workers),
    ]  # fmt: skip
    driver = Driver(out, work, base)
    runs = {n: e for n, e in RUNS.items() if n in args.runs.split(",")}

    steps = driver.calibrate(runs, args.budget, args.eval_reserve)
    if steps is None:
        return 1
    evals = ["--eval-every", str(steps // 10), "--eval-size", "128"]
    saves = ["--save-every", str(steps // 4)]
    finished = driver.run_all(runs, steps, [*evals, *saves])

    def evaluate(name, split):
        return {
            world: driver.evaluate(work / name, world, split, limit)
            for world, limit in LIMITS.items()
        }

    best, validation = choose(finished, evaluate, score)
    for name in finished:
        record = json.loads((work / name / "training_record.json").read_text())
        record["validation (choice)"] = validation[name]
        record["validation score"] = score(validation[name])
        (work / name / "training_record.json").write_text(json.dumps(record, indent=1))
        (out / f"record-{name}.json").write_text(json.dumps(record, indent=1))
    driver.say("validation scores:", {n: score(v) for n, v in validation.items()})
    driver.say("-> best on validation:", best, "(it ships only by the ship rules)")

    archive = work / "nano.tar"
    with tarfile.open(archive, "w") as tar:
        for name in SHIPPED:
            tar.add(work / best / name, arcname=f"nano/{name}")
    data = archive.read_bytes()
    for i in range(0, len(data), PART):
        (out / f"nano.tar.part{i // PART}").write_bytes(data[i : i + PART])
    return 0


if __name__ == "__main__":
    sys.exit(main())
