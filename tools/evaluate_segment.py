# Hand-written, not exported from a notebook.
"""The shipped `segment` adapter on the segments world's test scenes, once (ch. 12.1).

    python tools/evaluate_segment.py [--n 300] [--start N] [--out FILE]

Writes benchmarks/results/segment-test-DATE.json, and the same under "evaluations" in
the shipped adapter's training_record.json: the git commit, the sha256 of the adapter's
and the VAE's weights, every prompt and prediction with its grades (so the chapter can
grade them again), and the metrics of chapter 12.1 (`summarize`): mask mIoU per kind
against the filled box and the class's average mask in the model's own boxes.

Which test scenes: indices `--start` .. `--start + n - 1` of the segments world's test
split; by default the first past every range that the ledger lists as spent
(paligemma_lib/assets/ledger.json, tools/ship_rules.py), and the range is written into
the ledger before the grade. A range graded before is refused: test is graded once.
`--split validation` is a dry run that spends nothing.
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

from paligemma_lib import PaliGemmaProcessor, load_pretrained
from paligemma_lib.adapters import load_adapter, resolve_adapter_path
from paligemma_lib.data import SyntheticDataset
from paligemma_lib.evaluation import predict
from paligemma_lib.segment_eval import average_masks, grade, summarize
from paligemma_lib.segmentation import shipped_mask_vae_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_fresh import git_commit  # noqa: E402
from ship_rules import LEDGER, fresh_start, read_ledger, spend  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 80  # three segmented shapes: 68 tokens with <eos>


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def grade_scenes(model, processor, split: str, start: int, n: int, batch_size=32):
    """The model's answers on scenes start .. start+n-1 of the segments world's
    `split`, graded as chapter 12.1 grades them: (rows, examples, grades, metrics)"""
    data = SyntheticDataset("segments", split=split, size=start + n)
    indices = range(start, start + n)
    rows = predict(model, processor, Subset(data, indices), batch_size, MAX_NEW_TOKENS)
    examples = [data.example(i) for i in indices]
    averages = average_masks()
    grades = [
        grade(ex, row["prediction"], averages=averages)
        for ex, row in zip(examples, rows)
    ]
    return rows, examples, grades, summarize([ex.labels[0] for ex in examples], grades)


def evaluate(adapter: Path, split: str, start: int, n: int, batch_size=32) -> dict:
    """The adapter in folder `adapter` on the segments world's scenes start ..
    start+n-1 of `split`: the record chapter 12.1 reads (every prediction with its
    grades, the metrics, the files' hashes, where and when)"""
    torch.manual_seed(0)
    processor = PaliGemmaProcessor.from_pretrained("nano")
    model = load_pretrained("nano")
    load_adapter(model, adapter)  # in place
    started = time.perf_counter()
    rows, examples, grades, metrics = grade_scenes(
        model.eval(), processor, split, start, n, batch_size
    )
    return {
        "command": "python tools/evaluate_segment.py "
        + f"--n {n} --start {start} --split {split}",
        "commit": git_commit(),
        "date": f"{date.today():%Y-%m-%d}",
        "torch": torch.__version__,
        "files": {
            f"{path.parent.name}/{path.name}": sha256(path)
            for folder in (adapter, shipped_mask_vae_path().parent)
            for path in sorted(folder.iterdir())
            if path.suffix in (".safetensors", ".npz")
            or path.name == "adapter_config.json"
        },
        "split": split,
        "indices": [start, start + n - 1],
        "max_new_tokens": MAX_NEW_TOKENS,
        "seconds": round(time.perf_counter() - started, 1),
        "metrics": metrics,
        "rows": [
            {"seed": ex.seed, "prompt": row["prompt"], "prediction": row["prediction"]}
            | {"grades": g}
            for row, ex, g in zip(rows, examples, grades)
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument(
        "--start", type=int, help="the first scene (default: the ledger's first fresh)"
    )
    parser.add_argument("--why", default="a grade", help="what the ledger says")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--split",
        default="test",
        help="validation: a dry run that spends no test scene",
    )
    args = parser.parse_args()
    name = f"segment-{args.split}-{date.today():%Y%m%d}.json"  # the split named
    out = args.out or ROOT / "benchmarks" / "results" / name
    if out.exists():  # a record is never overwritten
        parser.error(f"{out} exists: give --out for this grade's record")
    adapter = resolve_adapter_path("segment")
    if args.split == "test":  # spent before the grade, refused if spent before
        if args.start is None:
            args.start = fresh_start(read_ledger(), ["segments"])
        by = f"tools/evaluate_segment.py --n {args.n} --start {args.start}"
        spend(LEDGER, "segments", args.start, args.n, by, args.why)
    elif args.start is None:
        args.start = 0
    evaluation = evaluate(adapter, args.split, args.start, args.n, args.batch_size)
    if args.split == "test":  # the shipped adapter's record carries its test grade
        record_file = adapter / "training_record.json"  # (the chapter reads it)
        record = json.loads(record_file.read_text())
        record.setdefault("evaluations", {})["segments/test"] = evaluation
        record_file.write_text(json.dumps(record, indent=1) + "\n")
    out.write_text(json.dumps(evaluation, indent=1) + "\n")
    for name, value in evaluation["metrics"].items():
        print(f"{name:<26} {value}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
