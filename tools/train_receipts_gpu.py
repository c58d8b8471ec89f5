# Hand-written, not exported from a notebook.
"""Chapter 12's comparison on one GPU, within a time budget: the nano model fine-tuned
on the receipts world three ways, side by side, with the same data, batch and steps:

- lora-language: a LoRA adapter on the decoder's attention and MLP (the shipped one);
- lora-all: LoRA on every Linear, the vision tower's too;
- full: every weight trained.

    OUT=/tmp/out python tools/train_receipts_gpu.py [--budget 420]

Each run is `python -m paligemma_lib train --model nano ...`. Their step count is chosen
here: all three run 90 steps (discarded) and the time between two evaluations gives the
rate. Then each model, and the base model, is evaluated on the receipts test split.
Back in $OUT: the two adapters (tar), the records with their test metrics, the log.
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
    "lora-language": ["--lora", "--lora-targets", "language", "--lr", "2e-3"],
    "lora-all": ["--lora", "--lora-targets", "all", "--lr", "2e-3"],
    "full": ["--lr", "3e-4"],
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=420, help="seconds in all")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=5, help="per run")
    parser.add_argument("--eval-reserve", type=float, default=70, help="seconds")
    parser.add_argument("--limit", type=int, default=200, help="test examples")
    args = parser.parse_args()
    begin = time.time()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/receipts-gpu")
    log = open(out / "log.txt", "w")

    def say(*words):
        line = " ".join(str(w) for w in words)
        print(line, flush=True)
        print(line, file=log, flush=True)

    def train(steps, extra, folder, pipe=False):
        command = [
            sys.executable, "-m", "paligemma_lib", "train",
            "--model", "nano",
            "--out", str(folder),
            "--steps", str(steps),
            "--batch-size", str(args.batch_size),
            "--worlds", "receipts=1",
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

    # 1. the rate, all runs sharing the GPU and the cores
    stamps, procs = {}, []
    for i, (name, extra) in enumerate(RUNS.items()):
        small = [*extra, "--eval-size", "16", "--eval-every", "30"]
        procs.append(train(90, small, work / f"cal-{name}", pipe=i == 0))
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
    say(f"calibration: {per_step:.3f} s a step (3 runs); {steps} steps fit")

    # 2. the runs
    evals = ["--eval-every", str(steps // 10), "--eval-size", "64"]
    procs = {n: train(steps, [*e, *evals], work / n) for n, e in RUNS.items()}
    codes = {n: p.wait() for n, p in procs.items()}
    say("training exit codes:", codes, f"({time.time() - begin:.0f} s in)")

    # 3. test metrics: the base model, then each run
    def evaluate(name, flags):
        run = subprocess.run(
            [
                sys.executable, "-m", "paligemma_lib", "evaluate", *flags,
                "--world", "receipts", "--split", "test",
                "--limit", str(args.limit), "--batch-size", "100",
                "--max-new-tokens", "64",
            ],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        log.write(run.stdout + run.stderr)
        say(f"== {name}\n{run.stdout}{run.stderr}")
        return run.stdout

    results = {"base": evaluate("base (nano)", ["--model", "nano"])}
    for name, code in codes.items():
        if code:
            continue
        folder = work / name
        flags = ["--model", str(folder)]
        if name.startswith("lora"):
            flags = ["--model", "nano", "--adapter", str(folder)]
        results[name] = evaluate(name, flags)
        record = json.loads((folder / "training_record.json").read_text())
        record["test"] = results[name]
        (out / f"record-{name}.json").write_text(json.dumps(record, indent=1))
    (out / "test-tables.json").write_text(json.dumps(results, indent=1))

    # 4. the adapters
    with tarfile.open(out / "adapters.tar", "w") as tar:
        for name in RUNS:
            if name.startswith("lora") and not codes[name]:
                for file in ("adapter_config.json", "adapter_model.safetensors"):
                    tar.add(work / name / file, arcname=f"{name}/{file}")
                tar.add(
                    work / name / "training_record.json",
                    arcname=f"{name}/training_record.json",
                )
    say(f"done in {time.time() - begin:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
