"""Greedy generation speed: paligemma_lib's generate beside transformers'.

A benchmark, not a test. For each config it builds a transformers PaliGemma with random
weights, saves it, loads the saved weights into ours, checks both generate the same
tokens, then times greedy generation of the same left-padded prompts, alternating the
two, after a warm-up, and prints medians. Run from the repository root:

    python benchmarks/generate.py             # both configs (5 min on 2 CPU cores)
    python benchmarks/generate.py --only mid  # or --only 3b: one config

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
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_reference import ours_from_transformers_state, sharpen  # noqa: E402

from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig  # noqa: E402
from paligemma_lib.generation import generate  # noqa: E402

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


def run_theirs(theirs, inputs):
    with torch.inference_mode():
        out = theirs.generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=0,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, inputs["input_ids"].shape[1] :]


def run_ours(ours, inputs, cache="static", decoding_linears=True):
    return generate(
        ours,
        **inputs,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        cache=cache,
        decoding_linears=decoding_linears,
    )


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(ours, theirs, inputs, repeats, extras):
    """Alternate ours and theirs (and the extras) `repeats` times after a warm-up;
    median seconds per run"""
    # (also the warm-up)
    same = torch.equal(run_ours(ours, inputs), run_theirs(theirs, inputs))
    runs = {
        "ours": lambda: run_ours(ours, inputs),
        "theirs": lambda: run_theirs(theirs, inputs),
    }
    if extras:
        same = same and torch.equal(
            run_ours(ours, inputs, decoding_linears=False), run_ours(ours, inputs)
        )
        runs["ours, nn.Linear"] = lambda: run_ours(ours, inputs, decoding_linears=False)
        runs["ours, no cache"] = lambda: run_ours(ours, inputs, cache="none")
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn))
    return same, {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["mid", "3b"], help="run one config only")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads, greedy, {NEW_TOKENS} new tokens, "
        f"median of {args.repeats} alternating runs after a warm-up"
    )
    for index, (name, config) in enumerate(CONFIGS.items()):
        if args.only and args.only != ("mid", "3b")[index]:
            continue
        with tempfile.TemporaryDirectory() as folder:
            ours, theirs = build(config, folder)
            for batch_size in (1, 4):
                inputs = prompts(config, batch_size)
                repeats = args.repeats if index == 0 else max(2, args.repeats // 2)
                same, t = compare(ours, theirs, inputs, repeats, extras=index == 0)
                rate = {k: batch_size * NEW_TOKENS / v for k, v in t.items()}
                line = (
                    f"{name} | batch {batch_size} | ours {rate['ours']:7.1f} tok/s | "
                    f"transformers {rate['theirs']:7.1f} tok/s | "
                    f"ours/transformers {rate['ours'] / rate['theirs']:.2f}x"
                )
                if "ours, no cache" in rate:
                    line += (
                        f" | ours with nn.Linear "
                        f"{rate['ours, nn.Linear'] / rate['theirs']:.2f}x transformers"
                        f" | ours cache/no-cache "
                        f"{rate['ours'] / rate['ours, no cache']:.1f}x"
                    )
                print(line + f" | same tokens: {same}", flush=True)
            del ours, theirs


if __name__ == "__main__":
    main()
