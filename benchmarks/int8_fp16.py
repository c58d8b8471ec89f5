"""int8 with float16 activations through the cast route: three ways to place the scale.

A benchmark, not a test. `Int8Linear.cast_product` (chapter 8.1) must not let float16
overflow: the sum of x times codes up to 127, before the per-output scale, is
127 / max|W| times the output. The ways, on one layer of `--inputs` x `--outputs`
(default 2056 x 4096: not a multiple of 16, so on a CPU the cast route, not the int8
kernel), float16 activations of `--batch` rows, median of --repeats timings of 10 calls
after a warm-up, all in this process:

- "scale the output" (the old route): F.linear(x, q.half()) * s; overflows;
- "scale the codes" (ours): F.linear(x, q.half().mul_(s[:, None]));
- "float32 sum": (F.linear(x.float(), q.float()) * s.float()).half().

    python benchmarks/int8_fp16.py                   # on the CPU
    python benchmarks/int8_fp16.py --device cuda     # on a GPU

On the book's build machine (2 CPU cores, torch 2.13.0, load average 0.2), 2026-11-24,
`--repeats 9`: batch 1, scale the output 3.82 ms, scale the codes 4.69 ms, float32 sum
9.14 ms; batch 8 (`--batch 8`), 9.18, 10.09 and 14.04 ms. Scaling the codes costs one
multiplication per weight, about a fifth more than the route that overflows, and is
the faster of the two safe ones; on a GPU too, where float16 products run on tensor
cores and a float32 copy of the weight would be twice the bytes. Not yet run there.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from paligemma_lib.quantize import Int8Linear


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=2056)
    parser.add_argument("--outputs", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    linear = torch.nn.Linear(args.inputs, args.outputs, bias=False)
    layer = Int8Linear.from_linear(linear.half()).to(device)
    q, s = layer.weight_int8, layer.weight_scale
    x = torch.randn(args.batch, args.inputs, device=device).half()
    ways = {
        "scale the output": lambda: F.linear(x, q.half()) * s,
        "scale the codes (ours)": lambda: layer.cast_product(x),
        "float32 sum": lambda: (F.linear(x.float(), q.float()) * s.float()).half(),
    }

    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / 10

    for fn in ways.values():  # warm-up
        fn()
    times = {name: [] for name in ways}
    for _ in range(args.repeats):  # the ways in turns, so load hits each alike
        for name, fn in ways.items():
            times[name].append(timed(fn))
    print(
        f"{args.inputs} -> {args.outputs}, batch {args.batch}, float16, "
        f"{device}, torch {torch.__version__}"
    )
    for name, t in times.items():
        print(f"{name:>24}: {statistics.median(t) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
