# Hand-written, not exported from a notebook.
"""Nano's stage 2 (chapter 11.4) trained on this machine, without a GPU, and decided
on by the same rules as a GPU run's (tools/gpu_ingest.py's `ship_stage2`).

    python3 tools/stage2_local.py train OUT --steps 400 --batch-size 16 --lr 3e-4
    python3 tools/stage2_local.py ingest OUT

`train` resamples the shipped nano's positions to 448 (tools/gpu_stage2.py's
`resampled_start`, into OUT/start-448) and trains it at 448 on the GPU part's mix
of worlds (gpu_stage2.WORLDS), into OUT/448, saving a checkpoint every 50 steps:
the same command again resumes a run that was stopped, bit for bit. With
`--minutes M` it stops itself at the first checkpoint written after M minutes, so
a run longer than a session goes on across sessions and loses no steps. There is no
control at 224 (the GPU part trains one when its budget holds both).

`ingest` grades OUT/448 on the fixed validation examples beside nano at 224 and
nano resampled untrained, ships it as `nano-448` only if it meets the issue's goals,
and only then grades it once on test examples the ledger has never listed. The try
is named by the time its model was written, so the same run is decided once.
"""

import argparse
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import gpu_ingest
import gpu_stage2

SAVE_EVERY = 50  # steps: a stopped run loses at most this many


def train(
    out: Path, steps: int, batch_size: int, lr: float, workers: int,
    minutes: float | None = None,
) -> int:  # fmt: skip
    """Resample (once), then train at 448, or go on from the run's last
    checkpoint; with `minutes`, stop at the first checkpoint after them"""
    start = out / "start-448"
    if not (start / "model.safetensors").exists():
        gpu_stage2.resampled_start(start)
    run = out / str(gpu_stage2.RESOLUTION)
    command = [
        sys.executable, "-m", "paligemma_lib", "train", "--model", str(start),
        "--out", str(run), "--steps", str(steps), "--batch-size", str(batch_size),
        "--lr", str(lr), "--worlds", gpu_stage2.WORLDS, "--workers", str(workers),
        "--save-every", str(SAVE_EVERY), "--eval-every", "0", "--eval-size", "8",
    ]  # fmt: skip
    if (run / "checkpoints").is_dir():
        command.append("--resume")
    child = subprocess.Popen(command)
    if minutes is None:
        return child.wait()
    return stop_after(child, run, time.monotonic() + 60 * minutes)


def stop_after(child, run: Path, deadline: float, poll: float = 10.0) -> int:
    """Wait for the trainer `child`; once `deadline` (time.monotonic) has passed,
    stop it as soon as it writes a checkpoint. 0 when stopped so: the same
    command goes on from that checkpoint"""
    from paligemma_lib.resume import latest_checkpoint

    before = latest_checkpoint(run)
    while child.poll() is None:
        time.sleep(poll)
        latest = latest_checkpoint(run)
        if time.monotonic() < deadline:
            before = latest
        elif latest != before:
            child.terminate()
            child.wait()
            print(f"stopped at {latest.name}, the first checkpoint after the "
                  "time given: the same command goes on from it")  # fmt: skip
            return 0
    return child.returncode


def stamp_of(run: Path) -> str:
    "The try's name: when its model was written (UTC)"
    written = (run / "model.safetensors").stat().st_mtime
    return datetime.fromtimestamp(written, UTC).strftime("%Y%m%d-%H%M")


def ingest(out: Path, **places) -> dict:
    """gpu_ingest.ship_stage2 on OUT/448 (`places`: its grader, ledger, records'
    and shipped folders, for the tests)"""
    run = out / str(gpu_stage2.RESOLUTION)
    if not (run / "training_record.json").exists():
        raise SystemExit(f"{run} holds no finished run: train it first")
    by = f"tools/stage2_local.py ingest {out}"
    return gpu_ingest.ship_stage2({"448": run}, stamp_of(run), by=by, **places)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("train", "ingest"))
    parser.add_argument("out", type=Path, help="the run's folder")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--minutes", type=float,
        help="train: stop at the first checkpoint written after this long "
        "(the same command goes on from it)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.what == "train":
        return train(
            args.out, args.steps, args.batch_size, args.lr, args.workers,
            args.minutes,
        )  # fmt: skip
    record = ingest(args.out)
    print(f"ships: {record['ships']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
