# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""Command line: answer one prompt about one image; train; evaluate; the demo.

    python -m paligemma_lib generate --image PATH --prompt "caption en" [--model DIR]
                                     [--quantize int8]
    python -m paligemma_lib train --config nano --out DIR --steps N [--resume]
    torchrun --nproc_per_node 2 -m paligemma_lib train ...      # DDP
    python -m paligemma_lib evaluate --world shapes --split test [--model DIR]
    python -m paligemma_lib demo [--model DIR] [--adapter DIR] [--host H] [--port N]

--model defaults to nano, the small model shipped in the package (chapter 11).

Bad input (a missing file, an unreadable image, a folder that is not a checkpoint)
ends with one line on stderr and exit status 1, not a traceback."""

import os
import signal
import sys

# What Ctrl-C says and the status it ends with; a command may replace it (train says
# where to resume, the demo stops quietly)
ON_INTERRUPT = {"message": lambda: "error: interrupted", "status": 130}


def _interrupted(signum, frame):
    """Ctrl-C, in any phase: one line and, but for the demo, the shell's status for
    SIGINT (128 + 2). The demo is a server that runs until Ctrl-C, its documented way
    to stop: there it ends with status 0, as `python -m http.server` does.

    `os._exit`, not `sys.exit`: a `SystemExit` raised wherever the signal lands can be
    swallowed by a bare `except:` in a library being imported, and the run would go on
    and end with status 0. Nothing is half-written at this point but a `--draw` file
    (train's checkpoints are written to a staging folder and renamed when complete)."""
    sys.stdout.flush()
    # on a line of its own: a progress bar may hold the cursor mid-line
    print("\n" + ON_INTERRUPT["message"](), file=sys.stderr, flush=True)
    os._exit(ON_INTERRUPT["status"])


# Run as a program: first, before the slow imports, so that Ctrl-C never prints a
# traceback. (Imported, by the tests, it leaves the caller's Ctrl-C alone.)
if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted)

import argparse
import json
import math
import platform
import re
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from PIL import Image
from safetensors import SafetensorError

from . import __version__
from .demo import MAX_IMAGE_PIXELS, check_image_pixels
from .generation import TruncatedAnswerWarning, answer, gpu_branch
from .paligemma import PaliGemmaForConditionalGeneration
from .processing import (
    SHIPPED,
    PaliGemmaProcessor,
    draw_boxes,
    load_image,
    parse_loc_tokens,
    resolve_model_path,
)
from .weights import (
    DTYPES,
    CheckpointError,
    checkpoint_files,
    load_pretrained,
    resolve_device,
)

DEFAULT_MAX_NEW_TOKENS = 64  # generate's: the longest answer of a shipped task is 41

BAD_INPUT = (
    CheckpointError,
    SafetensorError,
    OSError,
    ValueError,
)  # reported in one line; anything else is a bug


DEFAULT_MODEL = "nano"  # shipped in the package (paligemma_lib/assets/nano)
MODEL_HELP = (
    "checkpoint folder (config.json, safetensors, tokenizer.model) or the name of a "
    f"shipped model ({', '.join(SHIPPED)}); a local folder of that name wins. "
    f"Default: {DEFAULT_MODEL}, the book's small model, trained on synthetic shapes "
    "and text lines only"
)


ADAPTER_HELP = (
    "a LoRA adapter to add to the model: a folder in PEFT's format (from `train "
    "--lora`, PEFT or save_adapter), or the name of a shipped adapter (receipts, "
    "for --model nano)"
)


def check_model(name_or_path) -> None:
    "The checkpoint files of --model, with a hint when it names an adapter folder"
    from .lora import ADAPTER_CONFIG

    folder = Path(name_or_path)
    if (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file():
        raise ValueError(
            f"--model {name_or_path} is a LoRA adapter, not a model: give it as "
            f"--adapter {name_or_path}, with --model the model it was trained on "
            "(its adapter_config.json names it)"
        )
    checkpoint_files(name_or_path)


def adapter_folder(name_or_path) -> Path:
    "The adapter folder --adapter names, checked before any model loads"
    from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, resolve_adapter_path

    folder = resolve_adapter_path(name_or_path)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"--adapter {name_or_path}: {folder} holds no {name}; give the folder "
                f"that `train --lora` or PEFT's save_pretrained wrote"
            )
    return folder


QUANTIZE_HELP = (
    "int8: the decoder layers' Linear weights in int8 with one scale per output "
    "channel (chapter 8.1), half their bytes; the vision tower and the tied LM head "
    "stay as stored. Default: none, the weights as stored"
)


def add_quantize_argument(parser) -> None:
    parser.add_argument(
        "--quantize", choices=("int8",), default=None, help=QUANTIZE_HELP
    )


def check_quantize(args) -> None:
    "--quantize and --adapter exclude each other: LoRA wraps float Linear layers"
    if args.quantize is not None and args.adapter is not None:
        raise ValueError(
            f"--quantize {args.quantize} with --adapter: a LoRA adapter wraps float "
            f"Linear layers, not int8 ones; leave out one of the two, or save the "
            f"model with the adapter merged (merge_lora) and quantise that"
        )


def with_adapter(model, args, device):
    "The model with --adapter's LoRA weights added (unmerged), on `device`"
    if args.adapter is None:
        return model
    from .lora import load_adapter

    load_adapter(model, adapter_folder(args.adapter))
    return model.to(device)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    "argparse's defaults formatter, quiet where there is no default to show"

    def _get_help_string(self, action):
        if action.default is None or action.default is False:  # none, or a flag
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    "The command line: generate, train, evaluate, demo"
    parser = argparse.ArgumentParser(
        prog="python -m paligemma_lib",
        description="PaliGemma from scratch: answer, train, evaluate, serve the demo",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"paligemma_lib {__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate",
        help="answer one prompt about one image",
        formatter_class=HelpFormatter,
    )
    gen.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    gen.add_argument("--adapter", default=None, help=ADAPTER_HELP)
    gen.add_argument(
        "--image",
        required=True,
        help="an image file (PNG, JPEG, ...; a local file, not a URL), of at most "
        f"{MAX_IMAGE_PIXELS // 10**6} megapixels",
    )
    gen.add_argument(
        "--prompt",
        required=True,
        help='task prompt, e.g. "caption en", "answer en ...", "detect cat"',
    )
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="stop after this many tokens; an answer stopped before its end says so "
        "in a note on stderr",
    )
    gen.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="default: as stored in the checkpoint",
    )
    gen.add_argument("--device", default="auto", help=DEVICE_HELP)
    add_quantize_argument(gen)
    gen.add_argument(
        "--do-sample",
        action="store_true",
        help="sample instead of taking the most likely token",
    )
    gen.add_argument("--temperature", type=float, default=1.0, help="with --do-sample")
    gen.add_argument("--top-k", type=int, default=None, help="with --do-sample")
    gen.add_argument("--top-p", type=float, default=None, help="with --do-sample")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling")
    gen.add_argument(
        "--draw",
        default=None,
        metavar="OUT.png",
        help="for detect prompts: save the image with the boxes",
    )
    add_train_parser(commands)
    add_evaluate_parser(commands)
    add_demo_parser(commands)
    return parser


WORLDS = ("shapes", "ocr", "receipts")
DEVICE_HELP = "'auto' (the GPU when there is one), 'cpu', 'cuda', 'cuda:1', ..."
LORA_DEFAULTS = {"lora_r": 8, "lora_alpha": 16.0, "lora_targets": "language"}


def add_train_parser(commands) -> None:
    tr = commands.add_parser(
        "train",
        help="train a model from scratch, or fine-tune one (every weight, or a LoRA "
        "adapter), on the synthetic worlds or your own examples",
        formatter_class=HelpFormatter,
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


def add_evaluate_parser(commands) -> None:
    ev = commands.add_parser(
        "evaluate",
        help="the metrics table of a model on a world",
        formatter_class=HelpFormatter,
    )
    ev.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    ev.add_argument("--adapter", default=None, help=ADAPTER_HELP)
    ev.add_argument(
        "--world",
        required=True,
        choices=WORLDS,
        help="the synthetic world whose examples are asked (chapter 11)",
    )
    ev.add_argument(
        "--split",
        default="test",
        choices=("train", "validation", "test"),
        help="which seeds: the test split was never trained on",
    )
    ev.add_argument("--limit", type=int, default=200, help="examples to evaluate")
    ev.add_argument("--batch-size", type=int, default=16, help="examples at a time")
    ev.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="the longest answer generated",
    )
    ev.add_argument("--device", default="auto", help=DEVICE_HELP)
    add_quantize_argument(ev)
    ev.add_argument(
        "--record",
        action="store_true",
        help="also write the metrics into the folder's training_record.json "
        "(under 'evaluations', with this command)",
    )


def add_demo_parser(commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="serve a web page that asks the model about images (Gradio); Ctrl-C "
        "stops it",
        formatter_class=HelpFormatter,
    )
    demo.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    demo.add_argument(
        "--adapter",
        default=None,
        help="a LoRA adapter folder in PEFT's format, switchable in the page (where "
        "it starts on), or 'none'. Default: the shipped receipts adapter (chapter "
        "12) when the package has it",
    )
    demo.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; anything but this machine's own is warned about",
    )
    demo.add_argument("--port", type=int, default=7860, help="port to listen on")
    demo.add_argument("--device", default="auto", help=DEVICE_HELP)


def demo_command(args: argparse.Namespace, argv=None) -> int:
    "Checks the flags, then imports Gradio (only now) and serves the page"
    from .demo import shipped_adapter

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    check_device(args.device)
    adapter = args.adapter
    if adapter is None:
        adapter = shipped_adapter("receipts")
    elif adapter == "none":
        adapter = None
    elif not Path(adapter).is_dir():
        raise ValueError(
            f"--adapter {adapter}: no such folder; give a folder with "
            "adapter_config.json and adapter_model.safetensors, or 'none'"
        )
    check_model(args.model)
    try:
        from .app import serve
    except ModuleNotFoundError as e:
        if e.name != "gradio":
            raise
        raise ValueError(
            "the demo needs Gradio: pip install 'paligemma_lib[demo]'"
        ) from None
    # Ctrl-C is how the demo is stopped: not an error, status 0
    ON_INTERRUPT.update(message=lambda: "demo stopped", status=0)
    return serve(args.model, adapter, args.host, args.port, args.device)


def parse_worlds(text: str) -> dict:
    "'shapes=0.7,ocr=0.3' -> {'shapes': 0.7, 'ocr': 0.3}"
    worlds = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        name = name.strip()
        if name not in WORLDS:
            raise ValueError(
                f"--worlds {text}: unknown world {name!r}; choose among {WORLDS}, "
                "e.g. shapes=0.7,ocr=0.3"
            )
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"--worlds {text}: the weight of {name} must be a positive number"
            )
        worlds[name] = value
    return worlds


def import_data():
    "The synthetic worlds (chapter 11), imported only by the commands that need them"
    try:
        from . import data
    except ModuleNotFoundError as e:
        if e.name != "paligemma_lib.data":
            raise
        raise ValueError(
            "this installation has no paligemma_lib.data (the synthetic worlds of "
            "chapter 11); install a version of paligemma_lib that has it"
        ) from None
    return data


def at_least(args, **smallest) -> None:
    for name, value in smallest.items():
        given = getattr(args, name)
        if given < value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be at least {value}, got {given}")


LORA_TARGETS = {  # --lora-targets shorthands
    # chapter 10's default names, in the decoder only (SigLIP has q/k/v_proj too)
    "language": r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj"
    r"|down_proj)",
    "all": "all-linear",  # PEFT's: every Linear but the LM head
}


def lora_settings(args):
    """The LoraConfig that --lora-r, --lora-alpha and --lora-targets describe (None
    without --lora, which they must then not be given with)"""
    from .lora import LoraConfig

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
    from .lora import add_lora, count_parameters, save_adapter
    from .processing import GemmaTokenizer, default_tokenizer_path
    from .train import (
        MODEL_SIZES,
        TrainConfig,
        autocast_dtype,
        init_distributed,
        latest_checkpoint,
        make_evaluator,
        model_config,
        train,
    )
    from .weights import save_pretrained

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
        from .finetune import JsonlDataset

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
    from .train import latest_checkpoint

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


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def evaluate_command(args: argparse.Namespace, argv) -> int:
    from .train import compute_metrics, format_metrics, predict

    at_least(args, limit=1, batch_size=1, max_new_tokens=1)
    check_device(args.device)
    if args.record:
        record_path(args.model)  # before the slow part
    check_model(args.model)
    check_quantize(args)
    if args.adapter is not None:
        adapter_folder(args.adapter)
    processor = PaliGemmaProcessor.from_pretrained(args.model)
    data = import_data()
    device = resolve_device(args.device)
    model = load_pretrained(args.model, device=device, quantize=args.quantize)
    model = with_adapter(model, args, device)
    dataset = data.SyntheticDataset(
        worlds={args.world: 1.0}, split=args.split, size=args.limit
    )
    rows = predict(
        model,
        processor,
        dataset,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
    )
    metrics = compute_metrics(rows)
    adapter = f" with adapter {args.adapter}" if args.adapter is not None else ""
    print(f"{args.model}{adapter} on {args.world} ({args.split}, {len(rows)} examples)")
    print(format_metrics(metrics))
    if args.record:
        where = add_evaluation(args, argv, len(rows), metrics)
        print(f"metrics added to {where}")
    return 0


def record_path(model) -> Path:
    record_file = resolve_model_path(model) / "training_record.json"
    if not record_file.is_file():
        raise FileNotFoundError(
            f"--record: {record_file} does not exist; --record adds to the record "
            f"that `train` writes into its output folder"
        )
    return record_file


def add_evaluation(args, argv, examples: int, metrics: dict) -> Path:
    "Add this evaluation to the model folder's training record, atomically"
    record_file = record_path(args.model)
    record = json.loads(record_file.read_text())
    command = " ".join(["python -m paligemma_lib", *map(str, argv)])
    evaluations = record.setdefault("evaluations", {})
    evaluations[f"{args.world}/{args.split}"] = {
        "command": command,
        "examples": examples,
        "metrics": metrics,
    }
    partial = record_file.with_name(f".{record_file.name}.partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(partial, record_file)
    return record_file


def check_sampling_flags(args: argparse.Namespace) -> None:
    "Sampling flags make sense only together with --do-sample, and only in range"
    if not args.do_sample and (
        args.temperature != 1.0
        or args.top_k is not None
        or args.top_p is not None
        or args.seed is not None
    ):
        raise ValueError(
            "--temperature, --top-k, --top-p and --seed shape a sample: "
            "add --do-sample to sample"
        )
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ValueError(
            f"--temperature must be a positive finite number, got {args.temperature}"
        )
    if args.max_new_tokens < 1:
        raise ValueError(
            f"--max-new-tokens must be at least 1, got {args.max_new_tokens}"
        )


def check_draw_path(args: argparse.Namespace) -> None:
    "Fail before the (slow) model if the boxes could not be saved where --draw says"
    out = Path(args.draw)
    if out.suffix.lower() not in Image.registered_extensions():
        raise ValueError(
            f"--draw {args.draw}: {out.suffix or 'no extension'} is not an image "
            "format Pillow writes; use a name ending in .png or .jpg"
        )
    if out.exists() and out.resolve() == Path(args.image).resolve():
        raise ValueError(
            f"--draw {args.draw} is the input image; choose another file name, "
            "so that the original is kept"
        )
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(
            f"--draw {args.draw} cannot be written: "
            + (
                "it is a folder"
                if out.is_dir()
                else f"{folder} is not a writable folder"
            )
        )


def check_device(name: str) -> None:
    "Devices PyTorch knows by name but that cannot run the model here"
    if name == "meta":
        raise ValueError(
            "--device meta holds shapes, not numbers: use cpu, cuda or auto"
        )
    if name.startswith("mps") and not torch.backends.mps.is_available():
        raise ValueError(
            f"--device {name}: PyTorch sees no Apple GPU (MPS) here; use cpu or auto"
        )


URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # http://, https://, s3://, ...


def check_image_arg(image: str) -> None:
    "--image is a local file: say so for a URL, and refuse too many pixels"
    if URL.match(image):
        raise ValueError(
            f"--image {image}: only local files are read, not URLs; download it "
            "first (e.g. curl -o image.png URL) and give the file"
        )
    # Above the limit, refuse: the model sees at most 896 x 896 pixels, so decoding
    # more (3 bytes a pixel: 432 MB for 144 megapixels) costs memory and seconds for
    # nothing, and Pillow would only warn about a possible decompression bomb up to
    # twice its own limit. The demo refuses uploads at the same limit.
    check_image_pixels(image)


def generate_command(args: argparse.Namespace, argv=None) -> int:
    if not args.prompt.strip():
        raise ValueError(
            '--prompt is empty: give a task prompt, e.g. "caption en", "ocr", '
            '"answer en what color is the square?" or "detect circle"'
        )
    detect = args.prompt.strip().startswith("detect")
    if args.draw and not detect:
        raise ValueError(
            "--draw saves the boxes of a 'detect ...' prompt; "
            f"the prompt {args.prompt!r} asks for none"
        )
    check_sampling_flags(args)
    check_device(args.device)
    if args.draw:
        check_draw_path(args)
    # Before the (slow) model, so that a bad image, a folder that is not a checkpoint,
    # or one without tokenizer.model fails fast.
    check_image_arg(args.image)
    image = load_image(args.image)
    check_model(args.model)
    check_quantize(args)
    if args.adapter is not None:
        adapter_folder(args.adapter)
    processor = PaliGemmaProcessor.from_pretrained(args.model)
    device = resolve_device(args.device)
    model = load_pretrained(
        args.model, dtype=args.dtype, device=device, quantize=args.quantize
    )
    model = with_adapter(model, args, device)
    generator = (
        torch.Generator(device).manual_seed(args.seed)
        if args.seed is not None
        else None
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TruncatedAnswerWarning)
        text = answer(
            model,
            processor,
            image,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            generator=generator,
        )
    print(text, flush=True)
    for warning in caught:
        if issubclass(warning.category, TruncatedAnswerWarning):
            print(
                f"note: the answer stopped at --max-new-tokens {args.max_new_tokens} "
                "before its end (<eos>), so it may be cut short; raise "
                "--max-new-tokens",
                file=sys.stderr,
            )
        else:
            _note(warning.message, warning.category, warning.filename, warning.lineno)
    if detect:
        objects = parse_loc_tokens(text, image.width, image.height)
        for (x0, y0, x1, y1), label in objects:
            print(f"{label or '?'}: x0={x0:.0f} y0={y0:.0f} x1={x1:.0f} y1={y1:.0f}")
        if args.draw:
            draw_boxes(image, objects).save(args.draw)
            print(f"{len(objects)} boxes drawn on {args.draw}")
    return 0


def one_line(text) -> str:
    return " ".join(str(text).split())


def _note(message, category, filename, lineno, file=None, line=None):
    "A library warning as one `note:` line, without the source file and line"
    print(f"note: {one_line(message)}", file=sys.stderr)


COMMANDS = {
    "generate": generate_command,
    "train": train_command,
    "evaluate": evaluate_command,
    "demo": demo_command,
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    with warnings.catch_warnings():  # restores the caller's warning display
        warnings.showwarning = _note
        try:
            return COMMANDS[args.command](args, argv)
        except BAD_INPUT as e:  # bad input: one line, no traceback
            print(f"error: {one_line(e)}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
