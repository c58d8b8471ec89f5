# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""`python -m paligemma_lib train`: train a model from scratch on the synthetic
worlds (chapter 11.2), fine-tune one, every weight or a LoRA adapter (chapter 12),
on the worlds or your own examples; under torchrun, on several processes."""

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..generation import gpu_branch
from ..paligemma import PaliGemmaForConditionalGeneration
from ..processing import PaliGemmaProcessor
from ..weights import DTYPES, load_pretrained, resolve_device
from .interrupt import ON_INTERRUPT
from .options import (
    DEVICE_HELP,
    at_least,
    check_device,
    check_model,
    command_parser,
    device_description,
    import_data,
    parse_worlds,
)

LORA_DEFAULTS = {"lora_r": 8, "lora_alpha": 16.0, "lora_targets": "language"}


def add_train_parser(commands) -> None:
    tr = command_parser(
        commands,
        "train",
        "train a model from scratch, or fine-tune one (every weight, or a LoRA "
        "adapter), on the synthetic worlds or your own examples",
    )
    tr.add_argument(
        "--config",
        default=None,
        help="train from scratch a model of this size: nano, or tiny (for tests)",
    )
    tr.add_argument(
        "--model",
        default=None,
        help="or fine-tune this trained model (a checkpoint folder, or nano)",
    )
    tr.add_argument(
        "--lora",
        action="store_true",
        help="with --model: train a LoRA adapter (chapter 10) and leave the model "
        "frozen; the output folder gets the adapter, in PEFT's format",
    )
    tr.add_argument(
        "--lora-r",
        type=int,
        default=None,
        help=f"with --lora: the adapter's rank (default: {LORA_DEFAULTS['lora_r']})",
    )
    tr.add_argument(
        "--lora-alpha",
        type=float,
        default=None,
        help="with --lora: the update is scaled by alpha/r "
        f"(default: {LORA_DEFAULTS['lora_alpha']})",
    )
    tr.add_argument(
        "--lora-targets",
        default=None,
        help="with --lora: the layers adapted: 'language' (the decoder's attention "
        "and MLP), 'all' (every Linear but the LM head, the vision tower's too), or "
        f"comma-separated module names (default: {LORA_DEFAULTS['lora_targets']})",
    )
    tr.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="with --model: the frozen weights' dtype (bfloat16 halves their memory; "
        "LoRA's own weights stay float32). Default: float32",
    )
    tr.add_argument(
        "--out", required=True, help="output folder: the model, checkpoints, record"
    )
    tr.add_argument("--steps", type=int, required=True, help="optimiser steps")
    tr.add_argument(
        "--batch-size", type=int, default=32, help="global batch (all processes)"
    )
    tr.add_argument(
        "--accumulation", type=int, default=1, help="micro-batches per step"
    )
    tr.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    tr.add_argument("--warmup-steps", type=int, default=None, help="default: steps/20")
    tr.add_argument(
        "--min-lr-ratio",
        type=float,
        default=0.1,
        help="the cosine schedule ends at this fraction of --lr",
    )
    tr.add_argument(
        "--weight-decay",
        type=float,
        default=0.1,
        help="AdamW's decoupled weight decay (not on norms, biases, embeddings)",
    )
    tr.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="clip the gradients' global norm to this",
    )
    tr.add_argument(
        "--worlds",
        default="shapes=0.7,ocr=0.3",
        help="the training mix, e.g. shapes=0.7,ocr=0.3",
    )
    tr.add_argument(
        "--data",
        default=None,
        help="train on your own examples instead of the worlds: a folder holding a "
        'JSONL file of {"image": path, "prefix": ..., "suffix": ...} lines and the '
        "images (chapter 12)",
    )
    tr.add_argument(
        "--eval-data",
        default=None,
        help="with --data: a folder of the same format to evaluate on (default: no "
        "evaluation during training)",
    )
    tr.add_argument(
        "--train-size", type=int, default=100_000, help="examples in the train split"
    )
    tr.add_argument(
        "--eval-size", type=int, default=64, help="validation examples per evaluation"
    )
    tr.add_argument("--eval-every", type=int, default=0, help="0: at the end only")
    tr.add_argument("--save-every", type=int, default=0, help="0: at the end only")
    tr.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the new weights, LoRA's initialisation and the data order",
    )
    tr.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each layer's activations in the backward pass: less "
        "memory, one more forward pass per step",
    )
    tr.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --out (same flags as the run)",
    )
    tr.add_argument("--device", default="auto", help=DEVICE_HELP)
    tr.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes that build batches ahead of training (default: 0 on the "
        "CPU, where training uses every core; on CUDA, up to 8 of the spare cores)",
    )
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")


LORA_TARGETS = {  # --lora-targets shorthands
    # chapter 10's default names, in the decoder only (SigLIP has q/k/v_proj too)
    "language": r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj"
    r"|down_proj)",
    "all": "all-linear",  # PEFT's: every Linear but the LM head
}


def lora_settings(args):
    """The LoraConfig that --lora-r, --lora-alpha and --lora-targets describe (None
    without --lora, which they must then not be given with)"""
    from ..lora import LoraConfig

    given = [name for name in LORA_DEFAULTS if getattr(args, name) is not None]
    if not args.lora:
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(
                f"{flags} shape a LoRA adapter: add --lora to train one (without "
                "--lora, --model fine-tunes every weight)"
            )
        return None
    for name, value in LORA_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    targets = LORA_TARGETS.get(args.lora_targets)
    if targets is None:
        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    return LoraConfig(r=args.lora_r, alpha=args.lora_alpha, target_modules=targets)


def batch_workers(asked: int | None, device: torch.device) -> int:
    "--workers, or its default for `device`"
    if asked is not None:
        if asked < 0:
            raise ValueError(f"--workers must be 0 or more, got {asked}")
        return asked
    if not gpu_branch(device):  # the CPU computes; on a GPU, workers draw the data
        return 0
    return max(0, min(8, (os.cpu_count() or 1) - 1))


def train_command(args: argparse.Namespace, argv) -> int:
    from ..lora import add_lora, count_parameters, save_adapter
    from ..processing import GemmaTokenizer, default_tokenizer_path
    from ..train import (
        MODEL_SIZES,
        TrainConfig,
        autocast_dtype,
        init_distributed,
        latest_checkpoint,
        make_evaluator,
        model_config,
        train,
    )
    from ..weights import save_pretrained

    if (args.config is None) == (args.model is None):
        which = "one of them, not both" if args.config else "one of them"
        raise ValueError(
            "give --config SIZE to train a model from scratch, or --model NAME|DIR to "
            f"fine-tune a trained one (e.g. --model nano): {which}"
        )
    if args.config is not None and args.config not in MODEL_SIZES:
        raise ValueError(
            f"--config {args.config}: no such model size; choose among "
            f"{sorted(MODEL_SIZES)}"
        )
    if args.model is None and (args.lora or args.dtype):
        flag = "--lora" if args.lora else "--dtype"
        raise ValueError(f"{flag} needs --model: the trained model to adapt")
    lora = lora_settings(args)
    if args.eval_data is not None and args.data is None:
        raise ValueError("--eval-data goes with --data (your own training examples)")
    at_least(args, steps=1, train_size=1, eval_size=1)
    worlds = parse_worlds(args.worlds)
    warmup = args.warmup_steps if args.warmup_steps is not None else args.steps // 20
    config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        accumulation=args.accumulation,
        lr=args.lr,
        warmup_steps=warmup,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        eval_every=args.eval_every,
        save_every=args.save_every,
        seed=args.seed,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if args.resume and latest_checkpoint(out) is None:
        raise ValueError(f"--resume: {out} holds no checkpoint to continue from")
    if not args.resume and latest_checkpoint(out) is not None:
        raise ValueError(
            f"--out {out} holds the checkpoints of a run: add --resume to continue it, "
            "or choose another folder"
        )
    check_device(args.device)
    if args.model is not None:
        check_model(args.model)
    device = resolve_device(args.device)
    rank, world_size = init_distributed()
    config.micro_batch_size(world_size)  # checks the split before the data loads
    if device.type == "cuda" and world_size > 1:
        device = torch.device("cuda", torch.cuda.current_device())
    data = import_data()
    if args.data is not None:  # checked line by line before the model loads
        from ..finetune import JsonlDataset

        train_set = JsonlDataset(args.data)
        validation = None if args.eval_data is None else JsonlDataset(args.eval_data)
    else:
        train_set = data.SyntheticDataset(
            worlds=worlds, split="train", size=args.train_size
        )
        validation = data.SyntheticDataset(
            worlds=worlds, split="validation", size=args.eval_size
        )

    torch.manual_seed(args.seed)
    if args.model is not None:
        processor = PaliGemmaProcessor.from_pretrained(args.model)
        model = load_pretrained(args.model, dtype=args.dtype or "float32")
        if lora is not None:
            add_lora(model, lora)
    else:
        tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
        model_settings = model_config(args.config, tokenizer)
        processor = PaliGemmaProcessor(
            tokenizer,
            image_size=model_settings.vision.image_size,
            num_image_tokens=model_settings.num_image_tokens,
        )
        model = PaliGemmaForConditionalGeneration(model_settings)
    trainable, total = count_parameters(model)
    # the workers send 8-bit levels (a quarter of float32's bytes): the model
    # normalises them on its device (chapters 1 and 7)
    collate = data.Collator(processor, pixels="uint8")
    evaluate = None
    if validation is not None:
        evaluate = make_evaluator(processor, validation, collate, device=device)
    if rank == 0:
        if args.resume:
            step = checkpoint_step(latest_checkpoint(out))
            print(
                f"resuming from {latest_checkpoint(out)}: step {step} of {args.steps}"
            )
        ON_INTERRUPT["message"] = lambda: interrupted_training(out, argv)
    begin = time.time()
    history = train(
        model,
        train_set,
        collate,
        config,
        out_dir=out,
        resume=args.resume,
        evaluate=evaluate,
        processor=processor,
        device=device,
        progress=not args.no_progress,
        workers=batch_workers(args.workers, device),
    )
    if rank == 0:
        autocast = autocast_dtype(device)
        if lora is not None:
            save_adapter(model, out)
        else:
            save_pretrained(model, out, processor=processor)
        record = {
            "command": "python -m paligemma_lib " + " ".join(map(str, argv)),
            "device": device_description(device),
            # the 16-bit type the steps computed in (None: fp32 throughout)
            "autocast": autocast and str(autocast).removeprefix("torch."),
            "processes": world_size,
            "model": args.config or str(args.model),
            "fine-tuned from": args.model,
            "lora": None
            if lora is None
            else {
                "r": lora.r,
                "alpha": lora.alpha,
                "target_modules": lora.target_modules,
            },
            "parameters": {"trainable": trainable, "total": total},
            "steps": config.steps,
            "seconds": round(time.time() - begin, 1),
            "resumed": args.resume,
            "worlds": None if args.data else worlds,
            "data": args.data,
            "train_config": asdict(config),
            "final_metrics": history["eval"][-1] if history["eval"] else {},
            "history": history,
        }
        (out / "training_record.json").write_text(json.dumps(record, indent=1) + "\n")
        what = "LoRA adapter" if lora is not None else "model"
        print(f"{what} and training record written to {out}")
    if world_size > 1:
        torch.distributed.destroy_process_group()
    return 0


def checkpoint_step(folder: Path) -> int:
    "out/checkpoints/step-0000050 -> 50"
    return int(folder.name.removeprefix("step-"))


def interrupted_training(out: Path, argv) -> str:
    "What Ctrl-C during `train` says: the newest checkpoint and how to go on from it"
    from ..train import latest_checkpoint

    folder = latest_checkpoint(out)
    if folder is None:
        return f"interrupted before the first checkpoint: {out} holds none to resume"
    command = ["python -m paligemma_lib", *map(str, argv)]
    if "--resume" not in argv:
        command.append("--resume")
    return (
        f"interrupted; the last checkpoint is {folder} (step "
        f"{checkpoint_step(folder)}): continue with  {' '.join(command)}"
    )
