# Hand-written, not exported from a notebook.
"""The shipped models on test seeds that no choice ever looked at, on the CPU, once.

    python tools/evaluate_fresh.py [--n 400] [--start N] [--out FILE]

writes benchmarks/results/fresh-test-DATE.json unless --out says otherwise, with the git
commit and the sha256 of every file of the shipped model and adapter it scored. Test
seeds are used once. `--start` defaults to the first index past every range the ledger
(paligemma_lib/assets/ledger.json) lists as spent in shapes, OCR and receipts, and the
range is written into the ledger before the grade. A range the ledger lists is refused,
unless it is a re-run of the very files a fresh-test record scored there; other files
on indices a record reported are refused too (retrained weights need new seeds).

Which seeds were used for what (indices into the test split, `SPLITS["test"]`):
- 0-479 (shapes) and 0-199 (OCR, receipts): the GPU tools' test evaluations, made when
  the learning rate and the LoRA targets were chosen on them (issue 22 section 1);
  chapters 11c and 12 reported 0-95 of these;
- from FRESH_START = 5000 on: never evaluated before this script. The chapters evaluate
  the first 96 of this range, this script the first `--n`.

It also evaluates the shipped receipts adapter on the first 64 validation receipts, the
examples its training run evaluated with a 32-token cap (the record's 0.047), here with
64 tokens. Every answer is saved, so the chapters can grade them with any metric.
"""

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from paligemma_lib import PaliGemmaProcessor, load_pretrained
from paligemma_lib.adapters import load_adapter
from paligemma_lib.data import SyntheticDataset
from paligemma_lib.evaluation import compute_metrics, predict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ship_rules import LEDGER, fresh_start, overlapping, read_ledger, spend  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RECORDS = ROOT / "paligemma_lib" / "assets" / "records"  # those a chapter quotes
SCORED = ("nano", "receipts")  # the folders of paligemma_lib/assets/ scored here
FRESH_START = 5000  # the first test index no evaluation had used (see above)
WORLDS = ("shapes", "ocr", "receipts")  # the test worlds graded here
SHAPES_TASKS = ("caption", "count", "colour", "detect")
MAX_NEW_TOKENS = 64  # a receipt's JSON is about 35 tokens; the longest answers here


class Slice:
    "Examples start .. start+n-1 of a SyntheticDataset, as a dataset `predict` reads"

    def __init__(self, dataset: SyntheticDataset, start: int, n: int):
        if start + n > len(dataset):
            raise ValueError(f"{start}+{n} examples: {dataset!r} has {len(dataset)}")
        self.dataset, self.start, self.n = dataset, start, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.dataset[self.start + i]

    def example(self, i: int):
        return self.dataset.example(self.start + i)


def fresh(world: str, n: int, task=None, start: int = FRESH_START) -> Slice:
    "Test examples start .. start+n-1 of `world` (one shapes task when `task` is given)"
    return Slice(SyntheticDataset(world, "test", task=task), start, n)


def file_hashes(assets: Path = ROOT / "paligemma_lib" / "assets") -> dict:
    "{'nano/model.safetensors': sha256 hex, ...}: every file of the scored folders"
    return {
        f"{folder}/{path.name}": hashlib.sha256(path.read_bytes()).hexdigest()
        for folder in SCORED
        for path in sorted((assets / folder).iterdir())
        if path.is_file()
    }


def git_commit() -> str | None:
    "HEAD's commit, '+changes' appended when the tracked files differ from it"
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:  # no git on this machine
        return None
    if head.returncode != 0:  # not a checkout
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def check_seeds_unused(
    first: int, last: int, files: dict, results=(RESULTS, RECORDS)
) -> None:
    """Refuse test indices first..last when a record in `results` (a folder or
    several) reported any of them for other files (or for files it did not name):
    a reported seed is spent"""
    folders = [results] if isinstance(results, (str, Path)) else results
    found = [p for folder in folders for p in Path(folder).glob("fresh-test-*.json")]
    for record_path in sorted(found):
        record = json.loads(record_path.read_text())
        done_first, done_last = record["test indices"]
        if last < done_first or first > done_last:
            continue
        if record.get("files") == files:  # the same weights: a re-run, not a new score
            continue
        changed = sorted(
            name
            for name in files.keys() | record.get("files", {}).keys()
            if files.get(name) != record.get("files", {}).get(name)
        )
        named = ", ".join(changed) or "not named there"
        raise SystemExit(
            f"test indices {done_first}-{done_last} were reported in "
            f"{record_path.name} for other model files ({named}); "
            f"score these on new seeds: --start {done_last + 1} or later"
        )


def check_ledger(
    first: int, last: int, files: dict, ledger: dict, results=(RESULTS, RECORDS)
) -> bool:
    """The ledger's word on test indices first..last of WORLDS: True, fresh (spend
    them); False, a re-run of these very files on their own range (spend nothing);
    any other range a grade spent before is refused, whoever graded it"""
    folders = [results] if isinstance(results, (str, Path)) else results
    same = [  # this script's records of these very files
        p.name
        for folder in folders
        for p in Path(folder).glob("fresh-test-*.json")
        if json.loads(p.read_text()).get("files") == files
    ]
    spent = [e for w in WORLDS for e in overlapping(ledger, w, first, last)]
    others = [
        e
        for e in spent
        if not (
            any(n in e["by"] for n in same) and e["start"] <= first <= last <= e["stop"]
        )
    ]
    if others:
        before = "; ".join("{world} {start}-{stop} by {by}".format(**e) for e in others)
        raise SystemExit(
            f"test indices {first}-{last} were graded before ({before}); "
            f"score on new seeds: --start {fresh_start(ledger, WORLDS, first)} or later"
        )
    return not spent


def run(model, processor, dataset, batch_size: int) -> dict:
    begin = time.time()
    rows = predict(model, processor, dataset, batch_size, MAX_NEW_TOKENS)
    return {
        "rows": rows,
        "metrics": compute_metrics(rows),
        "seconds": round(time.time() - begin, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=400, help="test examples per task")
    parser.add_argument(
        "--start",
        type=int,
        help="the first test index (default: the ledger's first fresh)",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT
        / "benchmarks/results"
        / f"fresh-test-{time.strftime('%Y%m%d')}.json",
    )
    args = parser.parse_args()
    if args.start is None:
        args.start = fresh_start(read_ledger(), WORLDS, FRESH_START)
    if args.start < FRESH_START:
        parser.error(
            f"--start {args.start}: indices below {FRESH_START} were chosen on"
        )
    first, last = args.start, args.start + args.n - 1
    files = file_hashes()
    check_seeds_unused(first, last, files)
    if check_ledger(first, last, files, read_ledger()):  # spent before the grade
        out = args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out
        by = f"tools/evaluate_fresh.py --n {args.n} --start {first} ({out})"
        for world in WORLDS:
            spend(LEDGER, world, first, args.n, by, "the shipped models, reported")
    torch.manual_seed(0)
    result = {
        "command": f"python tools/evaluate_fresh.py --n {args.n} --start {args.start}",
        "commit": git_commit(),
        "files": files,
        "split": "test",
        "test indices": [first, last],
        "max_new_tokens": MAX_NEW_TOKENS,
        "device": "cpu",
        "torch": torch.__version__,
        "nano": {},
    }

    def save():
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    processor = PaliGemmaProcessor.from_pretrained("nano")
    adapted = load_pretrained("nano").eval()
    load_adapter(adapted, "receipts")
    validation = SyntheticDataset("receipts", "validation", size=64)
    key = "receipts validation (first 64)"
    result[key] = run(adapted, processor, validation, args.batch_size)
    print(key, result[key]["metrics"], flush=True)
    save()

    model = load_pretrained("nano").eval()
    for task in SHAPES_TASKS:
        dataset = fresh("shapes", args.n, task, args.start)
        result["nano"][task] = run(model, processor, dataset, args.batch_size)
        print(task, result["nano"][task]["metrics"], flush=True)
        save()
    ocr = fresh("ocr", args.n, start=args.start)
    result["nano"]["ocr"] = run(model, processor, ocr, args.batch_size)
    print("ocr", result["nano"]["ocr"]["metrics"], flush=True)
    save()

    load_adapter(model, "receipts")
    result["receipts"] = run(
        model, processor, fresh("receipts", args.n, start=args.start), args.batch_size
    )
    print("receipts test", result["receipts"]["metrics"], flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
