# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""What the commands share: the --model and --adapter checks, the help texts, the
worlds, the device and image checks, and the errors reported in one line."""

import argparse
import math
import re
import shutil
import sys
import tempfile
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


def check_model(name_or_path, flag: str = "--model") -> None:
    """The checkpoint files of --model, with a hint when it names an adapter
    folder, and a note when a folder here has the shipped name it gives"""
    from ..adapters import ADAPTER_CONFIG

    note_shadowed(name_or_path, SHIPPED, flag, "model")
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


def note_shadowed(name, shipped_names, flag: str, what: str) -> None:
    """One line when `name` is a shipped name and a folder here has it too: the
    shipped one is used"""
    if isinstance(name, str) and name in shipped_names and Path(name).is_dir():
        print(
            f"note: {flag} {name} is the shipped {what}, not the folder {name} here; "
            f"give {flag} ./{name} for that folder",
            file=sys.stderr,
        )


def base_source(adapter: Path) -> str:
    "Which file of an adapter folder names its base model"
    if read_json(adapter / "training_record.json", missing_ok=True).get(
        "fine-tuned from"
    ):
        return "training_record.json ('fine-tuned from')"
    return "adapter_config.json (base_model_name_or_path)"


def adapter_base(adapter: Path) -> str | None:
    """The model an adapter folder was trained on, as its training record (or
    else its adapter_config.json) names it; None if neither does"""
    from ..adapters import ADAPTER_CONFIG

    record = read_json(adapter / "training_record.json", missing_ok=True)
    base = record.get("fine-tuned from") or read_json(
        adapter / ADAPTER_CONFIG, missing_ok=True
    ).get("base_model_name_or_path")
    return base if isinstance(base, str) and base else None


def same_model(a: Path, b: Path) -> bool:
    "Two checkpoint folders: the same folder, or the same weights' bytes"
    if a.resolve() == b.resolve():
        return True
    weights = [sorted(f.glob("*.safetensors")) for f in (a, b)]
    if [f.name for f in weights[0]] != [f.name for f in weights[1]]:
        return False
    for x, y in zip(*weights):
        if x.stat().st_size != y.stat().st_size:
            return False
    return all(x.read_bytes() == y.read_bytes() for x, y in zip(*weights))


def check_adapter_base(model, adapter, flag: str = "--adapter") -> None:
    """Refuse an adapter whose files name the model it was trained on when
    --model is another: its updates fit that model's weights only. Nothing is
    said where the base is not named, or not found here"""
    from ..adapters import resolve_adapter_path

    folder = resolve_adapter_path(adapter)
    base = adapter_base(folder)
    if base is None:
        return
    try:
        base_folder = resolve_model_path(base)
    except FileNotFoundError:
        return
    if same_model(base_folder, resolve_model_path(model)):
        return
    raise ValueError(
        f"{flag} {adapter} was trained on the model {base} (its "
        f"{base_source(folder)} says so), and --model {model} is another model, "
        f"whose weights its updates were not trained with; give --model {base}, or "
        f"an adapter trained on {model}"
    )


def adapter_folder(name_or_path, flag: str = "--adapter") -> Path:
    """The adapter folder --adapter names, its files checked before any model
    loads"""
    from ..adapters import check_adapter

    note_shadowed(name_or_path, SHIPPED_ADAPTERS, flag, "adapter")
    try:
        folder, _ = check_adapter(name_or_path)
    except (OSError, ValueError) as e:  # the same kind, the flag named first
        raise type(e)(f"{flag} {name_or_path}: {e}") from None
    return folder


ASSETS = Path(__file__).resolve().parents[1] / "assets"  # the shipped files


def shipped(folder) -> bool:
    "Whether `folder` is one the package ships (a model or an adapter)"
    return Path(folder).resolve().is_relative_to(ASSETS)


def refuse_shipped(path, flag: str) -> None:
    """Refuse a path a command would write when it lies among the package's
    shipped files (paligemma_lib/assets, symbolic links followed): the commands
    only read those"""
    if shipped(path):
        raise ValueError(
            f"{flag} {path} is inside the files shipped with the package "
            f"({ASSETS}), which the commands never change; give a path outside it"
        )


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


def world_prompts(world: str) -> dict:
    """The prompts the examples of `world` ask (chapters 11, 12.1 and 12.2), by
    task: the tasks' templates, filled with the kinds of things it draws"""
    from ..data import KINDS, PROMPTS, TASKS

    if world not in TASKS:  # a world of chapter 12.1 or 12.2, added on import
        import_data()
    kinds, templates = KINDS, dict(PROMPTS)
    if world == "clothing":
        from ..real_images import COUNT_PROMPT, ITEMS

        kinds, templates["count"] = ITEMS, COUNT_PROMPT
    return {
        task: [templates[task].format(kind=kind) for kind in kinds]
        for task in TASKS[world]
    }


def taught_prompts(model, adapter=None) -> dict | None:
    """The prompts the model (and adapter) were trained on, by task, from the
    worlds of their training records; None when a record lists no worlds"""
    worlds = taught_worlds(model, adapter)
    if worlds is None:
        return None
    taught = {}
    for world in sorted(worlds & set(WORLDS)):
        for task, prompts in world_prompts(world).items():
            taught[task] = sorted({*taught.get(task, []), *prompts})
    return taught


def prompt_as_taught(args) -> str:
    """--prompt as the model is asked it: with the spaces of a prompt it was
    trained on when it differs from one only in spaces (the tokenizer reads
    every space), said in one line; one line, too, when the training records
    list no such prompt"""
    taught = taught_prompts(args.model, args.adapter)
    prompt = args.prompt
    every = {p for prompts in (taught or {}).values() for p in prompts}
    if taught is None or prompt in every:
        return prompt
    model = args.model + (f" with adapter {args.adapter}" if args.adapter else "")
    spaced = " ".join(prompt.split())
    if spaced in every:
        print(
            f"note: asked {spaced!r}, the prompt {model} was trained on, for "
            f"{prompt!r} (its spaces differ, and the tokenizer reads every space)",
            file=sys.stderr,
        )
        return spaced
    alike = sorted(p for p in every if p.split()[0] == spaced.split()[0])
    if not alike:  # one of each task's
        alike = [prompts[0] for prompts in taught.values()]
    shown = ", ".join(repr(p) for p in alike[:12]) + (", ..." if alike[12:] else "")
    print(
        f"note: {model} was not trained on the prompt {prompt!r}, so the answer "
        f"may mean nothing; its training records' prompts include {shown}",
        file=sys.stderr,
    )
    return prompt


def check_prompt_text(prompt: str) -> None:
    "--prompt as text: bytes that are not UTF-8 are refused, not tokenised"
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(prompt[e.start]) - 0xDC00  # os.fsdecode's escape of a byte
        what = f"byte 0x{byte:02x}" if 0x80 <= byte <= 0xFF else "a character"
        raise ValueError(
            f"--prompt is not valid UTF-8 text ({what} at character {e.start}); "
            "give the prompt as UTF-8 text (check the terminal's encoding)"
        ) from None


def fully_transparent(path) -> bool:
    "Whether every pixel of the image file is fully transparent (alpha 0)"
    from PIL import Image

    with Image.open(path) as image:
        if "A" not in image.getbands() and "transparency" not in image.info:
            return False
        return image.convert("RGBA").getchannel("A").getextrema()[1] == 0


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


# what a run writes into --out: a model (save_pretrained) or an adapter
# (save_adapter), its record, its checkpoints; --overwrite removes these only
RUN_FILES = (
    "training_record.json",
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "preprocessor_config.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "adapter_config.json",
    "adapter_model.safetensors",
)


def check_out_folder(out: Path, resume: bool, overwrite: bool = False) -> Path:
    """--out: a folder outside the shipped files, holding a run's checkpoints
    exactly when --resume is given, and a run's files only with --resume or
    --overwrite"""
    from ..resume import CHECKPOINTS, latest_checkpoint

    refuse_shipped(out, "--out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if resume and overwrite:
        raise ValueError(
            "--resume continues the run in --out, --overwrite starts it over: "
            "give one of the two"
        )
    if resume and latest_checkpoint(out) is None:
        raise ValueError(f"--resume: {out} holds no checkpoint to continue from")
    held = [name for name in (*RUN_FILES, CHECKPOINTS) if (out / name).exists()]
    if held and not (resume or overwrite):
        what = "the checkpoints" if CHECKPOINTS in held else f"the {held[0]}"
        raise ValueError(
            f"--out {out} holds {what} of a run: add --resume to continue it, "
            "--overwrite to start over there (its model, record and checkpoints "
            "are removed), or choose another folder"
        )
    return out


def check_writable(out: Path, flag: str = "--out") -> None:
    "Create --out if needed and write a file there, before any training step"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(
            f"{flag} {out} cannot be written ({e.strerror or e}); give a folder "
            "you can write to"
        ) from None


def start_over(out: Path) -> None:
    "--overwrite: remove the files and checkpoints an earlier run wrote in --out"
    from ..resume import CHECKPOINTS

    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    names = [*RUN_FILES, *(f.name for f in out.glob("model-*.safetensors"))]
    for name in names:
        (out / name).unlink(missing_ok=True)


def check_split_size(flag: str, size: int, split: str) -> None:
    "A size flag no larger than the split it draws from"
    from ..data import SPLITS

    if size > len(SPLITS[split]):
        raise ValueError(
            f"{flag} {size}: the {split} split has {len(SPLITS[split]):,} seeds; "
            f"give {flag} {len(SPLITS[split])} or less"
        )
