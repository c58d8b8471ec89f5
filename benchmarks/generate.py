"""Greedy generation speed: paligemma_lib's generate beside transformers'.

A benchmark, not a test. It builds a transformers PaliGemma with random weights, saves
it, loads the saved weights into ours, then times greedy generation of the same
left-padded prompts, alternating the ways of generating after a warm-up (which also
compiles the compiled ones and checks that each gives ours' tokens), and prints medians
in tokens/s, each against transformers eager and against transformers with its static
cache, compiled (`cache_implementation="static"`, what a user wanting speed picks).
The ways: ours (eager, static cache), ours compiled (`generate(compile=True)`),
transformers, transformers static compiled; for the mid config also ours with
`decoding_linears=True`, ours without a cache, and ours with int8 decoder weights
(`quantize_int8`, chapter 8.1; eager, static cache: its tokens may differ from ours, as
its logits do, and "same tokens" says whether they did). Results go to
benchmarks/results/<device>-<config>[-busyN][-bf16]-<date>.json. Run from the repository
root:

    python benchmarks/generate.py                 # mid config, batch 1 and 8, CPU
    python benchmarks/generate.py --busy 2        # with 2 Python loops on the cores
    python benchmarks/generate.py --only 3b --batches 1   # 3B widths, 2+2 layers
    python benchmarks/generate.py --device cuda   # bfloat16 on a GPU
    python benchmarks/generate.py --dtype bfloat16   # bfloat16 on the CPU

On a CPU, "ours, threads auto" runs the decoding steps on the thread count
`generate(threads="auto")` chose by timing its first steps with each candidate (chapter
8); "ours" is the default, torch's count (all threads), to show what the choice buys.
In the runs quoted below, made while the choice was the default, the rows "ours" and
"ours, all threads" are today's "ours, threads auto" and "ours". On the book's build
machine (2 CPU cores, torch 2.13.0, transformers 5.23.0, float32), 2026-11-23,
`--batches 1 8 --repeats 3 --ways ours "ours, all threads" "ours compiled" transformers
"transformers static compiled"`; tokens/s, and against transformers eager. Quiet (load
average 0.5 before the run; paligemma_lib/assets/records/cpu-mid-20261123-1925.json)
and with one other process (`--busy 1`: a Python loop on one of the two cores;
paligemma_lib/assets/records/cpu-mid-busy1-20261123-1926.json):

    mid config                     batch  quiet tok/s  vs eager   busy tok/s  vs eager
    ours                              1       106.9      1.06x        71.0      2.05x
    ours, all threads                 1       108.7      1.08x        42.1      1.22x
    ours compiled                     1       114.1      1.13x        37.8      1.09x
    transformers                      1       100.5      1.00x        34.6      1.00x
    transformers static compiled      1       102.0      1.01x        27.5      0.80x
    ours                              8       491.7      1.02x       303.1      2.21x
    ours, all threads                 8       518.2      1.08x       119.7      0.87x
    ours compiled                     8       517.3      1.07x       152.5      1.11x
    transformers                      8       482.0      1.00x       137.4      1.00x
    transformers static compiled      8       506.4      1.05x       122.8      0.89x

Same tokens as ours in every row. `generate` chose 1 thread at batch 1 and 2 at batch 8
on the quiet machine (its two timed steps per count: 8.8/8.8 ms on 2 threads against
8.8/8.6 on 1, and 14.0/13.0 against 13.5/13.6: a tie either way), and 1 thread at both
batches on the busy one (batch 8: 31.7/133.3 ms on 2 threads against 19.9/14.1 on 1).
Read: quiet, a step at these sizes is bound by reading the weights, and every way is
within 14% of the others; busy, every way that keeps both threads loses three fifths to
three quarters of its speed (a join waits for the thread the other process displaced),
and the default, which measured that and chose one thread, is 2.05x transformers at
batch 1 and 2.21x at batch 8. Compiled code keeps the threads it was compiled for (the
choice applies to the eager steps only), so it loses its lead on a busy machine, as it
did in the earlier runs below.

At PaliGemma-3B's widths (`--only 3b --batches 1 --ways ours "ours, all threads"
transformers`, quiet, benchmarks/results/cpu-3b-20261123-1929.json), where a step
streams the 2.1 GB float32 LM head: ours 5.2 tok/s, all threads 5.1, transformers 5.1;
the timed steps tied (155/158 ms on 2 threads, 156/157 on 1; 2 kept): one core already
draws what this machine's memory gives.

Earlier, 2026-11-22, before `generate` chose its threads
(benchmarks/results/cpu-mid-20261122-2212.json; a slower day on the same machine:
transformers reached 57.4 tok/s at batch 1 "quiet", 100.5 today): ours 1.10x
transformers at batch 1 and 1.06x at batch 8; with two Python loops on the two cores,
1.01x at batch 1 (ours compiled 0.50x, DecodingLinear 0.16x). DecodingLinear is opt-in
(`generate(..., decoding_linears=True)`): a default must never lose, and it lost badly
on the busy machine, while on the quiet one it won at batch 8 (1.41x ours eager) and
tied at batch 1. On a GPU, benchmarks/gpu.py measures PaliGemma-3B (its JSON is in
benchmarks/results/), and benchmarks/decode_gap.py where a compiled step's time goes.

int8 decoder weights (`ours, int8`, chapter 8.1), 2026-11-23, quiet (load average 1.7
with the run itself), `--batches 1 8 --repeats 3 --ways ours "ours, int8" transformers`,
in float32 (the CPU's default; benchmarks/results/cpu-mid-20261123-2000.json) and with
`--dtype bfloat16` (benchmarks/results/cpu-mid-bf16-20261123-2000.json), tokens/s:

    mid config          batch   float32   bfloat16
    ours                   1       77.3      137.5
    ours, int8             1      103.7      183.9
    transformers           1       74.9      127.0
    ours                   8      294.5      619.4
    ours, int8             8      336.4      542.0
    transformers           8      314.9      639.4

At batch 1 int8 is 1.34x ours in either dtype, and int8 with bfloat16 activations 2.4x
ours in float32: a step reads the weights once, and the codes are a quarter of float32's
bytes, half of bfloat16's. In bfloat16 the product is torch._weight_int8pack_mm, which
reads the codes as they are; in float32 (as the library was then) the codes were cast to
a float copy first, which at these sizes (4 MB a layer at most) probably stays in the
CPU's caches, so that what comes from memory is still the int8 codes. At Gemma-2B's
widths it does not: that cast route made int8 many times slower than float32 (issue
33), and float32 activations now go through the int8 kernel rounded to bfloat16
(chapter 8.1), not measured here yet. These ratios hold at the mid config's widths
(512 wide, MLP 2048) only. At batch 8 the int8 kernel loses to
bfloat16's matrix product (0.88x): with 8 rows a step does eight times the arithmetic on
the same bytes. (An earlier run on a machine with load average 8, before the kernel:
float32 9.3 tok/s, int8 3.6.) The int8 tokens differ from ours here (random weights, 32
tokens), as its logits do; transformers' bfloat16 tokens differ from ours too (rounding
at other places).

int8 at PaliGemma-3B's widths (2048 wide, MLP 16,384), where a layer's float32 weight is
128 MB and no cache holds it: the way "ours, int8" runs at any config when --ways names
it,

    python benchmarks/generate.py --only 3b --batches 1 --ways ours "ours, int8"
    python benchmarks/generate.py --only 3b --batches 1 --ways ours "ours, int8" \
        --dtype bfloat16

Not run yet: it waits for a quiet machine (the one at hand was loaded by other work, and
timings from a loaded machine are not published).

Earlier measurements (before the static cache and compile), for the record:

Measured on the 2-core CPU of the book's build machine (torch 2.13.0, transformers
5.23.0), tokens/s, `generate` with its defaults (inside `decoding_linears(model)` on the
CPU); the last column is ours with decoding_linears=False against transformers:

    config                      batch  ours   transformers  ratio  (nn.Linear)
    mid (512 wide, 4 layers)      1    194.3  109.8         1.77x  (1.05x)
    mid (512 wide, 4 layers)      4    387.8  266.0         1.46x  (1.08x)
    3B widths, 2+2 layers         1    6.4    5.6           1.16x
    3B widths, 2+2 layers         4    12.1   7.1           1.70x

(At 3B widths and batch 1, prefill, compute-bound and identical, is ~1/4 of the time.)
The cache against recomputing every step (ours, mid config): 7.5x at batch 1, 9.7x at
batch 4. Same tokens as transformers in every row. Earlier runs of the 3B-width config
gave 1.17x and 1.21x at batch 1: at that size a decoding step streams the 2.1 GB float32
LM head from memory (about 104 ms a step for ours, 132 ms for transformers), so the
margin is bounded by memory bandwidth.

Does the single-row route (one row given twice to the matrix-matrix kernel) earn its
place? `--only mid --repeats 5`, two quiet runs back to back: as the library is,
198.4 tok/s at batch 1 (1.79x transformers; 1.08x with decoding_linears=False) and 1.52x
at batch 4; with the transposed route restricted to 2-16 rows (a single row through
F.linear), 115.7 tok/s at batch 1 (1.06x) and 1.52x at batch 4. So it stays. On a busy
machine (other jobs on the same 2 cores) one run gave 0.70x at batch 1 with the
single-row route and 1.06x with plain nn.Linear in the same run: measure on a quiet
machine.
"""

import argparse
import atexit
import copy
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_reference import ours_from_transformers_state, sharpen  # noqa: E402

from paligemma_lib.config import (  # noqa: E402
    Gemma2TextConfig,
    PaliGemmaConfig,
    TextConfig,
    VisionConfig,
)
from paligemma_lib.generation import generate  # noqa: E402
from paligemma_lib.quantize import quantize_int8  # noqa: E402
from paligemma_lib.threads import _step_timings, fastest_threads  # noqa: E402

NEW_TOKENS = 32
CONFIGS = {
    "mid (vision 256x4 @112px, text 512x4, vocab 8192)": PaliGemmaConfig(
        vision=VisionConfig(
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=4,
            image_size=112,
            patch_size=14,
        ),
        text=TextConfig(
            vocab_size=8192,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=64,
        ),
        image_token_index=8191,
        projection_dim=512,
    ),
    "3B widths and vocab, 2+2 layers @224px": PaliGemmaConfig(
        vision=VisionConfig(num_hidden_layers=2), text=TextConfig(num_hidden_layers=2)
    ),
    # PaliGemma 2 3B: Gemma 2 2B's widths, caps, query scalar and window; a local and a
    # global layer
    "PaliGemma 2 3B widths and vocab, 2+2 layers @224px": PaliGemmaConfig(
        vision=VisionConfig(num_hidden_layers=2),
        text=Gemma2TextConfig(num_hidden_layers=2),
        projection_dim=2304,
    ),
}


def prompts(config, batch_size, seed=0):
    """Left-padded prompts of different lengths: image tokens, <bos>, 8 to 20 random
    tokens, newline"""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 21, (batch_size,), generator=g).tolist()
    seqs = [
        [config.image_token_index] * config.num_image_tokens
        + [2]
        + torch.randint(3, 8000, (n,), generator=g).tolist()
        + [108]
        for n in lengths
    ]
    S = max(map(len, seqs))
    ids = torch.tensor([[0] * (S - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (S - len(s)) + [1] * len(s) for s in seqs])
    pixels = torch.randn(
        batch_size, 3, config.vision.image_size, config.vision.image_size, generator=g
    )
    return dict(
        input_ids=ids,
        pixel_values=pixels,
        attention_mask=mask,
        token_type_ids=torch.zeros_like(ids),
    )


def build(config, folder):
    "A random transformers model, saved to `folder`, and ours loaded from that file"
    torch.manual_seed(0)
    theirs = transformers.PaliGemmaForConditionalGeneration(
        transformers.PaliGemmaConfig(**config.to_hf())
    ).eval()
    sharpen(theirs)  # clear logit maxima, so the token check below is exact
    theirs.generation_config.eos_token_id = (
        None  # both generate exactly NEW_TOKENS tokens
    )
    theirs.save_pretrained(folder)
    ours = ours_from_transformers_state(
        config, load_file(str(Path(folder) / "model.safetensors"))
    )
    return ours, theirs


def run_theirs(theirs, inputs, static=False):
    "transformers' greedy generate; `static`: its static cache, compiled"
    kw = {}
    if static:
        compile_config = transformers.CompileConfig()  # reduce-overhead on CUDA
        if inputs["input_ids"].device.type != "cuda":
            compile_config = transformers.CompileConfig(mode="default")
            compile_config._compile_all_devices = True  # transformers' own switch
        kw = dict(cache_implementation="static", compile_config=compile_config)
    with torch.inference_mode():
        out = theirs.generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=0,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
    return out[:, inputs["input_ids"].shape[1] :]


def run_ours(
    ours, inputs, cache="static", decoding_linears=False, compile=False, threads=None
):
    return generate(
        ours,
        **inputs,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        cache=cache,
        decoding_linears=decoding_linears,
        compile=compile,
        threads=threads,
    )


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def int8_copy(ours):
    "A copy of ours with the decoder layers' Linear weights in int8"
    int8 = copy.deepcopy(ours)
    quantize_int8(int8)
    return int8


def compare(ours, theirs, inputs, repeats, extras, ways=None):
    """Alternate the ways of generating `repeats` times after a warm-up (which compiles
    the compiled ones); median seconds per run, and whether all gave ours' tokens"""
    runs = {
        "ours": lambda: run_ours(ours, inputs),
        "ours compiled": lambda: run_ours(ours, inputs, compile=True),
        "transformers": lambda: run_theirs(theirs, inputs),
        "transformers static compiled": lambda: run_theirs(theirs, inputs, True),
    }
    if inputs["input_ids"].device.type == "cpu":  # what choosing the threads buys
        runs["ours, threads auto"] = lambda: run_ours(ours, inputs, threads="auto")
    if extras:
        runs["ours, DecodingLinear"] = lambda: run_ours(
            ours, inputs, decoding_linears=True
        )
        runs["ours, no cache"] = lambda: run_ours(ours, inputs, cache="none")
    if extras or "ours, int8" in (ways or ()):  # any config, when named
        ours_int8 = int8_copy(ours)
        runs["ours, int8"] = lambda: run_ours(ours_int8, inputs)
    if ways:  # only these (a busy machine's quick comparison)
        unknown = sorted(set(ways) - set(runs))
        if unknown:
            raise SystemExit(f"--ways {unknown}: the ways are {list(runs)}")
        runs = {name: fn for name, fn in runs.items() if name in ways}
    reference = run_ours(ours, inputs)
    same, warm_up = {}, {}
    for name, fn in list(runs.items()):  # the warm-up
        start = time.perf_counter()
        try:
            same[name] = torch.equal(fn(), reference)
        except Exception as e:  # transformers 5.23's static cache on PaliGemma 2
            same[name] = f"fails: {type(e).__name__}: {e}"  # recorded, not timed
            print(f"  {name} left out: it {same[name]}", flush=True)
            del runs[name]
            continue
        warm_up[name] = time.perf_counter() - start
    device = inputs["input_ids"].device
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn, device))
    return same, warm_up, {name: statistics.median(t) for name, t in times.items()}


def keep_cores_busy(processes: int):
    "Start `processes` Python loops (each keeps a core busy); stopped at exit"
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(processes)
    ]
    atexit.register(lambda: [p.kill() for p in loops])
    return loops


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["mid", "3b", "pg2"], default="mid")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bfloat16)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the models' dtype (default: bfloat16 on cuda, float32 on a CPU)",
    )
    parser.add_argument(
        "--busy", type=int, default=0, help="Python loops to run beside, on the cores"
    )
    parser.add_argument(
        "--ways",
        nargs="+",
        default=None,
        help='only these ways, e.g. --ways ours "ours, int8" (default: all)',
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.dtype is not None:
        dtype = getattr(torch, args.dtype)
    if args.busy:
        keep_cores_busy(args.busy)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{device}, {dtype}, {torch.get_num_threads()} threads, "
        f"{args.busy} busy loops beside, greedy, {NEW_TOKENS} new tokens, "
        f"median of {args.repeats} alternating runs after a warm-up",
        flush=True,
    )
    results = {
        "command": shlex.join(["python", *sys.argv]),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "busy_loops": args.busy,
        "new_tokens": NEW_TOKENS,
        "repeats": args.repeats,
        "rows": [],
    }
    index = ("mid", "3b", "pg2").index(args.only)
    name, config = list(CONFIGS.items())[index]
    with tempfile.TemporaryDirectory() as folder:
        ours, theirs = build(config, folder)
        ours, theirs = ours.to(device, dtype), theirs.to(device, dtype)
        for batch_size in args.batches:
            inputs = {
                k: v.to(device, dtype) if v.is_floating_point() else v.to(device)
                for k, v in prompts(config, batch_size).items()
            }
            same, warm_up, t = compare(
                ours, theirs, inputs, args.repeats, extras=index == 0, ways=args.ways
            )
            rate = {k: batch_size * NEW_TOKENS / v for k, v in t.items()}
            timings = _step_timings.get(ours, {}).get(
                (batch_size, torch.get_num_threads())
            )
            row = {
                "config": name,
                "batch": batch_size,
                # ours' decoding threads: the step times generate measured, its choice
                "step_seconds_by_threads": timings,
                "chosen_threads": timings and fastest_threads(timings),
                "tokens_per_s": rate,
                "warm_up_s": warm_up,
                "same_tokens_as_ours": same,
            }
            results["rows"].append(row)
            print(
                f"{name} | batch {batch_size} | ours' steps on "
                f"{row['chosen_threads'] or torch.get_num_threads()} thread(s)",
                flush=True,
            )
            bases = [b for b in ("transformers", "transformers static compiled", "ours")
                     if b in rate]  # fmt: skip
            for k, v in rate.items():
                against = " | ".join(f"vs {b} {v / rate[b]:5.2f}x" for b in bases)
                print(
                    f"  {k:30} {v:8.1f} tok/s | {against} | "
                    f"warm-up {warm_up[k]:5.1f} s | same tokens {same[k]}",
                    flush=True,
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    busy = f"-busy{args.busy}" if args.busy else ""
    busy += "-bf16" if device.type == "cpu" and dtype == torch.bfloat16 else ""
    path = out / f"{device.type}-{args.only}{busy}-{datetime.now():%Y%m%d-%H%M}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
