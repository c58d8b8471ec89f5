"""Train the mask VQ-VAE that the library ships (chapter 12.1) and record it.

    python tools/train_mask_vae.py [--steps N] [--batch-size B] [--seed S]

Trains on the masks of the segmentation world's VAE_TRAIN_SEEDS (float32, the
CPU), writes paligemma_lib/assets/mask_vae/mask_vae.npz in vae-oid.npz's layout
and training_record.json beside it: the command, the commit, the losses, and
the reconstruction IoU and code usage of the file as shipped (float16 weights
read back as float32) on VAE_TEST_SEEDS, scenes no choice looked at.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paligemma_lib.mask_vae_training import (  # noqa: E402
    VAE_TEST_SEEDS,
    VAE_TRAIN_SEEDS,
    reconstruction_report,
    save_mask_vae,
    train_mask_vae,
)
from paligemma_lib.segmentation import load_mask_vae  # noqa: E402

OUT = ROOT / "paligemma_lib" / "assets" / "mask_vae"


def commit() -> str:
    "The checkout's commit, '+dirty' when it has uncommitted changes"
    run = lambda *a: subprocess.run(  # noqa: E731
        ["git", *a], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return run("rev-parse", "HEAD") + ("+dirty" if run("status", "--short") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    start = time.time()
    vae, history = train_mask_vae(args.steps, args.batch_size, args.seed, args.lr)
    seconds = time.time() - start
    OUT.mkdir(parents=True, exist_ok=True)
    save_mask_vae(vae, OUT / "mask_vae.npz")
    shipped = load_mask_vae(OUT / "mask_vae.npz")  # what users get
    report = reconstruction_report(shipped, VAE_TEST_SEEDS)
    last = slice(-50, None)  # the mean of the last 50 steps, less noisy than one
    record = {
        "command": "python tools/train_mask_vae.py " + " ".join(sys.argv[1:]),
        "commit": commit(),
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "seconds": round(seconds, 1),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "lr": args.lr,
        "train_seeds": [VAE_TRAIN_SEEDS.start, VAE_TRAIN_SEEDS.stop],
        "test_seeds": [VAE_TEST_SEEDS.start, VAE_TEST_SEEDS.stop],
        "final_losses": {
            k: float(np.mean(history[k][last]))
            for k in ("loss", "reconstruction", "codebook", "commitment")
        },
        "first_losses": {
            k: float(np.mean(history[k][:50])) for k in ("loss", "reconstruction")
        },
        "codes_restarted": int(sum(history["restarted"])),
        "test_mean_iou_64": float(np.mean(report["iou_64"])),
        "test_mean_iou_full": float(np.mean(report["iou_full"])),
        "test_perplexity": report["perplexity"],
        "test_dead_codes": report["dead_codes"],
        "test_objects": {k: report[k] for k in ("labels", "iou_64", "iou_full")},
    }
    (OUT / "training_record.json").write_text(json.dumps(record, indent=1) + "\n")
    size = (OUT / "mask_vae.npz").stat().st_size
    print(
        f"{args.steps} steps in {seconds:.0f} s; test IoU 64x64 "
        f"{record['test_mean_iou_64']:.3f}, in the box "
        f"{record['test_mean_iou_full']:.3f}; perplexity "
        f"{report['perplexity']:.1f}, {report['dead_codes']} dead codes; "
        f"{size / 1e6:.1f} MB"
    )


if __name__ == "__main__":
    main()
