# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""Command line: answer one prompt about one image.

    python -m paligemma_lib generate --model DIR --image PATH --prompt "caption en"

Bad input (a missing file, an unreadable image, a folder that is not a checkpoint)
ends with one line on stderr and exit status 1, not a traceback."""

import argparse
import sys

import torch
from safetensors import SafetensorError

from .generation import answer
from .processing import PaliGemmaProcessor, load_image, parse_loc_tokens
from .weights import (
    DTYPES,
    CheckpointError,
    checkpoint_files,
    draw_boxes,
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


def generate_command(args: argparse.Namespace) -> int:
    detect = args.prompt.strip().startswith("detect")
    if args.draw and not detect:
        raise ValueError(
            "--draw saves the boxes of a 'detect ...' prompt; "
            f"the prompt {args.prompt!r} asks for none"
        )
    if not args.do_sample and (
        args.temperature != 1.0 or args.top_k is not None or args.top_p is not None
    ):
        raise ValueError(
            "--temperature, --top-k and --top-p shape a sample: "
            "add --do-sample to sample"
        )
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


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return generate_command(args)
    except BAD_INPUT as e:  # bad input: one line, no traceback
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
