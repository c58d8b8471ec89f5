# Hand-written, not exported from a notebook.
"""Recipes for the `segment` adapter compared at equal budget on the CPU (ch. 12.1).

    python tools/compare_segment_recipes.py --steps 300 [--recipes lora,rows] [--out F]

Each recipe fine-tunes the shipped nano model on the segments world for the same
steps of the same batches (same seeds, same order), and every `--every` steps the
script measures, on 64 validation scenes, the teacher-forced loss of the answer's
tokens by kind (chapter 12.1's `target_losses`): the four `<loc>` of each box, the
sixteen `<seg>` codes, and the rest (names, separators, <eos>). At the end it
grades the recipe's masks on validation scenes 100-139 (mIoU, chapter 12.1's
metric). No test scene is read.

The recipes (RECIPES below):
- lora: today's adapter, LoRA of rank 16 on every linear layer, lr 2e-3;
- seg rows: the same, and the 128 `<seg>` rows of the (tied) embedding trained;
- seg+loc rows: the same, and the 1,024 `<loc>` rows trained too;
- loc x2: seg rows, and each `<loc>` target counted twice in the loss;
- full: every weight of nano, lr 3e-4 (the GPU script's full run).

The curves and grades go to benchmarks/results/segment-recipes-DATE.json, which
chapter 12.1 draws. Each recipe runs in a process of its own (`--recipe NAME
--part FILE`); the parent runs `--jobs` of them at once and merges their parts.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

RECIPES = {
    "lora": dict(lora=True, rows=(), loc_weight=1.0, lr=2e-3),
    "seg rows": dict(lora=True, rows=("seg",), loc_weight=1.0, lr=2e-3),
    "seg+loc rows": dict(lora=True, rows=("seg", "loc"), loc_weight=1.0, lr=2e-3),
    "loc x2": dict(lora=True, rows=("seg",), loc_weight=2.0, lr=2e-3),
    "full": dict(lora=False, rows=(), loc_weight=1.0, lr=3e-4),
}
BATCH = 16  # the CPU adapter's batch (chapter 12.1)
CURVE_SCENES = 64  # validation scenes 0-63: the teacher-forced losses
GRADE = (100, 40)  # validation scenes 100-139: the mIoU, as before


def token_ids(tokenizer) -> dict:
    "The ids of the <seg> and <loc> pieces"
    import torch

    return {
        "seg": torch.tensor(
            [tokenizer.piece_to_id(f"<seg{i:03d}>") for i in range(128)]
        ),
        "loc": torch.tensor(
            [tokenizer.piece_to_id(f"<loc{i:04d}>") for i in range(1024)]
        ),
    }


def train_rows(model, ids) -> None:
    """Let only the rows `ids` of the tied embedding learn: the table requires
    grad, and a hook zeroes the gradient of every other row. The table is in
    AdamW's group without weight decay (chapter 11.2), so a row whose gradient
    is always zero never moves (its moments stay zero)."""
    import torch

    weight = model.language_model.model.embed_tokens.weight
    keep = torch.zeros(weight.shape[0], 1)
    keep[ids] = 1.0
    weight.requires_grad_(True)
    weight.register_hook(lambda grad: grad * keep.to(grad))


def weighted_loss(loc_ids, loc_weight: float):
    """token_loss_sum with each <loc> target counted loc_weight times (the
    step still divides by the number of targets)"""
    import torch.nn.functional as F

    def token_loss_sum(logits, labels):
        logits, labels = logits[:, :-1].float(), labels[:, 1:]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=-100,
            reduction="none",
        )
        is_loc = (labels.reshape(-1)[:, None] == loc_ids.to(labels)).any(1)
        return (loss * (1 + (loc_weight - 1) * is_loc)).sum()

    return token_loss_sum


def run_recipe(name: str, steps: int, every: int) -> dict:
    "One recipe's training, curves and grade"
    import torch
    from evaluate_segment import grade_scenes

    import paligemma_lib.train as train_module
    from paligemma_lib import PaliGemmaProcessor, load_pretrained
    from paligemma_lib.data import Collator, SyntheticDataset
    from paligemma_lib.lora import LoraConfig, add_lora, count_parameters
    from paligemma_lib.segment_eval import target_losses
    from paligemma_lib.train import TrainConfig, train

    recipe = RECIPES[name]
    torch.manual_seed(0)
    processor = PaliGemmaProcessor.from_pretrained("nano")
    model = load_pretrained("nano")
    ids = token_ids(processor.tokenizer)
    if recipe["lora"]:
        add_lora(model, LoraConfig(r=16, alpha=32, target_modules="all-linear"))
    if recipe["rows"]:
        train_rows(model, torch.cat([ids[k] for k in recipe["rows"]]))
    if recipe["loc_weight"] != 1.0:
        train_module.token_loss_sum = weighted_loss(ids["loc"], recipe["loc_weight"])
    trainable, total = count_parameters(model)
    if recipe["rows"]:  # count the rows that learn, not the whole table
        table = model.language_model.model.embed_tokens.weight
        trainable += sum(len(ids[k]) for k in recipe["rows"]) * table.shape[1]
        trainable -= table.numel()
    collate = Collator(processor)
    curve_set = SyntheticDataset("segments", split="validation", size=CURVE_SCENES)
    curve_batches = [
        collate([curve_set[i] for i in range(s, min(s + 16, CURVE_SCENES))])
        for s in range(0, CURVE_SCENES, 16)
    ]

    def measure() -> dict:
        got = target_losses(model, curve_batches, processor.tokenizer)
        return {k: round(v, 4) for k, v in got.items()}

    curves = {"step": [0], **{k: [v] for k, v in measure().items()}}

    def on_step(step, loss):
        if step % every == 0 or step == steps:
            got = measure()
            curves["step"].append(step)
            for k, v in got.items():
                curves[k].append(v)
            print(
                f"{name} step {step}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in got.items()),
                flush=True,
            )

    config = TrainConfig(
        steps=steps,
        batch_size=BATCH,
        lr=recipe["lr"],
        warmup_steps=steps // 20,
        eval_every=0,
        save_every=0,
        seed=0,
    )
    train_set = SyntheticDataset("segments", split="train", size=5_000_000)
    begin = time.perf_counter()
    history = train(model, train_set, collate, config, progress=False, on_step=on_step)
    seconds = time.perf_counter() - begin
    start, n = GRADE
    metrics = grade_scenes(
        model.eval(), processor, "validation", start, n, batch_size=20
    )[3]
    print(
        f"{name}: validation {start}-{start + n - 1} mIoU {metrics['mIoU']:.3f}",
        flush=True,
    )
    return {
        "recipe": recipe | {"rows": list(recipe["rows"])},
        "trainable parameters": trainable,
        "total parameters": total,
        "seconds": round(seconds, 1),
        "loss": [round(x, 4) for x in history["loss"]],
        "curves": curves,
        "validation": {"indices": [start, start + n - 1], "metrics": metrics},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--recipe", help=argparse.SUPPRESS)  # a child's recipe
    parser.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.recipe is not None:
        result = run_recipe(args.recipe, args.steps, args.every)
        args.part.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    from evaluate_fresh import git_commit

    names = args.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; choose among {list(RECIPES)}")
    out = (
        args.out
        or ROOT
        / "benchmarks"
        / "results"
        / f"segment-recipes-{date.today():%Y%m%d}.json"
    )
    parts = {
        n: out.with_suffix(f".{n.replace(' ', '_').replace('+', '_')}.part")
        for n in names
    }
    env = os.environ | {
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.jobs))
    }
    waiting, running = list(names), []
    while waiting or running:
        while waiting and len(running) < args.jobs:
            name = waiting.pop(0)
            command = [sys.executable, __file__, "--recipe", name,
                       "--part", str(parts[name]), "--steps", str(args.steps),
                       "--every", str(args.every)]  # fmt: skip
            running.append(subprocess.Popen(command, env=env))
        time.sleep(5)
        for process in [p for p in running if p.poll() is not None]:
            running.remove(process)
            if process.returncode:
                print(f"a recipe failed: {process.args}", file=sys.stderr)
                return 1
    record = {
        "command": "python tools/compare_segment_recipes.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(),
        "date": f"{date.today():%Y-%m-%d}",
        "steps": args.steps,
        "batch_size": BATCH,
        "curve scenes": [0, CURVE_SCENES - 1],
        "recipes": {n: json.loads(parts[n].read_text()) for n in names},
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    for part in parts.values():
        part.unlink()
    for name, result in record["recipes"].items():
        c = result["curves"]
        print(f"{name:<14} mIoU {result['validation']['metrics']['mIoU']:.3f}  "
              f"loss loc {c['loc'][-1]:.3f} seg {c['seg'][-1]:.3f} "
              f"text {c['text'][-1]:.3f}  {result['seconds']:.0f} s")  # fmt: skip
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
