# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""Command line: answer one prompt about one image.

    python -m paligemma_lib generate --model DIR --image PATH --prompt "caption en"

Bad input (a missing file, an unreadable image, a folder that is not a checkpoint)
ends with one line on stderr and exit status 1, not a traceback."""

import os
import signal
import sys


def _interrupted(signum, frame):
    """Ctrl-C, in any phase: one line and the shell's status for SIGINT (128 + 2).

    `os._exit`, not `sys.exit`: a `SystemExit` raised wherever the signal lands can be
    swallowed by a bare `except:` in a library being imported, and the run would go on
    and end with status 0. Nothing is half-written at this point but a `--draw` file."""
    sys.stdout.flush()
    print("error: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


# Run as a program: first, before the slow imports, so that Ctrl-C never prints a
# traceback. (Imported, by the tests, it leaves the caller's Ctrl-C alone.)
if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted)

import argparse
import math
import warnings
from pathlib import Path

import torch
from PIL import Image
from safetensors import SafetensorError

from . import __version__
from .generation import answer
from .processing import (
    PaliGemmaProcessor,
    draw_boxes,
    load_image,
    parse_loc_tokens,
)
from .weights import (
    DTYPES,
    CheckpointError,
    checkpoint_files,
    load_pretrained,
    resolve_device,
)

BAD_INPUT = (
    CheckpointError,
    SafetensorError,
    OSError,
    ValueError,
)  # reported in one line; anything else is a bug


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m paligemma_lib", description="PaliGemma from scratch"
    )
    parser.add_argument(
        "--version", action="version", version=f"paligemma_lib {__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="answer one prompt about one image")
    gen.add_argument(
        "--model",
        required=True,
        help="checkpoint folder (config.json, safetensors, tokenizer.model)",
    )
    gen.add_argument("--image", required=True, help="image file")
    gen.add_argument(
        "--prompt",
        required=True,
        help='task prompt, e.g. "caption en", "answer en ...", "detect cat"',
    )
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="default: as stored in the checkpoint",
    )
    gen.add_argument(
        "--device", default="auto", help="'auto' (GPU when present), 'cpu', 'cuda', ..."
    )
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
    return parser.parse_args(argv)


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


def generate_command(args: argparse.Namespace) -> int:
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
    image = load_image(args.image)
    checkpoint_files(args.model)
    processor = PaliGemmaProcessor.from_pretrained(args.model)
    device = resolve_device(args.device)
    model = load_pretrained(args.model, dtype=args.dtype, device=device)
    generator = (
        torch.Generator(device).manual_seed(args.seed)
        if args.seed is not None
        else None
    )
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
    print(text)
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


def main(argv=None) -> int:
    args = parse_args(argv)
    with warnings.catch_warnings():  # restores the caller's warning display
        warnings.showwarning = _note
        try:
            return generate_command(args)
        except BAD_INPUT as e:  # bad input: one line, no traceback
            print(f"error: {one_line(e)}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
