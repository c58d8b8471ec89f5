# Hand-written, not exported from a notebook.
"""tools/gpu_run.py's part `decode` (issue 50): where a compiled decoding step's time
goes, kernel class by kernel class, beside the time its bytes need at the memory's
bandwidth; and the candidate fixes measured side by side.

    python3 tools/gpu_run.py --out DIR --only decode    # on the GPU machine
    python3 tools/gpu_decode.py --rehearse --out DIR     # here, tiny, on the CPU

PaliGemma-3B's shapes with random weights, built on the device in bfloat16 (as
benchmarks/gpu.py builds them). Each row of `ROWS` is the decoder (bf16, or chapter
8.1's int8 codes), a batch, and a variant:

- as shipped: `generate(compile=True)` as the library runs it;
- tuned: Inductor's coordinate-descent tuning of its kernels' launch settings (what
  gpt-fast turns on for its int8 layers);
- grouped: the decoding step's attention without `repeat_kv`: the H query heads
  folded onto their K key/value heads ([B, K, H/K, d_h] against [B, K, S_kv, d_h]),
  so the cache is read once instead of copied H/K times first;
- math: the attention written out (scores, softmax, sum) for Inductor to fuse,
  instead of the fused attention kernel.

For each row: ms a step inside `generate` (64 tokens less 1, over 63, as
benchmarks/gpu.py measures it) and whether its tokens equal those of the shipped eager
decoding (of the same weights, bf16 or int8); then the
compiled step replayed with no host work between steps, its wall time, and
`torch.profiler` over the replays: each kernel put in a class (`kind`), the class's
time a step, kernels a step, bytes a step (`class_bytes`) and bandwidth. What the
kernels leave of the replayed step is the gaps between them; what `generate` adds to
the replayed step is the host's work between steps.

Each row recompiles (about 20 s on an H200), so the rows run in the order of what they
tell, and a row starts only if the budget leaves it time; the JSON is written after
each row.
"""

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

ROWS = [("bf16", 1, "as shipped"), ("int8", 1, "as shipped"),
        ("bf16", 8, "as shipped"), ("bf16", 1, "tuned"), ("int8", 1, "tuned"),
        ("bf16", 1, "grouped"), ("bf16", 1, "math"),
        ("int8", 8, "as shipped")]  # fmt: skip
CLASSES = ("decoder Linears", "LM head", "attention", "norms, RoPE, elementwise",
           "argmax, sampling", "copies")  # fmt: skip
NEW_TOKENS = 64
REPLAYS = 20  # compiled steps replayed under the profiler
ROW_SECONDS = 40  # what a row needs on a GPU before its first compile is measured


# --- which kernel does what ---

SAMPLING = ("argmax", "argmin", "topk", "sort", "multinomial", "cumsum")
ATTENTION = ("sdpa", "flash", "fmha", "attention", "softmax")
PRODUCTS = ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "int8pack_mm",
            "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "matmul",
            "splitk", "_mm_", "fused_mm")  # fmt: skip


def kind(name: str) -> str:
    """The class of a kernel (a GPU kernel's name, or an ATen op's on a CPU):
    products (the decoder's or the head's: `split_head` tells them apart),
    attention, argmax and sampling, copies, or the rest"""
    n = name.lower()
    if any(s in n for s in SAMPLING):
        return "argmax, sampling"
    if any(s in n for s in ATTENTION):
        return "attention"
    # Inductor's fused int8 product: a reduction of codes times inputs
    fused_product = n.startswith(("triton_red", "triton_per")) and re.search(
        r"_mul_.*sum|_sum_.*mul", n
    )
    if any(s in n for s in PRODUCTS) or n.endswith("_mm") or fused_product:
        return "products"
    if n.startswith(("memcpy", "memset")) or "copy_kernel" in n or n == "aten::copy_":
        return "copies"
    return "norms, RoPE, elementwise"


def split_head(kernels: list, steps: int, layers: int) -> dict:
    """kernels: (name, microseconds) of `steps` replayed steps -> {class: [µs of
    each kernel]}. The LM head is one product a step, the decoder's are `layers`
    times a few: a product name seen k * layers + 1 times a step holds the head,
    the `steps` longest of its kernels (the head reads 257,152 rows where the
    decoder's largest product reads 16,384)"""
    by_name = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    classes = {c: [] for c in CLASSES}
    for name, times in by_name.items():
        c = kind(name)
        if c != "products":
            classes[c] += times
            continue
        per_step = round(len(times) / steps)
        if per_step % layers == 1 or per_step == 1:
            times = sorted(times)
            classes["LM head"] += times[-steps:]
            times = times[:-steps]
        classes["decoder Linears"] += times
    return classes


# --- the bytes each class must read a step ---


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def class_bytes(model, batch: int, cache_length: int) -> dict:
    """Bytes a decoding step must read, class by class: the decoder's products
    (weights, int8 codes and scales), the tied head, the keys and values of the
    whole static cache, the norms' weights, the logits the argmax reads"""
    from paligemma_lib.gemma import GemmaRMSNorm

    def norm_bytes(module) -> int:
        norms = [m for m in module.modules() if isinstance(m, GemmaRMSNorm)]
        return tensor_bytes(p for m in norms for p in m.parameters())

    lm = model.language_model
    layers = lm.model.layers
    layer_bytes = tensor_bytes([*layers.parameters(), *layers.buffers()])
    head = lm.lm_head.weight
    t = model.config.text
    kv = 2 * t.num_hidden_layers * batch * t.num_key_value_heads * t.head_dim
    return {
        "decoder Linears": layer_bytes - norm_bytes(layers),
        "LM head": tensor_bytes([head]),
        "attention": kv * cache_length * head.element_size(),
        "norms, RoPE, elementwise": norm_bytes(lm.model),
        "argmax, sampling": batch * head.shape[0] * head.element_size(),
        "copies": 0,
    }


# --- the variants ---


@contextlib.contextmanager
def variant(name: str):
    "The library as shipped, or with one candidate fix, within the block"
    import torch.nn.functional as F

    from paligemma_lib import gemma

    if name == "as shipped":
        yield
    elif name == "tuned":
        with torch._inductor.config.patch(coordinate_descent_tuning=True):
            yield
    elif name == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            yield
    elif name == "grouped":
        repeat_kv, attend = gemma.repeat_kv, gemma._attend

        def grouped(q, k, v, mask, scale, cap, dropout):
            B, H, S, d_h = q.shape
            K = k.shape[1]
            if K != H and S == 1 and cap is None:  # a decoding step
                q = q.reshape(B, K, H // K, d_h)  # heads k*G..k*G+G-1 share k
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scale
                )
                return out.reshape(B, H, 1, d_h)
            k, v = repeat_kv(k, H // K), repeat_kv(v, H // K)
            return attend(q, k, v, mask, scale, cap, dropout)

        gemma.repeat_kv, gemma._attend = (lambda x, n: x), grouped
        try:
            yield
        finally:
            gemma.repeat_kv, gemma._attend = repeat_kv, attend
    else:
        raise ValueError(f"unknown variant {name!r}")


# --- measuring a row ---


def replayed(model, batch: int, device, dtype, steps: int):
    """The compiled step generate left, replayed `steps` times with no host work:
    (ms a step, [(kernel name, µs)])"""
    from gpu import synchronize
    from torch.profiler import ProfilerActivity, profile

    from paligemma_lib.generation import _compiled_caches, _compiled_decode_step

    step = _compiled_decode_step(device)
    _, cache = _compiled_caches[model]
    length = cache.max_length
    token = torch.zeros(batch, dtype=torch.long, device=device)
    positions = torch.full((batch, 1), length - 2, device=device)
    keys = torch.zeros(batch, 1, 1, length, dtype=dtype, device=device)  # all seen
    cache.seek(length - 2)

    def run(n):
        for _ in range(n):
            if device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            step(model, token, positions, keys, cache)
        synchronize(device)

    run(3)
    start = time.perf_counter()
    run(steps)
    ms = 1e3 * (time.perf_counter() - start) / steps
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run(steps)
    return ms, kernel_times(prof.events(), device)


def kernel_times(events, device) -> list:
    """(name, µs) of each kernel: the device's kernels on a GPU; on a CPU, the ATen
    operations' own time"""
    if device.type == "cuda":
        return [(e.name, e.time_range.elapsed_us()) for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA]  # fmt: skip
    return [(e.name, e.self_cpu_time_total) for e in events
            if e.name.startswith("aten::") and e.self_cpu_time_total > 0]  # fmt: skip


def measure_row(models, config, row, device, repeats: int) -> dict:
    "One row: generate's step, eager's tokens, the replayed step's classes"
    from gpu import measure_decode, prompts, run_ours

    decoder, batch, name = row
    model = models[decoder]
    dtype = model.language_model.lm_head.weight.dtype
    inputs = prompts(config, batch, device, dtype)
    torch._dynamo.reset()  # a fresh compile under this row's variant
    with torch.inference_mode():  # the shipped eager step's tokens, the reference
        eager = run_ours(model, inputs, NEW_TOKENS)
    with variant(name), torch.inference_mode():
        step, warm_up, tokens = measure_decode(
            f"{decoder}, batch {batch}, {name}",
            lambda n: run_ours(model, inputs, n, compile=True),
            device,
            repeats,
        )
        run_ours(model, inputs, NEW_TOKENS, compile=True)  # its cache kept
        replay_ms, kernels = replayed(model, batch, device, dtype, REPLAYS)
    layers = config.text.num_hidden_layers
    times = split_head(kernels, REPLAYS, layers)
    cache_length = inputs["input_ids"].shape[1] + NEW_TOKENS
    nbytes = class_bytes(model, batch, cache_length)
    return {
        "generate ms a step": round(1e3 * step, 4),
        "replayed ms a step": round(replay_ms, 4),
        "host ms a step": round(1e3 * step - replay_ms, 4),
        "warm-up s": round(warm_up, 1),
        "tokens equal eager": bool(torch.equal(tokens, eager)),
        "classes": class_table(times, nbytes, REPLAYS),
        "kernels a step": round(len(kernels) / REPLAYS, 1),
    }


def class_table(times: dict, nbytes: dict, steps: int) -> dict:
    "Each class's ms, kernels and bytes a step, and the bandwidth those give"
    table = {}
    for c in CLASSES:
        ms = sum(times[c]) / 1e3 / steps
        table[c] = {
            "ms": round(ms, 4),
            "kernels": round(len(times[c]) / steps, 2),
            "bytes": nbytes[c],
            "GB/s": round(nbytes[c] / ms / 1e6, 1) if ms > 0 else None,
        }
    return table


def with_limits(result: dict, bandwidth: float) -> dict:
    """The row's gaps (replayed step less its kernels), and each class's share of
    the bandwidth: the time its bytes need over the time it took"""
    classes = result["classes"]
    busy = sum(c["ms"] for c in classes.values())
    result["kernels ms a step"] = round(busy, 4)
    result["gaps ms a step"] = round(result["replayed ms a step"] - busy, 4)
    for c in classes.values():
        c["limit ms"] = round(1e3 * c["bytes"] / bandwidth, 4)
        c["of limit"] = round(c["limit ms"] / c["ms"], 3) if c["ms"] > 0 else None
    total = sum(c["bytes"] for c in classes.values())
    result["limit ms a step"] = round(1e3 * total / bandwidth, 4)
    result["of limit"] = round(
        result["limit ms a step"] / result["generate ms a step"], 3
    )
    return result


# --- the run ---


def build(rehearse: bool, device):
    "(bf16 model, its int8 copy, config), random, on the device"
    import copy

    from gpu import tiny_config

    from paligemma_lib.config import PaliGemmaConfig
    from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
    from paligemma_lib.quantize import quantize_int8

    config = tiny_config() if rehearse else PaliGemmaConfig()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            bf16 = PaliGemmaForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(default)
    int8 = copy.deepcopy(bf16)
    quantize_int8(int8)
    return {"bf16": bf16, "int8": int8}, config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=300, help="seconds")
    parser.add_argument("--rehearse", action="store_true", help="on a CPU, tiny")
    parser.add_argument("--bandwidth", type=float, help="bytes/s (data sheet's)")
    args = parser.parse_args(argv)
    deadline = time.perf_counter() + args.budget
    from bandwidth import nominal_bandwidth

    device = torch.device("cpu" if args.rehearse else "cuda")
    name = "cpu" if args.rehearse else torch.cuda.get_device_name()
    bandwidth = args.bandwidth or (1e11 if args.rehearse else nominal_bandwidth(name))
    models, config = build(args.rehearse, device)
    record = {"device": name, "torch": torch.__version__, "bandwidth": bandwidth,
              "config": "tiny" if args.rehearse else "3b", "rows": {}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "decode.json"
    row_seconds = 5 if args.rehearse else ROW_SECONDS
    for row in ROWS:
        label = f"{row[0]}, batch {row[1]}, {row[2]}"
        if deadline - time.perf_counter() < row_seconds:
            record["rows"][label] = {"skipped": "out of time"}
            continue
        start = time.perf_counter()
        try:
            result = measure_row(models, config, row, device, repeats=2)
            record["rows"][label] = with_limits(result, bandwidth)
        except Exception as e:  # recorded; the next row runs
            record["rows"][label] = {"error": f"{type(e).__name__}: {e}"[:500]}
        row_seconds = max(row_seconds, time.perf_counter() - start)
        out.write_text(json.dumps(record, indent=1))
        print(label, json.dumps(record["rows"][label])[:400], flush=True)
    return 0


def summary(record: dict) -> dict:
    "A row a line for gpu_run's record: ms a step, share of the limit, same tokens"
    lines = {}
    for label, row in record.get("rows", {}).items():
        if "generate ms a step" not in row:
            lines[label] = row
            continue
        keys = ("generate ms a step", "replayed ms a step", "gaps ms a step",
                "of limit", "tokens equal eager")  # fmt: skip
        lines[label] = {k: row[k] for k in keys}
    return lines


if __name__ == "__main__":
    sys.exit(main())
