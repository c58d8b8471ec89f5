"""Decoding speed and LoRA memory of PaliGemma-3B on one GPU: ours against transformers.

A benchmark, not a test, meant to run once on a CUDA GPU within a few minutes:

    python benchmarks/gpu.py --out results/        # PaliGemma-3B, bf16, CUDA
    python benchmarks/gpu.py --config tiny --device cpu --out /tmp/gpu-smoke  # a check

It builds a PaliGemma-3B with random weights directly on the device in bfloat16 (no
checkpoint on disk; the weights' layout and names are those of the real checkpoint,
which chapter 9's loader reads), and a transformers model holding the very same tensors.
Then, each section on its own (an error is recorded in the JSON and the next section
runs), time-boxed by a deadline for the whole run:

- decode: greedy decoding, ms per step (one token per row) at batch 1 and 8, for ours
  eager, ours compiled (`generate(compile=True)`: CUDA graphs), transformers eager
  (its dynamic cache) and transformers with its static cache, compiled (what
  `cache_implementation="static"` does on a GPU). A step's time is the difference
  between generating NEW_TOKENS tokens and one token (the prefill), divided by
  NEW_TOKENS - 1, so the prefill is left out. The share of the bandwidth limit: the
  bytes a step must read (the language model's weights, once per step whatever the
  batch, plus the KV cache) over the device's memory bandwidth (`--bandwidth`, by
  default the data sheet's for the device's name: benchmarks/bandwidth.py),
  against the measured step.
- eager op count: the ATen operations one eager decoding step dispatches (those that
  run a kernel, composites decomposed, views left out: the counter of
  tests/test_decode_ops.py), ours and transformers' default (growing cache), at each
  batch size, and how many read a value back to the host (a wait for the GPU).
  Launch-bound eager steps cost about this count.
  `--op-counts-only` runs the build and this section alone (cheap, also on a CPU).
- lora: LoRA training at PaliGemma-3B's shapes: chapter 10's default targets, r=8, the
  base in bf16, the adapters in fp32, gradient checkpointing, bf16 autocast, AdamW on
  the adapters, batch 2 of about 300 tokens (256 image tokens and a text). Peak memory
  (torch.cuda.max_memory_allocated) and the median step time.

- int8 (`--short` only, last): ours with chapter 8.1's int8 decoder weights
  (`quantize_int8` of a copy), eager and compiled.

`--short` is the form tools/gpu_run.py runs within its budget: no op counts and no
LoRA section (its T4 part measures LoRA), two repeats, and the sections in the order
of what they tell: batch 1 first, ours compiled against transformers' compiled, then
int8, then eager, then batch 8.

Results go to OUT/gpu-<device>-<date>.json (or `--file`); a table is printed at the end.
"""

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from datetime import datetime
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_reference import transformers_name  # noqa: E402

from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig  # noqa: E402
from paligemma_lib.generation import generate  # noqa: E402
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration  # noqa: E402

NEW_TOKENS = 64
BATCHES = (1, 8)
# --short: (implementation, batch), most telling first
SHORT = [
    ("ours compiled", 1),
    ("transformers static compiled", 1),
    ("ours int8 eager", 1),
    ("ours eager", 1),
    ("transformers eager", 1),
    ("ours compiled", 8),
    ("transformers static compiled", 8),
    ("ours int8 compiled", 1),
]
START = time.perf_counter()


def log(*args):
    print(f"[{time.perf_counter() - START:6.1f} s]", *args, flush=True)


def tiny_config():
    "The CPU check's model: the code paths of the real one, in seconds"
    return PaliGemmaConfig(
        vision=VisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=56,
            patch_size=14,
        ),
        text=TextConfig(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
        ),
        image_token_index=1023,
        projection_dim=128,
    )


def build(config, device, dtype):
    """Ours, random, built on the device in `dtype`; transformers' model holding the
    same tensors (handed ours; its own are freed)"""
    import transformers

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            ours = PaliGemmaForConditionalGeneration(config).eval()
        with torch.device(device):  # its own random weights, replaced below
            theirs = transformers.PaliGemmaForConditionalGeneration(
                transformers.PaliGemmaConfig(**config.to_hf())
            )
    finally:
        torch.set_default_dtype(default)
    state = {transformers_name(k): v for k, v in ours.state_dict().items()}
    theirs.load_state_dict(state, strict=True, assign=True)
    theirs.tie_weights()
    theirs.eval()
    theirs.generation_config.eos_token_id = None  # exactly the tokens asked for
    theirs.generation_config.pad_token_id = 0
    return ours, theirs


def prompts(config, batch_size, device, dtype, text_tokens=12, seed=0):
    "Image tokens, <bos>, random text, newline; no padding; images of the right size"
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(
        3, min(8000, config.text.vocab_size - 2), (text_tokens,), generator=g
    )
    row = [config.image_token_index] * config.num_image_tokens + [2] + text.tolist()
    ids = torch.tensor([row + [108 % config.text.vocab_size]] * batch_size)
    size = config.vision.image_size
    pixels = torch.randn(batch_size, 3, size, size, generator=g)
    return dict(
        input_ids=ids.to(device),
        pixel_values=pixels.to(device, dtype),
        attention_mask=torch.ones_like(ids).to(device),
        token_type_ids=torch.zeros_like(ids).to(device),
    )


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_ours(model, inputs, new_tokens, compile=False):
    return generate(
        model, **inputs, max_new_tokens=new_tokens, eos_token_id=None, compile=compile
    )


def run_theirs(model, inputs, new_tokens, static=False, device="cuda"):
    from transformers import CompileConfig

    kw = {}
    if static:
        kw["cache_implementation"] = "static"
        compile_config = CompileConfig()  # reduce-overhead: CUDA graphs
        if torch.device(device).type != "cuda":
            compile_config = CompileConfig(mode="default")
            compile_config._compile_all_devices = True  # transformers' own switch
        kw["compile_config"] = compile_config
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **kw,
        )
    return out[:, inputs["input_ids"].shape[1] :]


def timed(fn, device):
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def decode_bytes(model, config, batch_size, length, dtype):
    """Bytes one decoding step reads: the language model's weights (the tied LM head
    once; int8 codes and their scales at their own sizes, as buffers) and the keys
    and values of `length` positions"""
    lm = model.language_model
    tensors = [*lm.parameters(), *lm.buffers()]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    t = config.text
    kv = 2 * t.num_hidden_layers * batch_size * t.num_key_value_heads * t.head_dim
    itemsize = torch.empty((), dtype=dtype).element_size()
    return weights + itemsize * kv * length


def measure_decode(name, fn, device, repeats):
    """ms per decoding step: (time of NEW_TOKENS tokens - time of 1) / (NEW_TOKENS - 1),
    medians of `repeats` runs after a warm-up of each (the compiling one included)"""
    started = time.perf_counter()
    fn(NEW_TOKENS)
    fn(1)
    warm_up = time.perf_counter() - started
    long, short, tokens = [], [], None
    for _ in range(repeats):
        seconds, tokens = timed(lambda: fn(NEW_TOKENS), device)
        long.append(seconds)
        short.append(timed(lambda: fn(1), device)[0])
    step = (statistics.median(long) - statistics.median(short)) / (NEW_TOKENS - 1)
    log(f"  {name}: {1e3 * step:.2f} ms/step (warm-up {warm_up:.1f} s)")
    return step, warm_up, tokens


def section(results, name, deadline, fn):
    "Run fn() unless the deadline has passed; record its result or its error"
    if time.perf_counter() > deadline:
        results[name] = {"skipped": "out of time"}
        log(f"{name}: skipped, out of time")
        return
    log(f"{name}: start")
    try:
        results[name] = fn()
    except Exception as e:  # recorded, and the next section runs
        results[name] = {"error": f"{type(e).__name__}: {e}"}
        log(f"{name}: {type(e).__name__}: {e}")
        traceback.print_exc()
        sys.stdout.flush()


def int8_copy(models):
    "A copy of ours with int8 decoder weights (chapter 8.1), made once"
    if "int8" not in models:
        import copy

        from paligemma_lib.quantize import quantize_int8

        models["int8"] = copy.deepcopy(models["ours"])
        quantize_int8(models["int8"])
    return models["int8"]


def decode_section(models, config, args, dtype, impl, batch_size):
    ours, theirs = models["ours"], models["theirs"]
    inputs = prompts(config, batch_size, args.device, dtype)
    if impl.startswith("ours int8"):
        ours, impl = int8_copy(models), impl.replace(" int8", "")
    if impl == "ours eager":
        fn = lambda n: run_ours(ours, inputs, n)  # noqa: E731
    elif impl == "ours compiled":
        torch._dynamo.reset()  # a fresh compile for this shape
        fn = lambda n: run_ours(ours, inputs, n, compile=True)  # noqa: E731
    elif impl == "transformers eager":
        fn = lambda n: run_theirs(theirs, inputs, n, device=args.device)  # noqa: E731
    else:
        torch._dynamo.reset()

        def fn(n):
            return run_theirs(theirs, inputs, n, static=True, device=args.device)

    step, warm_up, tokens = measure_decode(
        f"{impl}, batch {batch_size}", fn, args.device, args.repeats
    )
    length = inputs["input_ids"].shape[1] + NEW_TOKENS // 2  # the mean position
    nbytes = decode_bytes(ours, config, batch_size, length, dtype)
    limit = nbytes / args.bandwidth
    return {
        "ms_per_step": 1e3 * step,
        "ms_per_token": 1e3 * step / batch_size,
        "tokens_per_s": batch_size / step,
        "warm_up_s": warm_up,
        "bytes_per_step": nbytes,
        "bandwidth_limit_ms": 1e3 * limit,
        "fraction_of_bandwidth_limit": limit / step,
        "tokens": tokens.tolist(),
    }


def op_count_section(models, config, args, dtype, batch_size, short=2, long=6):
    "ATen ops per eager decoding step: the difference of `long` and `short` tokens"
    from test_decode_ops import SYNCS, per_step

    ours, theirs = models["ours"], models["theirs"]
    inputs = prompts(config, batch_size, args.device, dtype)
    counts = {
        "ours eager": per_step(partial(run_ours, ours, inputs), short, long),
        "transformers eager": per_step(
            partial(run_theirs, theirs, inputs, device=args.device), short, long
        ),
    }
    result = {}
    for impl, ops in counts.items():
        result[impl] = {
            "ops_per_step": sum(ops.values()),
            "reads_back_per_step": sum(ops.get(op, 0) for op in SYNCS),
            "by_op": ops,
        }
        log(
            f"  {impl}, batch {batch_size}: {result[impl]['ops_per_step']:.1f} ops per "
            f"step, {result[impl]['reads_back_per_step']:.1f} read back to the host"
        )
    return result


def lora_section(config, args, dtype, seq_tokens=300, batch_size=2, steps=4):
    from paligemma_lib.lora import LoraConfig, add_lora, count_parameters
    from paligemma_lib.train import autocast, set_gradient_checkpointing

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    # the decoding sections' models stay allocated: the LoRA run's peak is above it
    baseline = torch.cuda.memory_allocated() if device.type == "cuda" else None
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = PaliGemmaForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default)
    model.requires_grad_(False)
    targets = add_lora(model, LoraConfig(r=8, dtype=torch.float32))
    set_gradient_checkpointing(model)
    trainable, total = count_parameters(model)
    text = seq_tokens - config.num_image_tokens - 1
    inputs = prompts(config, batch_size, device, dtype, text_tokens=max(text, 4))
    S = inputs["input_ids"].shape[1]
    types = torch.zeros_like(inputs["input_ids"])
    types[:, S // 2 + config.num_image_tokens // 2 :] = 1  # the last part: suffix
    labels = inputs["input_ids"].masked_fill(types == 0, -100)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-4
    )
    model.train()
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        with autocast(device):
            loss = model(**{**inputs, "token_type_ids": types}, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    result = {
        "targets": len(targets),
        "trainable_parameters": trainable,
        "parameters": total,
        "batch_size": batch_size,
        "sequence_length": S,
        "step_s_median": statistics.median(times[1:]),
        "step_s": times,
        "loss": loss.item(),
        "peak_memory_bytes": peak,
        "baseline_bytes": baseline,
        "peak_above_baseline_bytes": None if peak is None else peak - baseline,
    }
    peak_text = f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a"
    log(
        f"  lora: {trainable:,} trainable of {total:,}; step "
        f"{result['step_s_median']:.3f} s; peak {peak_text}"
    )
    del model, optimizer
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for the JSON results")
    parser.add_argument("--config", choices=["3b", "tiny"], default="3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--op-counts-only",
        action="store_true",
        help="build, count the ops of an eager step, and stop (no timing)",
    )
    parser.add_argument(
        "--bandwidth", type=float, help="bytes/s (default: the device's data sheet)"
    )
    parser.add_argument(
        "--budget", type=float, default=300, help="no decode section starts after it"
    )
    parser.add_argument("--short", action="store_true", help="tools/gpu_run.py's form")
    parser.add_argument("--file", type=Path, help="the JSON's path (default: in OUT)")
    args = parser.parse_args()
    if args.short:
        args.repeats = min(args.repeats, 2)
    deadline = START + args.budget
    import transformers

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = PaliGemmaConfig() if args.config == "3b" else tiny_config()
    name = (
        torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    )
    if args.bandwidth is None:
        from bandwidth import nominal_bandwidth

        if device.type != "cuda":
            parser.error("on a CPU, give its memory bandwidth: --bandwidth BYTES_PER_S")
        args.bandwidth = nominal_bandwidth(name)
    results = {
        "command": " ".join(["python", *sys.argv]),
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "config": args.config,
        "dtype": str(dtype),
        "new_tokens": NEW_TOKENS,
        "bandwidth_bytes_per_s": args.bandwidth,
        "sections": {},
    }
    log(f"{name}, torch {torch.__version__}, transformers {transformers.__version__}")
    sections = results["sections"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = args.file or (
        out / f"gpu-{device.type}-{args.config}-{datetime.now():%Y%m%d-%H%M}.json"
    )

    def save():
        path.write_text(json.dumps(results, indent=1))

    models = {}
    section(sections, "build", deadline, lambda: _build(models, config, device, dtype))
    save()
    if args.short and "ours" in models:
        for impl, batch_size in SHORT:
            run = partial(decode_section, models, config, args, dtype, impl, batch_size)
            section(sections, f"decode {impl}, batch {batch_size}", deadline, run)
            save()
        table(results)
        log(f"wrote {path}")
        return
    for batch_size in BATCHES:
        if "ours" not in models:
            break
        run = partial(op_count_section, models, config, args, dtype, batch_size)
        section(sections, f"eager op count, batch {batch_size}", deadline, run)
        save()
    if args.op_counts_only:
        log(f"wrote {path}")
        return
    order = ["ours eager", "transformers eager", "ours compiled"]
    for impl in order:
        for batch_size in BATCHES:
            if "ours" not in models:
                break
            run = partial(decode_section, models, config, args, dtype, impl, batch_size)
            section(sections, f"decode {impl}, batch {batch_size}", deadline, run)
            save()
    section(sections, "lora", deadline + 60, lambda: lora_section(config, args, dtype))
    save()
    for batch_size in BATCHES:
        if "ours" not in models:
            break
        impl = "transformers static compiled"
        run = partial(decode_section, models, config, args, dtype, impl, batch_size)
        section(sections, f"decode {impl}, batch {batch_size}", deadline + 60, run)
        save()
    table(results)
    save()
    log(f"wrote {path}")


def _build(models, config, device, dtype):
    started = time.perf_counter()
    models["ours"], models["theirs"] = build(config, device, dtype)
    parameters = sum(p.numel() for p in models["ours"].parameters())
    log(f"  built {parameters:,} parameters in {time.perf_counter() - started:.1f} s")
    return {"parameters": parameters, "seconds": time.perf_counter() - started}


def table(results):
    "The summary: ms per step and the share of the bandwidth limit"
    sections = results["sections"]
    print("\nimpl                            batch  ms/step  tok/s   of limit  tokens")
    for batch_size in BATCHES:
        reference = sections.get(f"decode ours eager, batch {batch_size}", {})
        for impl in [
            "ours eager",
            "ours compiled",
            "transformers eager",
            "transformers static compiled",
            "ours int8 eager",
            "ours int8 compiled",
        ]:
            r = sections.get(f"decode {impl}, batch {batch_size}", {})
            if "ms_per_step" not in r:
                problem = r.get("error", r.get("skipped", "not run"))
                print(f"{impl:32} {batch_size:5}  {problem[:60]}")
                continue
            same = (
                "n/a"
                if "tokens" not in reference
                else ("same" if r["tokens"] == reference["tokens"] else "differ")
            )
            print(
                f"{impl:32} {batch_size:5} {r['ms_per_step']:8.2f} "
                f"{r['tokens_per_s']:7.1f} "
                f"{100 * r['fraction_of_bandwidth_limit']:7.1f}%"
                f"  {same}"
            )
    lora = sections.get("lora", {})
    if "step_s_median" in lora:
        peak = lora["peak_above_baseline_bytes"]
        peak_text = f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a"
        print(
            f"LoRA r=8, batch {lora['batch_size']} x {lora['sequence_length']} tokens: "
            f"{lora['step_s_median']:.3f} s/step, peak memory {peak_text} "
            f"(above what the decoding models held)"
        )
    else:
        print("LoRA:", lora)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
