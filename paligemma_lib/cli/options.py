# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""What the commands share: the --model and --adapter checks, the help texts, the
worlds, the device and image checks, and the errors reported in one line."""

import argparse
import math
import re
import sys
from dataclasses import fields

import torch
from safetensors import SafetensorError

from ..adapters import SHIPPED_ADAPTERS
from ..demo import check_image_pixels
from ..model_files import SHIPPED, resolve_model_path
from ..weights import CheckpointError, checkpoint_files
from .adapter_checks import adapter_base, base_source, note_shadowed

BAD_INPUT = (
    CheckpointError,
    SafetensorError,
    OSError,
    ValueError,
)  # reported in one line; anything else is a bug


DEFAULT_MODEL = "nano"  # shipped in the package (paligemma_lib/assets/nano)


MODEL_HELP = (
    "checkpoint folder (config.json, safetensors, tokenizer.model) or the name of a "
    f"shipped model ({', '.join(SHIPPED)}); a shipped name means the shipped model, "
    "even where a folder here has that name (give such a folder as ./NAME). "
    f"Default: {DEFAULT_MODEL}, the book's small model, trained on synthetic shapes "
    "and text lines only"
)


ADAPTER_HELP = (
    "a LoRA adapter to add to the model: a folder in PEFT's format (from `train "
    "--lora`, PEFT or save_adapter), or the name of a shipped adapter "
    f"({', '.join(SHIPPED_ADAPTERS)}; for --model nano; a folder here of that name "
    "is ./NAME), or 'none' for no adapter. An adapter whose training record names "
    "the model it was trained on is refused with another"
)


def no_adapter(value: str):
    "--adapter none: no adapter"
    return None if value == "none" else value


def check_model(name_or_path, flag: str = "--model", used=()) -> None:
    """The checkpoint files of --model, with a hint when it names an adapter
    folder, and a note when a folder here has the shipped name it gives (unless
    the command gives that folder too, `used`: its --adapter)"""
    from ..adapters import ADAPTER_CONFIG

    note_shadowed(name_or_path, SHIPPED, flag, "model", used)
    folder = resolve_model_path(name_or_path)
    if (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file():
        base = adapter_base(folder)
        model = (
            f"with --model {base}, the model it was trained on (its "
            f"{base_source(folder)} names it)"
            if base is not None
            else "with --model the model it was trained on (its files do not name it)"
        )
        raise ValueError(
            f"{flag} {name_or_path} is a LoRA adapter, not a model: give it as "
            f"--adapter {name_or_path}, {model}"
        )
    checkpoint_files(name_or_path)


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
        parser.add_argument(
            "--adapter", default=None, type=no_adapter, help=ADAPTER_HELP
        )


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
    """The model with --adapter's LoRA weights added (unmerged), on `device`;
    the adapter's files were checked (adapter_folder) before the model loaded"""
    if args.adapter is None:
        return model
    from ..adapters import load_adapter, resolve_adapter_path

    load_adapter(model, resolve_adapter_path(args.adapter))
    return model.to(device)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    "argparse's defaults formatter, quiet where there is no default to show"

    def _get_help_string(self, action):
        if action.default is None or action.default is False:  # none, or a flag
            return action.help
        if "Default:" in action.help:  # the help says it in its own words
            return action.help
        return super()._get_help_string(action)


# segments, boxes: chapter 12.1; clothing, handwriting, naming, pen: 12.2 (real
# pictures); detail: 11.4 (small text and shapes, drawn at 448)
WORLDS = ("shapes", "ocr", "receipts", "segments", "boxes", "clothing", "handwriting",
          "naming", "pen", "detail")  # fmt: skip


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
        # segmentation adds "segments" (segment_batches its training batches,
        # codes written on the device), segment_recipes "boxes", real_images
        # "clothing", "handwriting", real_recipes "naming", "pen", small_detail "detail"
        from .. import (  # noqa: F401
            data,
            real_images,
            real_recipes,
            segment_batches,
            segment_recipes,
            segmentation,
            small_detail,
        )
    except ModuleNotFoundError as e:
        ours = ("data", "segmentation", "segment_batches", "segment_recipes",
                "real_images", "real_recipes", "small_detail")  # fmt: skip
        if e.name not in [f"paligemma_lib.{m}" for m in ours]:
            raise
        raise ValueError(
            f"this installation has no {e.name} (the worlds of chapters 11, 11.4, "
            "12.1 and 12.2); install a version of paligemma_lib that has it"
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


def check_split_size(flag: str, size: int, split: str) -> None:
    "A size flag no larger than the split it draws from"
    from ..data import SPLITS

    if size > len(SPLITS[split]):
        raise ValueError(
            f"{flag} {size}: the {split} split has {len(SPLITS[split]):,} seeds; "
            f"give {flag} {len(SPLITS[split])} or less"
        )
