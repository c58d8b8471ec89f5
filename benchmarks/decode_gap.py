"""Where a compiled decoding step's time goes, on a GPU: a diagnostic for issue 15.

    python benchmarks/decode_gap.py      # CUDA only; PaliGemma-3B, random, bf16

It builds PaliGemma-3B with random weights on the GPU in bfloat16 and measures, at batch
1: `generate(compile=True)` per step (64 tokens less 1, over 63, as benchmarks/gpu.py
does); the compiled decoding step alone, its CUDA graph replayed 200 times with no host
synchronisation in between, with and without feeding the argmax back; the LM head's
matrix-vector product alone; and the device's copy bandwidth.

On an H100 80GB HBM3 (torch 2.11.0+cu130), one run, 2026-11-22:

    LM weights read per step                      5.02 GB
    generate(compile=True)                        3.28 ms/step  (1.53 TB/s, 46% of 3.35)
    compiled step replayed, no host sync          2.64 ms/step  (1.90 TB/s, 57%)
      ... feeding the argmax back                 2.65 ms/step
    LM head alone (1.05 GB)                       0.363 ms      (2.90 TB/s)
    copy, read + write                            3.02 TB/s

So about 0.64 ms of each generate step is host work between graph replays (the
finiteness check waits for the GPU at every step, and the bookkeeping kernels run
eagerly), and the step itself reaches 1.9 TB/s where a plain matrix-vector product
reaches 2.9: the remaining gap is inside the graph (the decoder's smaller matrix
products and the kernels between them). Both are where a next step would go; neither is
fixed here.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import prompts, synchronize  # noqa: E402

from paligemma_lib.config import PaliGemmaConfig  # noqa: E402
from paligemma_lib.generation import (  # noqa: E402
    _compiled_caches,
    _compiled_decode_step,
    generate,
)
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration  # noqa: E402

DEVICE, DTYPE = "cuda", torch.bfloat16


def main():
    if not torch.cuda.is_available():
        sys.exit("decode_gap.py measures CUDA graphs: it needs a CUDA GPU")
    torch.manual_seed(0)
    torch.set_default_dtype(DTYPE)
    with torch.device(DEVICE):
        model = PaliGemmaForConditionalGeneration(PaliGemmaConfig()).eval()
    torch.set_default_dtype(torch.float32)
    lm_bytes = 2 * sum(p.numel() for p in model.language_model.parameters())
    print(f"LM weights read per step: {lm_bytes / 1e9:.2f} GB", flush=True)
    inputs = prompts(model.config, 1, DEVICE, DTYPE)

    def seconds(n):
        synchronize(DEVICE)
        start = time.perf_counter()
        generate(model, **inputs, max_new_tokens=n, eos_token_id=None, compile=True)
        synchronize(DEVICE)
        return time.perf_counter() - start

    with torch.inference_mode():
        seconds(64), seconds(1)  # compile, record the graphs
        long = statistics.median(seconds(64) for _ in range(5))
        short = statistics.median(seconds(1) for _ in range(5))
        ms = 1e3 * (long - short) / 63
        print(
            f"generate(compile=True): {ms:.2f} ms/step, {lm_bytes / ms / 1e9:.2f} TB/s"
        )

        step = _compiled_decode_step(torch.device(DEVICE))
        _, kv_cache = _compiled_caches[model]  # the cache generate compiled against
        length = kv_cache.max_length
        token = torch.zeros(1, dtype=torch.long, device=DEVICE)
        positions = torch.full((1, 1), length - 2, device=DEVICE)
        mask = torch.ones(1, length, dtype=torch.long, device=DEVICE)
        kv_cache.seek(length - 2)
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        for feed in (False, True):
            for i in range(210):
                if i == 10:
                    start.record()
                torch.compiler.cudagraph_mark_step_begin()
                logits = step(model, token, positions, mask, kv_cache)
                if feed:
                    token = logits.argmax(-1)
            end.record()
            synchronize(DEVICE)
            ms = start.elapsed_time(end) / 200
            print(
                f"compiled step replayed, no host sync, argmax fed back={feed}: "
                f"{ms:.3f} ms/step, {lm_bytes / ms / 1e9:.2f} TB/s"
            )

        weight = model.language_model.lm_head.weight
        hidden = torch.randn(1, weight.shape[1], device=DEVICE, dtype=DTYPE)
        for i in range(105):
            if i == 5:
                start.record()
            torch.nn.functional.linear(hidden, weight)
        end.record()
        synchronize(DEVICE)
        ms = start.elapsed_time(end) / 100
        size = weight.numel() * weight.element_size()
        rate = size / ms / 1e9
        print(f"LM head alone ({size / 1e9:.2f} GB): {ms:.3f} ms, {rate:.2f} TB/s")

        x = torch.empty(int(2.5e9), dtype=torch.uint8, device=DEVICE)
        y = torch.empty_like(x)
        y.copy_(x)
        start.record()
        for _ in range(10):
            y.copy_(x)
        end.record()
        synchronize(DEVICE)
        print(f"copy: {2 * 2.5e9 * 10 / start.elapsed_time(end) / 1e9:.2f} TB/s")


if __name__ == "__main__":
    main()
