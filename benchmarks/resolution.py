"""What a resolution costs in time: prefill and decoding at 224, 448 and 896 (11.4).

A benchmark, not a test. Chapter 11.4 counts the FLOPs and bytes each resolution adds;
this measures the time, side by side in one run, as ratios to 224:

    python benchmarks/resolution.py                 # nano, on the CPU
    python benchmarks/resolution.py --device cuda   # PaliGemma-3B's shapes, bf16
    python benchmarks/resolution.py --random-nano --repeats 1  # the GPU's way, tiny

Each size is one model made to see it by `at_resolution` (its positions resampled,
its other weights shared): on the CPU the shipped nano; on a GPU, PaliGemma-3B's shapes
with random weights in bfloat16. `--random-nano` builds them as on a GPU (random
weights on the device, bfloat16) at nano's shapes: the GPU script's CPU rehearsal runs
that branch so. For each resolution it times, alternating the resolutions after a
warm-up, the prefill (the image through the vision tower and the whole prefix through
the decoder, filling the cache: `generate` with one new token) and a decoding step (the
median time of 17 new tokens less the median of one, over 16; the answer is forced to
run its length by `eos_token_id=None`), and reports the medians, their ratios to 224
and the FLOP ratio the chapter counts for the same prefill. Results go to
benchmarks/results/resolution-<device>-<date>.json.
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paligemma_lib import PaliGemmaProcessor, load_pretrained  # noqa: E402
from paligemma_lib.config import PaliGemmaConfig  # noqa: E402
from paligemma_lib.generation import generate  # noqa: E402
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration  # noqa: E402
from paligemma_lib.resolution import at_resolution, processor_at  # noqa: E402

SIZES = (224, 448, 896)
INPUTS = ("input_ids", "pixel_values", "attention_mask", "token_type_ids")
STEPS = 16  # decoding steps timed, beyond the first new token


def models(device: str, random_nano: bool = False) -> dict:
    "image size -> (model, inputs of one picture and the prompt 'caption en')"
    processor = PaliGemmaProcessor.from_pretrained("nano")
    if device == "cpu" and not random_nano:
        base = load_pretrained("nano")
    else:  # random weights, built on the device, in bfloat16
        torch.manual_seed(0)
        with torch.device(device):
            config = nano_config() if random_nano else PaliGemmaConfig()
            base = PaliGemmaForConditionalGeneration(config)
        base = base.to(torch.bfloat16)
    # one model's weights, shared; each size its own resampled positions
    made = {s: at_resolution(base, s).eval() for s in SIZES}
    out = {}
    for size, model in made.items():
        patch = model.config.vision.patch_size
        proc = processor_at(processor, size, patch)
        ids_from = proc.tokenizer  # nano's vocabulary; the 3B shapes take its ids
        batch = proc([Image.new("RGB", (size, size), (200, 200, 200))], ["caption en"])
        inputs = {k: getattr(batch, k).to(device) for k in INPUTS}
        ids = inputs["input_ids"]
        ids[ids == ids_from.image_token_id] = model.config.image_token_index
        dtype = next(model.parameters()).dtype
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        out[size] = (model, inputs)
    return out


def nano_config() -> PaliGemmaConfig:
    "nano's shapes, read from its config.json (its weights are not needed)"
    path = ROOT / "paligemma_lib" / "assets" / "nano" / "config.json"
    return PaliGemmaConfig.from_hf(json.loads(path.read_text()))


def timed(model, inputs, new: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        generate(model, **inputs, max_new_tokens=new, eos_token_id=None)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def prefill_flops(model, inputs) -> int:
    "FLOPs of the prefill, counted as chapter 11.4 counts them (one forward)"
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**inputs)
    return counter.get_total_flops()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--random-nano", action="store_true", help="random bf16 at nano's shapes"
    )
    parser.add_argument("--out", type=Path, help="the record (default: results/)")
    args = parser.parse_args(argv)
    built = models(args.device, args.random_nano)
    for model, inputs in built.values():  # warm-up: allocations, first kernels
        timed(model, inputs, 2, args.device)
    prefill = {s: [] for s in SIZES}
    longer = {s: [] for s in SIZES}
    for _ in range(args.repeats):  # the resolutions alternate: a slow spell is shared
        for size, (model, inputs) in built.items():
            prefill[size].append(timed(model, inputs, 1, args.device))
            longer[size].append(timed(model, inputs, 1 + STEPS, args.device))
    flops = {s: prefill_flops(*built[s]) for s in SIZES}
    rows = {}
    for s in SIZES:
        p = statistics.median(prefill[s])
        d = (statistics.median(longer[s]) - p) / STEPS  # medians, then the gap
        rows[s] = {
            "image tokens": built[s][0].config.num_image_tokens,
            "prefill ms": round(1e3 * p, 2),
            "decode ms a step": round(1e3 * d, 3),
            "prefill FLOPs": flops[s],
        }
    base = rows[224]
    print(f"{'size':>5}{'tokens':>8}{'prefill ms':>12}{'x 224':>8}{'FLOPs x':>9}"
          f"{'step ms':>10}{'x 224':>8}")  # fmt: skip
    for s, r in rows.items():
        r["prefill x 224"] = round(r["prefill ms"] / base["prefill ms"], 2)
        r["FLOPs x 224"] = round(r["prefill FLOPs"] / base["prefill FLOPs"], 2)
        r["step x 224"] = round(r["decode ms a step"] / base["decode ms a step"], 2)
        print(f"{s:>5}{r['image tokens']:>8,}{r['prefill ms']:>12.1f}"
              f"{r['prefill x 224']:>8.2f}{r['FLOPs x 224']:>9.2f}"
              f"{r['decode ms a step']:>10.2f}{r['step x 224']:>8.2f}")  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    threads = f"{torch.get_num_threads()} threads"
    device = (torch.cuda.get_device_name() if args.device == "cuda"
              else f"cpu: {platform.machine()}, {threads}")  # fmt: skip
    record = {
        "command": "python benchmarks/resolution.py " + " ".join(argv or sys.argv[1:]),
        "commit": commit, "device": device, "torch": torch.__version__,
        "date": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "model": "nano's shapes, random, bfloat16" if args.random_nano
        else "nano, at_resolution" if args.device == "cpu"
        else "PaliGemma-3B's shapes, random, bfloat16",
        "repeats": args.repeats, "decode steps timed": STEPS,
        "rows": {str(s): r for s, r in rows.items()},
    }  # fmt: skip
    stamp = datetime.now().strftime("%Y%m%d-%H%M")
    name = f"resolution-{args.device}-{stamp}.json"
    out = args.out or ROOT / "benchmarks" / "results" / name
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
