# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""What the commands share: the --model and --adapter checks, the help texts, the
worlds, the device and image checks, and the errors reported in one line."""

import argparse
import math
import re
import sys
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..adapters import SHIPPED_ADAPTERS
from ..demo import check_image_pixels
from ..model_files import SHIPPED, read_json, resolve_model_path
from ..weights import CheckpointError, checkpoint_files

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
    "--lora`, PEFT or save_adapter), or the name of a shipped adapter "
    f"({', '.join(SHIPPED_ADAPTERS)}; for --model nano)"
)


def check_model(name_or_path) -> None:
    "The checkpoint files of --model, with a hint when it names an adapter folder"
    from ..adapters import ADAPTER_CONFIG

    folder = Path(name_or_path)
    if (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file():
        raise ValueError(
            f"--model {name_or_path} is a LoRA adapter, not a model: give it as "
            f"--adapter {name_or_path}, with --model the model it was trained on "
            "(its adapter_config.json names it)"
        )
    checkpoint_files(name_or_path)


def adapter_folder(name_or_path, flag: str = "--adapter") -> Path:
    """The adapter folder --adapter names, its files checked before any model
    loads"""
    from ..adapters import check_adapter

    try:
        folder, _ = check_adapter(name_or_path)
    except (OSError, ValueError) as e:  # the same kind, the flag named first
        raise type(e)(f"{flag} {name_or_path}: {e}") from None
    return folder


ASSETS = Path(__file__).resolve().parents[1] / "assets"  # the shipped files


def shipped(folder) -> bool:
    "Whether `folder` is one the package ships (a model or an adapter)"
    return Path(folder).resolve().is_relative_to(ASSETS)


def taught_worlds(model, adapter=None) -> set | None:
    """The worlds the model (and adapter) were trained on, by their training
    records; None when a record is missing (real PaliGemma has none)"""
    from ..adapters import resolve_adapter_path

    folders = [resolve_model_path(model)]
    if adapter is not None:
        folders.append(resolve_adapter_path(adapter))
    worlds = set()
    for folder in folders:
        record = read_json(folder / "training_record.json", missing_ok=True)
        if not isinstance(record.get("worlds"), dict):
            return None
        worlds |= set(record["worlds"])
    return worlds


def check_segment_taught(args) -> None:
    """Refuse `segment` where the training records show the model (and its
    adapter) never learned it: the answer would hold no mask, yet be drawn or
    graded as one"""
    taught = taught_worlds(args.model, args.adapter)
    if taught is None or "segments" in taught:
        return
    adapter = f" with adapter {args.adapter}" if args.adapter is not None else ""
    raise ValueError(
        f"{args.model}{adapter} was not taught `segment` (its training records "
        f"list {', '.join(sorted(taught))}), so it answers no masks; add "
        "--adapter segment, the shipped adapter that teaches it (chapter 12.1), "
        "or an adapter trained on the segments world"
    )


QUANTIZE_HELP = (
    "int8: the decoder layers' Linear weights in int8 with one scale per output "
    "channel (chapter 8.1), half their bytes; the vision tower and the tied LM head "
    "stay as stored. Default: none, the weights as stored"
)


def command_parser(commands, name: str, help: str) -> argparse.ArgumentParser:
    "A subcommand's parser, its defaults shown in --help"
    return commands.add_parser(name, help=help, formatter_class=HelpFormatter)


def add_model_arguments(parser, adapter: bool = True) -> None:
    "--model (the shipped nano by default) and, for most commands, --adapter"
    parser.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    if adapter:
        parser.add_argument("--adapter", default=None, help=ADAPTER_HELP)


def add_dataclass_options(parser, cls, required=(), overrides=None) -> None:
    """One --option per field of the dataclass `cls`, with the field's default
    and the help in its metadata: the one place both are written. `required`
    fields have no default; `overrides` maps a field to (default, help)."""
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default, text = (overrides or {}).get(f.name, (f.default, f.metadata["help"]))
        if isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true", help=text)
        elif f.name in required:
            parser.add_argument(flag, type=type(f.default), required=True, help=text)
        else:
            parser.add_argument(flag, type=type(f.default), default=default, help=text)


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
    from ..adapters import load_adapter

    load_adapter(model, adapter_folder(args.adapter))
    return model.to(device)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    "argparse's defaults formatter, quiet where there is no default to show"

    def _get_help_string(self, action):
        if action.default is None or action.default is False:  # none, or a flag
            return action.help
        if "Default:" in action.help:  # the help says it in its own words
            return action.help
        return super()._get_help_string(action)


# segments: chapter 12.1; clothing, handwriting: 12.2 (real pictures)
WORLDS = ("shapes", "ocr", "receipts", "segments", "clothing", "handwriting")


DEVICE_HELP = "'auto' (the GPU when there is one), 'cpu', 'cuda', 'cuda:1', ..."


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
        # segmentation adds "segments", real_images "clothing", "handwriting"
        from .. import data, real_images, segmentation  # noqa: F401
    except ModuleNotFoundError as e:
        ours = ("data", "segmentation", "real_images")
        if e.name not in [f"paligemma_lib.{m}" for m in ours]:
            raise
        raise ValueError(
            f"this installation has no {e.name} (the worlds of chapters 11, 12.1 "
            "and 12.2); install a version of paligemma_lib that has it"
        ) from None
    return data


def at_least(args, **smallest) -> None:
    for name, value in smallest.items():
        given = getattr(args, name)
        if given < value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be at least {value}, got {given}")


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


def one_line(text) -> str:
    return " ".join(str(text).split())


# the longest answer of a shipped task, three segmented shapes, is 68 tokens with
# <eos> (generate()'s own default, 64, holds every other task's)
DEFAULT_MAX_NEW_TOKENS = 80


def warning_note(message, category, filename, lineno, file=None, line=None):
    "A library warning as one `note:` line, without the source file and line"
    print(f"note: {one_line(message)}", file=sys.stderr)


def check_out_folder(out: Path, resume: bool) -> Path:
    "--out: a folder, holding a run's checkpoints exactly when --resume is given"
    from ..resume import latest_checkpoint

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if resume and latest_checkpoint(out) is None:
        raise ValueError(f"--resume: {out} holds no checkpoint to continue from")
    if not resume and latest_checkpoint(out) is not None:
        raise ValueError(
            f"--out {out} holds the checkpoints of a run: add --resume to continue it, "
            "or choose another folder"
        )
    return out
