# Hand-written, not exported from a notebook.
"""The shipped nano on chapter 12.2's real-picture worlds, before any training on them.

    python tools/evaluate_real_gap.py [--n 300] [--out FILE]

Asks the shipped nano about the first `--n` examples of the test split of each world,
clothing (caption, count, detect, a third each) and handwriting (ocr), greedily, as
`evaluate` does, and writes paligemma_lib/assets/real/real-gap-DATE.json (shipped
with the library, for the chapter): the git commit, the sha256 of nano's weights,
every example's seed, prompt, answer and prediction (so the chapter can grade them
again) and chapter 11.2's metrics (`compute_metrics`).

On the test split, the examples start at `--start`, by default the first past every
range the ledger (paligemma_lib/assets/ledger.json) lists as spent in these worlds, and
they are written into the ledger before the grade; a range graded before is refused.
"""

import argparse
import hashlib
import json
import sys
import time
from datetime import date
from pathlib import Path

import torch
from torch.utils.data import Subset

import paligemma_lib.real_images  # noqa: F401  (adds the two worlds)
from paligemma_lib import PaliGemmaProcessor, load_pretrained
from paligemma_lib.adapters import load_adapter
from paligemma_lib.data import SyntheticDataset
from paligemma_lib.evaluation import compute_metrics, predict
from paligemma_lib.model_files import resolve_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_fresh import git_commit  # noqa: E402
from ship_rules import LEDGER, fresh_start, read_ledger, spend  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 80  # four items' caption: about 60 tokens of this vocabulary
ASKED = {"clothing": ("caption", "count", "detect"), "handwriting": ("ocr",)}
OLD_WORLDS = {"shapes": ("caption", "count", "colour", "detect"), "ocr": ("ocr",)}


def ask(model, processor, world, task, n: int, split="test", start=0) -> list:
    """The model's answers to examples start .. start+n-1 of `split` of `world`,
    asking `task`"""
    data = SyntheticDataset(world, split=split, size=start + n, task=task)
    indices = range(start, start + n)
    rows = predict(
        model, processor, Subset(data, indices), 32, max_new_tokens=MAX_NEW_TOKENS
    )
    for i, row in zip(indices, rows, strict=True):
        row |= {"world": world, "index": i, "seed": data.seeds[i]}
    return rows


def test_sizes(n: int, old: int) -> dict:
    "How many examples of each world's split `evaluate(n, old=old)` reads"
    asked = ASKED | (OLD_WORLDS if old else {})
    return {w: (n if w in ASKED else old) // len(tasks) for w, tasks in asked.items()}


def evaluate(n: int, split="test", adapter=None, old=0, model="nano", start=0) -> dict:
    """The record: every row, the metrics per world, the files, where and when.
    adapter: a LoRA adapter's folder on `model`; old: examples of chapter 11's
    worlds too (shapes and ocr), to see what fine-tuning kept; model: nano, or a
    model folder (a full fine-tune's checkpoint); start: the first index of
    each world's split asked (the ledger's fresh test examples)"""
    torch.manual_seed(0)
    processor = PaliGemmaProcessor.from_pretrained("nano")
    base = model
    model = load_pretrained(base)
    if adapter is not None:
        load_adapter(model, adapter)
    model.eval()
    started = time.perf_counter()
    rows, metrics = [], {}
    asked = ASKED | (OLD_WORLDS if old else {})
    for world, tasks in asked.items():
        count = n if world in ASKED else old
        mine = [
            r
            for t in tasks
            for r in ask(model, processor, world, t, count // len(tasks), split, start)
        ]
        metrics[world] = compute_metrics(mine)
        rows += mine
    weights = resolve_model_path(base) / "model.safetensors"
    command = f"python tools/evaluate_real_gap.py --n {n} --split {split}"
    command += f" --model {base}" if base != "nano" else ""
    command += f" --adapter {adapter}" if adapter is not None else ""
    command += f" --old {old}" if old else ""
    command += f" --start {start}" if start else ""
    return {
        "command": command,
        "commit": git_commit(),
        "date": f"{date.today():%Y-%m-%d}",
        "torch": torch.__version__,
        "model": str(base),
        "model_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "adapter_sha256": None
        if adapter is None
        else hashlib.sha256(
            (Path(adapter) / "adapter_model.safetensors").read_bytes()
        ).hexdigest(),
        "split": split,
        "start": start,
        "max_new_tokens": MAX_NEW_TOKENS,
        "seconds": round(time.perf_counter() - started, 1),
        "metrics": metrics,
        "rows": rows,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=300, help="examples per world")
    parser.add_argument(
        "--out", type=Path, help="the record (default: paligemma_lib/assets/real/)"
    )
    parser.add_argument("--split", default="test", choices=["validation", "test"])
    parser.add_argument("--model", default="nano", help="nano, or a model folder")
    parser.add_argument("--adapter", type=Path, help="a LoRA adapter on the model")
    parser.add_argument(
        "--old", type=int, default=0, help="examples of shapes and ocr too"
    )
    parser.add_argument(
        "--start", type=int, help="the first index of each world's split (default: "
        "0 for validation; for test, the ledger's first fresh)",
    )  # fmt: skip
    parser.add_argument("--why", default="a grade", help="what the ledger says")
    args = parser.parse_args(argv)
    if args.n < 3:
        parser.error("--n must be at least 3: clothing asks three tasks")
    if args.split == "test":  # spent before the grade, refused if spent before
        sizes = test_sizes(args.n, args.old)
        if args.start is None:
            args.start = fresh_start(read_ledger(), sizes)
        by = f"tools/evaluate_real_gap.py --n {args.n} --old {args.old}"
        for world, n in sizes.items():
            spend(LEDGER, world, args.start, n, by, args.why)
    elif args.start is None:
        args.start = 0
    if args.out is not None and args.out.exists():  # a record is never overwritten
        parser.error(f"{args.out} exists: give another --out")
    record = evaluate(
        args.n, args.split, args.adapter, args.old, args.model, args.start
    )
    split = "" if args.split == "test" else f"{args.split}-"  # test: as before
    out = args.out or ROOT / "paligemma_lib/assets/real" / (
        f"real-gap-{split}{record['date']}.json"
    )
    if out.exists():  # a record is never overwritten (the grade is in `record`)
        out = out.with_name(f"{out.stem}-{time.strftime('%H%M%S')}.json")
    out.write_text(json.dumps(record, indent=1) + "\n")
    for world, metrics in record["metrics"].items():
        for task, values in metrics.items():
            shown = ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in values.items()
            )
            print(f"{world:<12} {task:<10} {shown}")
    print(f"wrote {out} ({record['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
