"""Training throughput of the nano recipe: the data, the step, and both together.

A benchmark, not a test. Three rates, in examples/s, each the median of --repeats
timings after a warm-up:

- data only: building the nano recipe's step batches (`StepBatches` over
  `SyntheticDataset({"shapes": 0.7, "ocr": 0.3})` and `Collator(processor)`, batch 32,
  the nano processor), in this process (workers 0) and through
  `step_batches(..., workers=W)` for each W of --workers (the workers' start-up is
  left out: the timing starts after the first batch arrives);
- step only: `training_step` of the nano model (AdamW from `make_optimizer`, the
  schedule from `make_scheduler`) on one fixed batch built beforehand, on --device (on
  CUDA with the bf16 autocast that `train()` uses, timed between
  `torch.cuda.synchronize()` calls); the batch stays on the CPU and `training_step`
  moves it, as in `train()`;
- end to end: --e2e-steps steps of data and step together, as `train()` runs them
  (without evaluation or checkpoints), for each W of --workers.

It prints the batch's size (pixel bytes, tokens) and the rates; the results go to
benchmarks/results/train-<device>-<date>.json. Run from the repository root:

    python benchmarks/train_throughput.py                  # CPU, workers 0 and 2
    python benchmarks/train_throughput.py --device cuda --workers 0 8 15

On the book's build machine (2 CPU cores shared with other jobs, torch 2.13.0, float32),
2026-11-23, the default arguments, examples/s (medians). Before: commit 19e522e (a copy
made with `git archive 19e522e`, this script added, run there with PYTHONPATH at the
copy); after: `process_images` builds the batch in uint8 (chapter 1). Another process
was running: load average 1.6 to 2.1 over the two runs, above the 1.5 of a quiet
machine; the step's code did not change, and its rate moved by 11% between the runs:

    nano, batch 32, CPU            before   after
    data only, workers 0             1252    2585   (2.1x)
    data only, workers 2             1393    1458
    step only                        15.2    13.5   (the same code)
    end to end, workers 0            14.9    13.8
    end to end, workers 2            16.3    14.6

(benchmarks/results/train-cpu-20261123-1922-before-19e522e.json and
train-cpu-20261123-1923.json.) Two earlier rounds, alternating before and after on a
busier machine (load average 2.5 to 5.7), gave data only, workers 0: 208 and 71 ex/s
before, 928 and 854 after; workers 2: 609 and 531 before, 848 and 1165 after; the step
2.6 to 4.4 ex/s. Side by side in one process (alternating, median of 9, 32 images of
the mix): `process_images` 1261 -> 4198 images/s, the Collator 1512 -> 3012 ex/s.

Images as 8-bit levels (`--pixels`, `Collator(pixels="uint8")`, what the CLI's train
now sends; the model normalises them on its device), the same machine a little later
(load average 1.8 with the run itself), `python benchmarks/train_throughput.py` and
again with `--pixels normalized uint8`, examples/s, data only
(benchmarks/results/train-cpu-20261123-1958.json and -1959.json):

    nano, batch 32, CPU          float32 pixels   uint8 levels
    data only, workers 0            2684, 1701      2348, 2419
    data only, workers 2            1455, 1587      3014, 3031
    batch's pixels                  18.4 MiB         4.6 MiB

Through two workers, levels double the rate: a batch crosses from a worker as a quarter
of the bytes. In this process the two are within the runs' noise (the levels skip the
normalisation, which the model then does on the device). The step stays at about 16
examples/s, so end to end does not move on this CPU (15.0 and 15.6 examples/s with
workers 0 and 2).

Read: on this CPU the step dominates (about 2 s for 32 examples; the data took 26 ms
of it before, 12 ms now), so end to end does not move. After the change two workers
are slower than none here: the two cores are busy with the step and with other jobs,
and every batch crosses from a worker as 18.4 MiB of float32 pixels. On an H100 the
nano recipe trained at 1,524 examples/s (issue 24), ~100x this CPU's step, and waited
for its data: there the data-only rates per worker are what counts.
"""

import argparse
import json
import statistics
import subprocess
import time
from datetime import datetime
from pathlib import Path

import torch

from paligemma_lib.batching import StepBatches, step_batches
from paligemma_lib.data import Collator, SyntheticDataset
from paligemma_lib.model_files import shipped_model_path
from paligemma_lib.optimization import make_optimizer, make_scheduler
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.processing import PaliGemmaProcessor
from paligemma_lib.train import TrainConfig, grad_scaler, training_step
from paligemma_lib.training_run import model_config

WORLDS = {"shapes": 0.7, "ocr": 0.3}  # the nano recipe's mix (the CLI's default)
TRAIN_SIZE = 100_000  # the CLI's --train-size


def commit() -> str | None:
    "The repository's HEAD commit (with '+changes' if the work tree differs), or None"
    git = ["git", "-C", str(Path(__file__).parent)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        if head.returncode != 0:  # not a git checkout
            return None
        dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"]).returncode != 0
    except OSError:  # no git
        return None
    return head.stdout.strip() + ("+changes" if dirty else "")


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def data_rate(batches, workers, steps, repeats, batch_size) -> float:
    """Median examples/s of drawing `steps` step batches, `repeats` times in a row from
    one iterator (new steps each time: nothing is cached)"""
    upcoming = step_batches(batches, 0, workers)
    next(upcoming)  # the warm-up: starts the workers, fills their queues
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            next(upcoming)
        times.append(time.perf_counter() - start)
    return steps * batch_size / statistics.median(times)


def new_training(processor, config, device):
    "The nano model, its optimiser, schedule and loss scaler, seeded"
    torch.manual_seed(config.seed)
    model = PaliGemmaForConditionalGeneration(
        model_config("nano", processor.tokenizer)
    ).to(device)
    optimizer = make_optimizer(model, config.lr, config.weight_decay)
    scheduler = make_scheduler(
        optimizer, config.warmup_steps, config.steps, config.min_lr_ratio
    )
    return model, optimizer, scheduler, grad_scaler(device)


def step_rate(training, micro_batches, config, device, warmup, repeats) -> float:
    "Median examples/s of `training_step` on the same batch, after `warmup` steps"
    model, optimizer, scheduler, scaler = training

    def step():
        training_step(
            model,
            micro_batches,
            optimizer,
            scheduler,
            config.max_grad_norm,
            device,
            1,
            scaler,
        )

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return config.batch_size / statistics.median(times)


def end_to_end_rate(training, batches, config, device, workers, steps) -> float:
    """examples/s of `steps` steps of data and step, as train() runs them; the first
    step (workers' start-up, first batch) is left out"""
    model, optimizer, scheduler, scaler = training
    upcoming = step_batches(batches, 0, workers)
    start = None
    for i in range(steps + 1):
        if i == 1:
            synchronize(device)
            start = time.perf_counter()
        training_step(
            model,
            next(upcoming),
            optimizer,
            scheduler,
            config.max_grad_norm,
            device,
            1,
            scaler,
        )
    synchronize(device)
    return steps * config.batch_size / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 autocast)")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0, 2], help="DataLoader workers"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--data-steps", type=int, default=8, help="step batches per data timing"
    )
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--e2e-steps", type=int, default=5, help="steps per end-to-end timing"
    )
    parser.add_argument(
        "--pixels",
        nargs="+",
        choices=["uint8", "normalized"],
        default=["uint8", "normalized"],
        help="the batches' images: 8-bit levels (the CLI's train) or float32; the "
        "data rates for each, the step and end to end with the first",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if any(w < 0 for w in args.workers):
        raise SystemExit(f"--workers {args.workers}: each must be >= 0")
    device = torch.device(args.device)
    processor = PaliGemmaProcessor.from_pretrained(shipped_model_path("nano"))
    dataset = SyntheticDataset(WORLDS, size=TRAIN_SIZE)
    config = TrainConfig(steps=TRAIN_SIZE, batch_size=args.batch_size)
    by_pixels = {
        p: StepBatches(dataset, Collator(processor, pixels=p), config)
        for p in args.pixels
    }
    batches = by_pixels[args.pixels[0]]  # the step's and end to end's
    print(
        f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, "
        f"batch {args.batch_size}, {dataset}",
        flush=True,
    )

    micro_batches = batches[0]  # the step-only batch, built once
    batch = micro_batches[0]
    size = {
        "pixels": args.pixels[0],
        "pixel_bytes": batch.pixel_values.nbytes,
        "tokens": batch.input_ids.numel(),
        "real_tokens": int(batch.attention_mask.sum()),
        "sequence_length": batch.input_ids.shape[1],
    }
    print(
        f"a batch: pixel_values {tuple(batch.pixel_values.shape)} "
        f"({size['pixel_bytes'] / 2**20:.1f} MiB), input_ids "
        f"{tuple(batch.input_ids.shape)} ({size['real_tokens']} of "
        f"{size['tokens']} tokens are not padding)",
        flush=True,
    )

    rates = {"data": {}, "step": None, "end_to_end": {}}
    for pixels, some_batches in by_pixels.items():
        for workers in args.workers:
            name = f"{pixels}, workers {workers}"
            rates["data"][name] = data_rate(
                some_batches, workers, args.data_steps, args.repeats, args.batch_size
            )
            print(f"data only, {name}: {rates['data'][name]:.0f} ex/s", flush=True)

    training = new_training(processor, config, device)
    rates["step"] = step_rate(
        training, micro_batches, config, device, args.warmup, args.repeats
    )
    print(f"step only ({device}, {args.pixels[0]}): {rates['step']:.1f} ex/s")

    for workers in args.workers:
        rates["end_to_end"][workers] = end_to_end_rate(
            training, batches, config, device, workers, args.e2e_steps
        )
        print(
            f"end to end, workers {workers}: {rates['end_to_end'][workers]:.1f} ex/s",
            flush=True,
        )

    results = {
        "benchmark": "train_throughput",
        "date": datetime.now().isoformat(timespec="seconds"),
        "commit": commit(),
        "torch": torch.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else None,
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "batch": size,
        "examples_per_s": rates,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"train-{device.type}-{datetime.now():%Y%m%d-%H%M}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
