# Hand-written, not exported from a notebook.
"""nano-real's recipes (chapter 12.2) compared at equal budget on the CPU (issue 49 §3).

    python tools/compare_real_recipes.py [--steps 600] [--recipes base,name,pen]

Each recipe of tools/gpu_real.py (its MIXES: `base`, `name`, `pen`, `name+pen`) goes
on from the shipped nano-real for the same steps of the same batch size at the same
learning rate; only the mix differs. Every model, the shipped nano-real included, then
answers the same validation examples, from index START of each world: past the
examples a ship decision reads (tools/gpu_ingest.py's first REAL_N), so choosing a
recipe here spends none of them, and no test example is read. The comparisons are the
ship rule's (tools/ship_rules.py): paired, on the same examples, with jackknife
standard errors; each recipe against the shipped model and against `base`.

The record (measures, paired differences, the probe's readings; no rows) goes to
benchmarks/results/real-recipes-cpu-DATE.json, never into the package: the records
chapter 12.2 reads were moved into paligemma_lib/assets/real/ by hand, in a commit, so
that a run of this tool cannot change what the chapter finds.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from gpu_ingest import REAL_N, REAL_OLD  # noqa: E402
from gpu_real import REAL_FROM, RECIPES  # noqa: E402

START = 3000  # validation index: past --ingest's 0 .. REAL_N - 1
N, OLD = 1200, 400  # clothing and handwriting, chapter 11's worlds
BATCH, LR = 16, 1e-4  # the CPU's batch; a rate for going on, not starting


def train_flags(recipe: str, steps: int, out: Path, lr: float = LR) -> list:
    "The train command for `recipe`: its mix, the CPU's batch, from nano-real"
    flags = list(RECIPES[recipe])
    changes = {"--model": REAL_FROM, "--batch-size": str(BATCH), "--lr": str(lr)}
    for flag, value in changes.items():
        flags[flags.index(flag) + 1] = value
    return [*flags, "--steps", str(steps), "--out", str(out), "--workers", "1",
            "--eval-every", "0", "--eval-size", "8", "--no-progress"]  # fmt: skip


def probe_counts(model_path) -> dict:
    "How many of the probe's six numbers of each kind the model reads right"
    from paligemma_lib import PaliGemmaProcessor, load_pretrained
    from paligemma_lib.real_recipes import grade_probe

    model = load_pretrained(model_path).eval()
    rows = grade_probe(model, PaliGemmaProcessor.from_pretrained("nano"))
    return {k: sum(r["answer"] == r["prediction"] for r in rows if r["kind"] == k)
            for k in ("font", "pen line")}  # fmt: skip


def compare(graded: dict) -> dict:
    """Rows of every model on the same examples -> each recipe against the shipped
    model (the ship rule) and against `base` (paired differences)"""
    import ship_rules

    nano = ship_rules.real_aggregate(graded["nano"])
    shipped = graded["shipped"]
    out = {"against shipped": {}, "against base": {}}
    for name, rows in graded.items():
        if name in ("nano", "shipped"):
            continue
        decision = ship_rules.real_decision(rows, shipped, nano)
        out["against shipped"][name] = decision
        if name != "base" and "base" in graded:
            out["against base"][name] = ship_rules.paired_jackknife(
                rows, graded["base"], ship_rules.real_aggregate,
                key=lambda r: (r["world"], r["prompt"], r["seed"]),
                cluster=lambda r: (r["world"], r["seed"]),
            )  # fmt: skip
    return out


def main(argv=None, train=None, evaluate=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--lr", type=float, default=LR, help="the peak learning rate")
    parser.add_argument("--n", type=int, default=N, help="clothing, handwriting")
    parser.add_argument("--old", type=int, default=OLD, help="shapes, ocr")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    recipes = args.recipes.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(
            f"no recipe {', '.join(unknown)}; the recipes: {', '.join(RECIPES)}"
        )
    out = args.out or ROOT / "benchmarks" / "results" / (
        f"real-recipes-cpu-{date.today():%Y-%m-%d}.json"
    )
    if out.exists():  # a record is never overwritten
        parser.error(f"{out} exists: give another --out")
    if evaluate is None:
        from evaluate_real_gap import evaluate
    if train is None:

        def train(flags):
            command = [sys.executable, "-m", "paligemma_lib", "train", *flags]
            subprocess.run(
                command, check=True, env=os.environ | {"PYTHONPATH": str(ROOT)}
            )

    assert START >= REAL_N and START >= REAL_OLD  # the ship window stays unread
    work = Path(tempfile.mkdtemp())
    sources = {"nano": "nano", "shipped": REAL_FROM}
    trained = {}
    for name in recipes:
        begin = time.perf_counter()
        train(train_flags(name, args.steps, work / name, args.lr))
        trained[name] = round(time.perf_counter() - begin, 1)
        sources[name] = work / name
        print(f"{name}: {args.steps} steps in {trained[name]} s", flush=True)
    graded, models = {}, {}
    for name, source in sources.items():
        record = evaluate(args.n, "validation", old=args.old, model=source, start=START)
        graded[name] = record["rows"]
        models[name] = {"model_sha256": record["model_sha256"],
                        "train seconds": trained.get(name),
                        "probe read right": probe_counts(source)}  # fmt: skip
        print(f"{name}: graded in {record['seconds']} s", flush=True)
    record = {
        "command": "python tools/compare_real_recipes.py "
        f"--steps {args.steps} --recipes {args.recipes} --lr {args.lr}",
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "date": f"{date.today():%Y-%m-%d}",
        "device": "cpu", "from": REAL_FROM, "steps": args.steps, "batch_size": BATCH,
        "lr": args.lr,
        "mixes": {name: RECIPES[name][RECIPES[name].index("--worlds") + 1]
                  for name in recipes},
        "split": "validation", "start": START,
        "examples": {"clothing": args.n, "handwriting": args.n, "shapes": args.old,
                     "ocr": args.old},
        "models": models,
    } | compare(graded)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(work)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
