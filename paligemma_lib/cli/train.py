# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""`python -m paligemma_lib train`: train a model from scratch on the synthetic
worlds (chapter 11.2), fine-tune one, every weight or a LoRA adapter (chapter 12),
on the worlds or your own examples; under torchrun, on several processes."""

import argparse
import os
from dataclasses import fields
from pathlib import Path

import torch

from ..devices import gpu_branch
from ..weights import DTYPES, resolve_device
from .adapter_checks import check_adapter_base
from .interrupt import ON_INTERRUPT
from .lora_options import add_lora_arguments, lora_settings
from .options import (
    DEVICE_HELP,
    add_dataclass_options,
    at_least,
    check_device,
    check_model,
    check_split_size,
    command_parser,
    import_data,
    parse_worlds,
)
from .out_folders import check_out_folder, check_writable, start_over

DEFAULT_WORLDS = "shapes=0.7,ocr=0.3"  # nano's mix (chapter 11)


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
    add_lora_arguments(tr)
    tr.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="with --model: the frozen weights' dtype (bfloat16 halves their memory; "
        "LoRA's own weights stay float32). Default: float32",
    )
    tr.add_argument(
        "--out",
        required=True,
        help="output folder: the model, checkpoints, record (not among the "
        "package's shipped files, which the commands only read)",
    )
    from ..train import TrainConfig

    add_dataclass_options(
        tr,
        TrainConfig,
        required={"steps"},
        overrides={"warmup_steps": (None, "default: steps/20")},
    )
    tr.add_argument(
        "--worlds",
        default=None,
        help=f"the training mix, e.g. shapes=0.7,ocr=0.3; not with --data. Default: "
        f"{DEFAULT_WORLDS}",
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
    tr.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --out (same flags as the run)",
    )
    tr.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an --out that holds a run: its model or adapter, record "
        "and checkpoints are removed first (other files stay). Without --resume or "
        "--overwrite, an --out that holds a run is refused",
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


def batch_workers(asked: int | None, device: torch.device) -> int:
    "--workers, or its default for `device`"
    if asked is not None:
        if asked < 0:
            raise ValueError(f"--workers must be 0 or more, got {asked}")
        return asked
    if not gpu_branch(device):  # the CPU computes; on a GPU, workers draw the data
        return 0
    return max(0, min(8, (os.cpu_count() or 1) - 1))


def length_limits(args: argparse.Namespace) -> tuple:
    """(processor, the model's positions): what an example's tokens must fit,
    for --model's checkpoint or a new --config model, read before it loads"""
    from ..model_files import resolve_model_path
    from ..processing import PaliGemmaProcessor
    from ..training_run import new_model_settings
    from ..weights import _read_config

    if args.model is not None:
        processor = PaliGemmaProcessor.from_pretrained(args.model)
        config = _read_config(resolve_model_path(args.model))[1]
    else:  # as training_model lays out a new model's prompts
        processor, config = new_model_settings(args.config)
    return processor, config.text.max_position_embeddings


def datasets(args: argparse.Namespace, worlds: dict) -> tuple:
    "(training set, validation set or None): --data's examples, or the worlds'"
    if args.data is not None:  # checked line by line before the model loads
        from ..finetune import JsonlDataset

        limits = length_limits(args)  # and each line's length against the model
        validation = (
            None if args.eval_data is None else JsonlDataset(args.eval_data, *limits)
        )
        return JsonlDataset(args.data, *limits), validation
    data = import_data()
    return (
        data.SyntheticDataset(worlds=worlds, split="train", size=args.train_size),
        data.SyntheticDataset(worlds=worlds, split="validation", size=args.eval_size),
    )


def train_command(args: argparse.Namespace, argv) -> int:
    from ..resume import latest_checkpoint
    from ..train import TrainConfig, init_distributed
    from ..training_run import MODEL_SIZES, TrainingRun, run_training

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
    if args.data is not None and args.worlds is not None:
        raise ValueError(
            f"--worlds {args.worlds} with --data: --data trains on your examples "
            "only, not on the worlds; leave out one of the two"
        )
    at_least(args, steps=1, train_size=1, eval_size=1)
    worlds = parse_worlds(args.worlds or DEFAULT_WORLDS)
    settings = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    if args.warmup_steps is None:
        settings["warmup_steps"] = args.steps // 20
    config = TrainConfig(**settings)
    out = check_out_folder(Path(args.out), args.resume, args.overwrite, args.lora)
    check_device(args.device)
    if args.model is not None:
        check_model(args.model)
        if args.from_adapter is not None:
            check_adapter_base(args.model, args.from_adapter, "--from-adapter")
    if args.data is None:
        check_split_size("--train-size", args.train_size, "train")
        check_split_size("--eval-size", args.eval_size, "validation")
    check_writable(out)  # before the first step, not after the last
    device = resolve_device(args.device)
    rank, world_size = init_distributed(device)
    if args.overwrite:
        if rank == 0:
            start_over(out)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    if config.fsdp and not torch.distributed.is_initialized():  # before the model
        raise ValueError(
            "--fsdp needs torchrun: torchrun --nproc_per_node N -m paligemma_lib "
            "train --fsdp ... (N=1 is fine)"
        )
    config.micro_batch_size(world_size)  # checks the split before the data loads
    if device.type == "cuda" and world_size > 1:
        device = torch.device("cuda", torch.cuda.current_device())
    train_set, validation = datasets(args, worlds)

    def on_start():
        "Rank 0, before the first step: where it resumes, what Ctrl-C says"
        if args.resume:
            step = checkpoint_step(latest_checkpoint(out))
            print(
                f"resuming from {latest_checkpoint(out)}: step {step} of {args.steps}"
            )
        ON_INTERRUPT["message"] = lambda: interrupted_training(out, argv)

    run = TrainingRun(
        out=out,
        config=config,
        train_set=train_set,
        validation=validation,
        size=args.config,
        model=args.model,
        dtype=args.dtype,
        lora=lora,
        adapter=args.from_adapter,
        lora_tokens=args.lora_tokens,
        resume=args.resume,
        device=device,
        workers=batch_workers(args.workers, device),
        progress=not args.no_progress,
        worlds=None if args.data else worlds,
        data=args.data,
        command="python -m paligemma_lib " + " ".join(map(str, argv)),
    )
    run_training(run, on_start)
    if rank == 0:
        what = "LoRA adapter" if lora is not None else "model"
        print(f"{what} and training record written to {out}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def checkpoint_step(folder: Path) -> int:
    "out/checkpoints/step-0000050 -> 50"
    return int(folder.name.removeprefix("step-"))


def interrupted_training(out: Path, argv) -> str:
    "What Ctrl-C during `train` says: the newest checkpoint and how to go on from it"
    from ..resume import latest_checkpoint

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
