# Hand-written, not exported from a notebook.
"""Chapter 12.2's classic anchors, trained to the end: logistic regression and the small
CNN on the 28 x 28 training pictures of each world, graded on the test pictures.

    python tools/train_classic.py [--clothing-epochs 5] [--digit-epochs 20]

Both models see the same pictures for the same epochs (the same examples); then the
logistic regression trains again, from the start, for as many epochs as fit in the CPU
seconds the CNN took (its seconds per epoch measured on one epoch first), so that "the
same CPU budget" holds either way: the same examples, or the same seconds. Writes
paligemma_lib/assets/real/classic-DATE.json, shipped with the library (the command,
commit, seconds, loss curves, every test prediction, accuracies and 10 x 10 confusion
matrices) and the CNNs' weights beside it, classic-cnn-SOURCE-DATE.safetensors, so
that the chapter can check the record.
Run with OMP_NUM_THREADS=1 for seconds comparable to the chapter's machine.
"""

import argparse
import json
import math
import sys
import time
from datetime import date
from pathlib import Path

import torch
from safetensors.torch import save_file

from paligemma_lib.real_images import (
    LogisticRegression,
    SmallCNN,
    confusion_matrix,
    item_tensors,
    train_classifier,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_fresh import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "paligemma_lib" / "assets" / "real"  # shipped: chapter 12.2 reads it


def run(make, name: str, data: tuple, epochs: int) -> tuple:
    "Train one model from seed 0 -> (model, its record)"
    (x_train, y_train), (x_test, y_test) = data
    torch.manual_seed(0)
    model = make()
    started = time.process_time()
    losses = train_classifier(model, x_train, y_train, epochs)
    seconds = time.process_time() - started
    confusion = confusion_matrix(model, x_test, y_test)
    with torch.no_grad():
        predicted = model(x_test).argmax(1)
    steps = len(losses) // epochs
    return model, {
        "model": name,
        "epochs": epochs,
        "cpu_seconds": round(seconds, 2),
        "loss_per_epoch": [
            round(sum(losses[e * steps : (e + 1) * steps]) / steps, 4)
            for e in range(epochs)
        ],
        "accuracy": round((confusion.diag().sum() / confusion.sum()).item(), 4),
        "confusion": confusion.tolist(),
        "predictions": predicted.tolist(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clothing-epochs", type=int, default=5)
    parser.add_argument("--digit-epochs", type=int, default=20)
    args = parser.parse_args(argv)
    today = f"{date.today():%Y-%m-%d}"
    record = {
        "command": "python tools/train_classic.py --clothing-epochs "
        f"{args.clothing_epochs} --digit-epochs {args.digit_epochs}",
        "commit": git_commit(),
        "date": today,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "sources": {},
    }
    for source, epochs in (
        ("clothing", args.clothing_epochs),
        ("digits", args.digit_epochs),
    ):
        data = item_tensors(source, "train"), item_tensors(source, "test")
        runs = {}
        _, runs["logistic"] = run(LogisticRegression, "logistic", data, epochs)
        cnn, runs["cnn"] = run(SmallCNN, "cnn", data, epochs)
        per_epoch = run(LogisticRegression, "logistic", data, 1)[1]["cpu_seconds"]
        budget = max(epochs, math.ceil(runs["cnn"]["cpu_seconds"] / per_epoch))
        _, runs["logistic_long"] = run(LogisticRegression, "logistic", data, budget)
        weights = f"classic-cnn-{source}-{today}.safetensors"
        save_file(cnn.state_dict(), RESULTS / weights)
        record["sources"][source] = {"cnn_weights": weights, "runs": runs}
        for key, r in runs.items():
            print(
                f"{source:<9} {key:<14} {r['epochs']:>3} epochs "
                f"{r['cpu_seconds']:>7.1f} s  accuracy {r['accuracy']:.4f}"
            )
    out = RESULTS / f"classic-{today}.json"
    out.write_text(json.dumps(record) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
