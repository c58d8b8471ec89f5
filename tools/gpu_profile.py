# Hand-written, not exported from a notebook.
"""tools/gpu_run.py's part `profile` (issue 49 section 2): where a training step of the
two GPU recipes goes, nano-real's (tools/gpu_real.py) and the segment adapter's.

    python3 tools/gpu_run.py --out DIR --only profile    # on the GPU machine
    python3 tools/gpu_profile.py --rehearse               # here, tiny, on the CPU

For each recipe, three rates in examples a second, over the same batches as `train`
builds them (the train command's own parser reads the recipe's flags):

- data: the DataLoader's workers building batches (the scenes drawn, their answers'
  tokens, the pictures' bytes), with no model at all; the segments world's codes are
  left to the device (chapter 12.1), as `train` leaves them;
- step: `training_step` on two batches built once, again and again: their copy to the
  device, the kernels and the host-side Python that launches them (and the segments
  world's codes written on the device first), with no data to wait for;
- loop: both together, as `train` runs them.

For the segment recipe it first checks chapter 12.1's claim on the device itself: the
codes `finish` writes there, against the world's own answers, differ only in near ties.

The slower of data and step bounds the loop. `torch.profiler` over a few steps then
splits a step: the device's time by kernel (the heaviest ones), and how much of the
step's wall time the device was busy at all. Step, loop and profile are measured twice:
`eager`, as the shipped runs trained, and `compiled`, `train --compile`'s step (one
torch.compile graph; its compilation timed apart, in the warm-up steps). The eager step
is timed once more at twice the batch: a rate that nearly doubles says the step is
bound by launching its kernels, not by their arithmetic. The part writes
`profile.json`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from gpu_real import PACKED, REAL_FROM, unpack  # noqa: E402

TOP_KERNELS = 8
LAUNCHES = ("cudaLaunch", "cuLaunch")  # cudaLaunchKernel, cuLaunchKernel(Ex), ...


def recipes(env=os.environ) -> dict:
    """The recipes as the GPU parts run them, the segment part's first run first
    (GPU_SEGMENT_RUNS, GPU_SEGMENT_FROM), then the real part's (GPU_REAL_RECIPE,
    GPU_REAL_FROM); --compile left out: the profile times both ways"""
    from gpu_real import recipe
    from gpu_run import SEGMENT_BASE, segment_runs

    segment = [*SEGMENT_BASE, *next(iter(segment_runs(env).values()))]
    real = list(recipe(env.get("GPU_REAL_RECIPE"))[1])
    real[real.index("--model") + 1] = env.get("GPU_REAL_FROM", REAL_FROM)
    return {name: [f for f in flags if f != "--compile"]
            for name, flags in (("segment", segment), ("real", real))}  # fmt: skip


def parsed(flags: list, steps: int, batch_size: int | None) -> argparse.Namespace:
    "The train command's arguments for `flags` (its own parser)"
    from paligemma_lib.cli.train import add_train_parser

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    flags = list(flags)
    if batch_size is not None:
        flags[flags.index("--batch-size") + 1] = str(batch_size)
    out = tempfile.mkdtemp()
    return parser.parse_args(["train", *flags, "--out", out, "--steps", str(steps)])


def pieces(args: argparse.Namespace, device):
    "(model on device, StepBatches, optimiser, scheduler, scaler) as `train` has them"
    from dataclasses import fields

    from paligemma_lib.batching import StepBatches, training_data
    from paligemma_lib.cli.lora_options import lora_settings
    from paligemma_lib.cli.options import import_data, parse_worlds
    from paligemma_lib.data import Collator
    from paligemma_lib.optimization import make_optimizer, make_scheduler
    from paligemma_lib.train import TrainConfig, grad_scaler
    from paligemma_lib.training_run import TrainingRun, training_model

    data = import_data()
    worlds = parse_worlds(args.worlds)
    settings = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    settings["warmup_steps"] = settings["warmup_steps"] or 0
    config = TrainConfig(**settings)
    train_set = data.SyntheticDataset(
        worlds=worlds, split="train", size=args.train_size
    )
    run = TrainingRun(out=Path(args.out), config=config, train_set=train_set,
                      model=args.model, lora=lora_settings(args),
                      adapter=args.from_adapter, lora_tokens=args.lora_tokens,
                      device=device)  # fmt: skip
    processor, model = training_model(run)
    model.to(device)
    # the worlds that build their own batches (the segments world writes its
    # codes on the device) build them as `train` has them
    plain = Collator(processor, pixels="uint8")
    batches = StepBatches(*training_data(train_set, plain), config)
    optimizer = make_optimizer(model, config.lr, config.weight_decay)
    scheduler = make_scheduler(
        optimizer, config.warmup_steps, config.steps, config.min_lr_ratio
    )
    return model, batches, optimizer, scheduler, grad_scaler(device)


def finished(batches, micro_batches: list, device) -> list:
    "A step's micro-batches as `train` steps on them: finished on the device"
    from paligemma_lib.batching import finished as done_on_device

    return done_on_device(batches.collate, micro_batches, device)


def device_codes(batches, device, n: int = 32) -> dict:
    """The segments world's codes as `finish` writes them on `device`, against
    the world's own answers (in a worker's float32), over `n` of its examples:
    how many differ, and whether every one that does is a near tie (chapter
    12.1's `near_ties`); {} for a recipe that writes no codes on the device"""
    from paligemma_lib.data import Collator
    from paligemma_lib.segment_batches import DeferredSegments, codes_at, near_ties
    from paligemma_lib.segmentation import _answer_vae

    deferred, collate = batches.dataset, batches.collate
    if not isinstance(deferred, DeferredSegments):
        return {}
    world = deferred.data
    chosen = [i for i in range(4 * n) if world.world(i) == "segments"][:n]
    plain = Collator(collate.processor, collate.max_length, collate.pixels)
    written = plain([world[i] for i in chosen])
    pending = collate([deferred[i] for i in chosen])
    crops = pending.crops.clone()
    done = collate.finish([pending], device)[0]
    places = torch.isin(written.input_ids, collate.seg_ids())
    mine, theirs = codes_at(done, collate, places), codes_at(written, collate, places)
    return {"examples": len(chosen), "codes": mine.numel(),
            "differing": int((mine != theirs).sum()),
            "all near ties": near_ties(_answer_vae(), crops, mine, theirs)}  # fmt: skip


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PREFETCH = 4  # batches each worker builds ahead (paligemma_lib.batching)


def data_rate(batches, workers: int, steps: int, warm: int) -> float:
    """Examples a second the workers build: timed once the batches they built
    ahead while starting are used up, so that the rate is theirs"""
    from paligemma_lib.batching import step_batches

    upcoming = step_batches(batches, 0, workers)
    steps = max(steps, 4 * workers)
    for _ in range(warm + (PREFETCH + 1) * workers):
        next(upcoming)
    start = time.perf_counter()
    for _ in range(steps):
        next(upcoming)
    return steps * batches.config.batch_size / (time.perf_counter() - start)


def step_rate(parts, device, steps: int, warm: int) -> tuple[float, list, float]:
    """Examples a second of training_step on two batches built once, kept in host
    memory as the workers hand them over; the batches; the warm-up's seconds"""
    from paligemma_lib.train import training_step

    model, batches, optimizer, scheduler, scaler = parts
    resident = [batches[i] for i in range(2)]
    began = time.perf_counter()
    for i in range(warm):
        training_step(model, finished(batches, resident[i % 2], device),
                      optimizer, scheduler, 1.0, device, scaler=scaler)  # fmt: skip
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        training_step(model, finished(batches, resident[i % 2], device),
                      optimizer, scheduler, 1.0, device, scaler=scaler)  # fmt: skip
    sync(device)
    size = batches.config.batch_size
    rate = steps * size / (time.perf_counter() - start)
    return rate, resident, start - began


def loop_rate(parts, device, workers: int, steps: int, warm: int) -> float:
    "Examples a second of data and steps together, as `train` runs them"
    from paligemma_lib.batching import step_batches
    from paligemma_lib.train import training_step

    model, batches, optimizer, scheduler, scaler = parts
    upcoming = step_batches(batches, 0, workers)
    for i in range(warm + steps):
        if i == warm:
            sync(device)
            start = time.perf_counter()
        training_step(model, finished(batches, next(upcoming), device),
                      optimizer, scheduler, 1.0, device, scaler=scaler)  # fmt: skip
    sync(device)
    return steps * batches.config.batch_size / (time.perf_counter() - start)


def kernels(parts, resident, device, steps: int) -> dict:
    """torch.profiler over `steps` steps on resident batches: the wall time a
    step, the device's busy time a step, and the heaviest kernels"""
    from torch.profiler import ProfilerActivity, profile

    from paligemma_lib.train import training_step

    model, _, optimizer, scheduler, scaler = parts
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(steps):
            training_step(model, finished(parts[1], resident[i % 2], device),
                          optimizer, scheduler, 1.0, device,
                          scaler=scaler)  # fmt: skip
        sync(device)
    wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    on_device = device.type == "cuda"
    ranked = own_times(events, on_device)
    # the runtime's launches (eager kernels) and the driver's (Triton's, compiled)
    launches = sum(e.count for e in events if e.key.startswith(LAUNCHES))
    busy = sum(us for _, us in ranked) / steps / 1e6
    return {
        "wall ms a step (profiled)": round(wall * 1e3, 2),
        "device busy ms a step": round(busy * 1e3, 2) if on_device else None,
        "device busy share": round(busy / wall, 3) if on_device else None,
        "kernel launches a step": launches // steps if on_device else None,
        "heaviest": [
            {
                "name": e.key[:80],
                "ms a step": round(us / steps / 1e3, 3),
                "calls a step": e.count // steps,
            }
            for e, us in ranked[:TOP_KERNELS]
        ],  # fmt: skip
    }


def own_times(events, on_device: bool) -> list:
    """[(event, its own microseconds)], longest first: on a GPU the kernels' time on
    the device (an operator's device time is its kernels', counted once, there); on
    the CPU each operator's own host time"""
    if on_device:
        cuda = torch.autograd.DeviceType.CUDA
        times = [(e, e.self_device_time_total) for e in events if e.device_type == cuda]
    else:
        times = [(e, e.self_cpu_time_total) for e in events]
    return sorted(((e, us) for e, us in times if us > 0), key=lambda p: -p[1])


def profile_recipe(flags, device, workers: int, steps: int, warm: int, batch=None,
                   save=lambda result: None):  # fmt: skip
    """The data rate, and the step's and the loop's rates and profile for the eager
    step and then the compiled one (the same model and optimiser, trained on);
    `save(result)` after each, so that a recipe cut at its budget keeps its numbers"""
    from paligemma_lib.train import TrainConfig, _step_model

    args = parsed(flags, 10**6, batch)  # steps: the schedule's length only
    parts = pieces(args, device)
    size = parts[1].config.batch_size
    data = data_rate(parts[1], workers, steps, warm)
    result = {"flags": flags, "batch size": size, "workers": workers,
              "steps timed": steps, "data examples/s": round(data, 1)}  # fmt: skip
    try:  # the codes written on the device are the world's (12.1's claim)
        codes = device_codes(parts[1], device)
    except Exception as error:
        codes = {"error": f"{type(error).__name__}: {error}"[:600]}
    if codes:
        result["codes on the device"] = codes
    save(result)
    for name in ("eager", "compiled"):
        if name == "compiled":  # train --compile's step
            parts = (_step_model(parts[0], TrainConfig(compile=True), 1), *parts[1:])
        try:
            result[name] = rates(parts, device, workers, steps, warm, data)
        except Exception as error:  # the eager numbers stay, the part goes on
            result[name] = {"error": f"{type(error).__name__}: {error}"[:600]}
        if name == "eager":  # twice the examples a step: near twice the rate
            # when the step is bound by its launches, not by its arithmetic
            double = (parts[0], doubled(parts[1]), *parts[2:])
            twice, _, _ = step_rate(double, device, steps, warm)
            result[name]["step examples/s at twice the batch"] = round(twice, 1)
        save(result)
    return result


def rates(parts, device, workers: int, steps: int, warm: int, data: float) -> dict:
    "The step's and the loop's rates, and the profile, of one way of stepping"
    step, resident, warming = step_rate(parts, device, steps, warm)
    loop = loop_rate(parts, device, workers, steps, warm)
    return {
        "warm-up s": round(warming, 1), "step examples/s": round(step, 1),
        "loop examples/s": round(loop, 1),
        "bound by": "data" if data < step else "step",
    } | kernels(parts, resident, device, max(2, steps // 4))  # fmt: skip


def doubled(batches):
    "The same StepBatches with batches twice as large"
    from dataclasses import replace

    from paligemma_lib.batching import StepBatches

    config = replace(batches.config, batch_size=2 * batches.config.batch_size)
    return StepBatches(batches.dataset, batches.collate, config)


def profile(run, budget: float) -> dict:
    """The part: each recipe in a child that ends at its share of the budget (the
    time left, shared by the recipes left), its rates and profiles into
    profile.json; a recipe that fails or runs out of time keeps what it measured"""
    begin, result = time.time(), {}
    if PACKED.is_dir():  # on the GPU machine, the real pictures carried there
        os.environ.update(unpack(PACKED, Path(tempfile.mkdtemp()) / "data"))
    names = list(recipes())
    for i, name in enumerate(names):
        share = (budget - (time.time() - begin)) / (len(names) - i)
        if share < 10:
            result[name] = {"error": "no time left in the part's budget"}
        else:
            result[name] = in_child(name, run.rehearse, share)
        run.say(f"profile {name}: {json.dumps(result[name])[:400]}")
        (run.out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def in_child(name: str, rehearse: bool, timeout: float) -> dict:
    "Recipe `name` profiled in a child cut at `timeout` s: what it saved, and why"
    saved = Path(tempfile.mkdtemp()) / f"{name}.json"
    command = [sys.executable, __file__, "--recipe", name, "--result", saved]
    try:
        done = subprocess.run([*map(str, command), *(["--rehearse"] * rehearse)],
                              cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        status = {} if done.returncode == 0 else {"error": done.stderr[-600:]}
    except subprocess.TimeoutExpired:
        status = {"error": f"cut at its {timeout:.0f} s"}
    found = json.loads(saved.read_text()) if saved.exists() else {}
    return found | status


def one_recipe(name: str, rehearse: bool, saved: Path) -> None:
    "The child: recipe `name` measured, saved after each stage"
    device = torch.device("cpu" if rehearse else "cuda")
    workers = 1 if rehearse else max(1, (os.cpu_count() or 2) - 1)
    steps, warm = (2, 2) if rehearse else (20, 5)  # warm: both shapes compiled
    batch = 2 if rehearse else None

    def save(result):
        saved.write_text(json.dumps(result, indent=1) + "\n")

    profile_recipe(recipes()[name], device, workers, steps, warm, batch, save)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="tiny, on the CPU")
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp()))
    parser.add_argument("--recipe", help="the child: profile this recipe alone")
    parser.add_argument("--result", type=Path, help="the child's record")
    args = parser.parse_args()
    if args.recipe:
        one_recipe(args.recipe, args.rehearse, args.result)
        return 0

    class Say:  # the part's view of tools/gpu_run.py's Run
        rehearse, out = args.rehearse, args.out

        @staticmethod
        def say(*words):
            print(*words, flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(profile(Say, 300), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
