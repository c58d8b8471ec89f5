# Hand-written, not exported from a notebook.
"""Train the nano model on one GPU within a time budget: two learning rates side by
side, then the test-split metrics of both, and the better one packed for shipping.

    OUT=/tmp/out python tools/train_nano_gpu.py [--budget 500] [--config nano]

Each run is the documented command, `python -m paligemma_lib train --config nano ...`,
with its step count chosen here: a 60-step run of both (discarded) measures steps per
second on this machine, and the real runs get as many steps as fit in what is left of
the budget, less the time the test evaluation needs. Everything the run wrote that is
needed comes back in $OUT: the winner's model folder as a tar archive in parts of at
most 15 MB (`cat nano.tar.part* | tar x`), both training records with their test
metrics, and the log. `tools/ship_nano.py` then copies the model into the package.
"""

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=500, help="seconds in all")
    parser.add_argument("--config", default="nano")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=7, help="per run")
    parser.add_argument("--runs", default=",".join(RUNS), help="which of RUNS")
    parser.add_argument("--eval-reserve", type=float, default=100, help="seconds")
    args = parser.parse_args()
    begin = time.time()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/nano-gpu")
    log = open(out / "log.txt", "w")

    def say(*words):
        line = " ".join(str(w) for w in words)
        print(line, flush=True)
        print(line, file=log, flush=True)

    def train(name, steps, extra, folder, pipe=False):
        command = [
            sys.executable, "-m", "paligemma_lib", "train",
            "--config", args.config,
            "--out", str(folder),
            "--steps", str(steps),
            "--batch-size", str(args.batch_size),
            "--worlds", "shapes=0.7,ocr=0.3",
            "--train-size", "5000000",
            "--workers", str(args.workers),
            "--no-progress",
            *extra,
        ]  # fmt: skip
        say("$", " ".join(command[1:]))
        return subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE if pipe else log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    # 1. how many steps a second: the time between two evaluations of a short run
    runs = {n: e for n, e in RUNS.items() if n in args.runs.split(",")}
    stamps = {}
    procs = []
    for n, e in runs.items():
        extra = [*e, "--eval-size", "16", "--eval-every", "30"]
        procs.append(train(n, 90, extra, work / f"cal-{n}", pipe=True))
    for line in procs[0].stdout:
        log.write(line)
        if line.startswith(("step 30:", "step 90:")):
            stamps[line.split(":")[0]] = time.time()
    if any(p.wait() for p in procs) or len(stamps) != 2:
        say("calibration failed; see the log")
        return 1
    per_step = (stamps["step 90"] - stamps["step 30"]) / 60
    left = args.budget - (time.time() - begin) - args.eval_reserve
    steps = max(100, int(left / per_step * 0.85) // 100 * 100)
    say(f"calibration: {per_step:.3f} s a step ({len(runs)} runs); {steps} steps fit")

    # 2. the runs
    evals = ["--eval-every", str(steps // 10), "--eval-size", "128"]
    saves = ["--save-every", str(steps // 4)]
    procs = {
        n: train(n, steps, [*e, *evals, *saves], work / n) for n, e in runs.items()
    }
    codes = {n: p.wait() for n, p in procs.items()}
    say("training exit codes:", codes, f"({time.time() - begin:.0f} s in)")

    # 3. test metrics, written into each record
    scores = {}
    for name, code in codes.items():
        if code:
            continue
        for world, limit in (("shapes", 480), ("ocr", 200)):
            subprocess.run(
                [
                    sys.executable, "-m", "paligemma_lib", "evaluate",
                    "--model", str(work / name), "--world", world,
                    "--split", "test", "--limit", str(limit),
                    "--batch-size", "64", "--record",
                ],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
            )  # fmt: skip
        record = json.loads((work / name / "training_record.json").read_text())
        (out / f"record-{name}.json").write_text(json.dumps(record, indent=1))
        m = {}
        for evaluation in record["evaluations"].values():
            m |= evaluation["metrics"]
        score = [
            m["caption"]["exact match"],
            m["count"]["exact match"],
            m["colour"]["exact match"],
            m["detection"]["mean IoU"],
            max(0.0, 1 - m["ocr"]["character error rate"]),
        ]
        scores[name] = sum(score) / len(score)
        say(name, "test:", json.dumps(m))
    if not scores:
        say("no run finished")
        return 1
    best = max(scores, key=scores.get)
    say("scores:", scores, "-> shipping", best)

    # 4. the winner's model files, in parts small enough to come back
    archive = work / "nano.tar"
    with tarfile.open(archive, "w") as tar:
        for name in SHIPPED:
            tar.add(work / best / name, arcname=f"nano/{name}")
    data = archive.read_bytes()
    for i in range(0, len(data), PART):
        (out / f"nano.tar.part{i // PART}").write_bytes(data[i : i + PART])
    say(f"done in {time.time() - begin:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
