# Hand-written, not exported from a notebook.
"""Why a compiled int8 decoding step was slower than an eager one on an H200 (issue 38).

    python benchmarks/int8_gpu_profile.py --out DIR                       # a GPU
    python benchmarks/int8_gpu_profile.py --out DIR --config tiny --device cpu

`benchmarks/gpu.py --short` measured, at PaliGemma-3B's shapes, batch 1: bf16 compiled
2.57 ms a step, int8 eager 12.52, int8 compiled 23.26. This script times, side by side,
the ways a decoding step can multiply by int8 weights, each compiled as
`generate(compile=True)` compiles it ("reduce-overhead": CUDA graphs on a GPU):

- bf16: the float model, the reference;
- int8 cast: chapter 8.1's `Int8Linear` as shipped, `F.linear(x, q.to(dtype)) * s`;
- int8 reduction: the same product written as a multiply and a sum over the inputs,
  `(x[..., None, :] * q.to(dtype)).sum(-1) * s`, which a compiler can fuse into one
  kernel that reads the int8 codes once (a matrix-vector product is a reduction).

For each: ms a step (as benchmarks/gpu.py measures it), Dynamo's graph breaks and
recompiles, Inductor's hints (e.g. CUDA graphs skipped, and why), and the profiler's
top kernels over a few steps. Writes DIR/int8-profile.json.
"""

import argparse
import copy
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402  (benchmarks/gpu.py: its model, prompts and timing)

from paligemma_lib import quantize  # noqa: E402


def reduction_product(self, x: torch.Tensor) -> torch.Tensor:
    "x @ (q * s)^T as a multiply and a sum over the inputs, s on the output"
    codes = self.weight_int8.to(x.dtype)
    return (x[..., None, :] * codes).sum(-1) * self.weight_scale.to(x.dtype)


class Hints(logging.Handler):
    "Collects what torch logs while compiling: graph breaks, recompiles, hints"

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage()[:300])


def profile(fn, device, steps) -> list[str]:
    "The top kernels of `steps` decoding steps by device time"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn(steps)
        gpu.synchronize(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=20).splitlines()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", choices=["3b", "tiny"], default="3b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    config = gpu.PaliGemmaConfig() if args.config == "3b" else gpu.tiny_config()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        bf16 = gpu.PaliGemmaForConditionalGeneration(config).eval()
    torch.set_default_dtype(default)
    int8 = copy.deepcopy(bf16)
    quantize.quantize_int8(int8)
    inputs = gpu.prompts(config, 1, device, dtype)
    hints = Hints()
    torch._logging.set_logs(perf_hints=True, recompiles=True, graph_breaks=True)
    for name in list(logging.root.manager.loggerDict):  # they do not propagate
        if name.startswith("torch"):
            logging.getLogger(name).addHandler(hints)
    shipped = quantize.Int8Linear.cast_product
    results, tokens = {}, {}
    for name, model, product in [
        ("bf16", bf16, shipped),
        ("int8 cast", int8, shipped),
        ("int8 reduction", int8, reduction_product),
    ]:
        quantize.Int8Linear.cast_product = product
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        hints.lines.clear()

        def fn(n, model=model):
            return gpu.run_ours(model, inputs, n, compile=True)

        step, warm_up, tokens[name] = gpu.measure_decode(name, fn, device, 2)
        kept = ("graph_break", "recompiles", "stats", "inductor")
        counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()
                    if k in kept}  # fmt: skip
        results[name] = {
            "ms_per_step": 1e3 * step,
            "warm_up_s": warm_up,
            "counters": json.loads(json.dumps(counters, default=str)),
            "logged": hints.lines[:40],
            "top kernels": profile(fn, device, gpu.NEW_TOKENS),
        }
        print("\n".join(results[name]["top kernels"]), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)  # so far, if cut short
        (args.out / "int8-profile.json").write_text(json.dumps(results, indent=1))
    quantize.Int8Linear.cast_product = shipped
    same = torch.equal(tokens["int8 cast"], tokens["int8 reduction"])
    record = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": args.config,
        "int8 ways gave the same tokens": same,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int8-profile.json").write_text(json.dumps(record, indent=1))
    for name, r in results.items():
        print(f"{name:16} {r['ms_per_step']:8.2f} ms/step  {r['counters']}")
    print(f"int8 ways gave the same tokens: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
