# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""`python -m paligemma_lib generate`: answer one prompt about one image (chapters 8
and 9), or draw the boxes of a detect prompt, the masks of a segment prompt (12.1)."""

import argparse
import math
import os
import sys
import warnings
from pathlib import Path

import torch
from PIL import Image

from ..boxes import draw_boxes, parse_loc_tokens
from ..demo import MAX_IMAGE_PIXELS
from ..generation import TruncatedAnswerWarning, answer
from ..image_processing import load_image
from ..processing import PaliGemmaProcessor
from ..resolution import detail_note
from ..segmentation import draw_segments, load_mask_vae, parse_segments
from ..weights import DTYPES, load_pretrained, resolve_device
from .adapter_checks import adapter_folder, check_adapter_base
from .options import (
    DEFAULT_MAX_NEW_TOKENS,
    DEVICE_HELP,
    add_model_arguments,
    add_quantize_argument,
    check_device,
    check_image_arg,
    check_model,
    check_quantize,
    command_parser,
    warning_note,
    with_adapter,
)
from .out_folders import refuse_shipped
from .prompts import (
    check_prompt_text,
    check_segment_taught,
    fully_transparent,
    prompt_as_taught,
)
from .resolution_options import at_asked_resolution, check_resolution


def add_generate_parser(commands) -> None:
    gen = command_parser(
        commands,
        "generate",
        "answer one prompt about one image",
    )
    add_model_arguments(gen)
    gen.add_argument(
        "--image",
        required=True,
        help="an image file (PNG, JPEG, ...; a local file, not a URL), of at most "
        f"{MAX_IMAGE_PIXELS // 10**6} megapixels",
    )
    gen.add_argument(
        "--prompt",
        required=True,
        help='task prompt, e.g. "caption en", "answer en ...", "detect cat", '
        '"segment cat"',
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
    gen.add_argument(
        "--resolution",
        type=int,
        default=None,
        metavar="PIXELS",
        help="see pictures of this many pixels a side (a multiple of the patch, "
        "e.g. 448 or 896), the model's learned positions resampled as chapter 11.4 "
        "does; default: the model's own",
    )
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
        help="for detect prompts: save the image with the boxes; for segment "
        "prompts: with the masks (translucent, one colour per object) and boxes",
    )
    gen.add_argument(
        "--seg-vae",
        default=None,
        metavar="VAE.npz",
        help="for segment prompts: the mask VAE that decodes the <seg> tokens, "
        "e.g. big_vision's vae-oid.npz for real PaliGemma. Default: "
        "$PALIGEMMA_SEG_VAE when set, else the VAE the package ships (chapter 12.1)",
    )


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
    if out.is_dir():
        raise ValueError(
            f"--draw {args.draw} is a folder; give a file name, e.g. "
            f"{out / 'boxes.png'}"
        )
    if out.suffix.lower() not in Image.registered_extensions():
        raise ValueError(
            f"--draw {args.draw}: {out.suffix or 'no extension'} is not an image "
            "format Pillow writes; use a name ending in .png or .jpg"
        )
    refuse_shipped(out, "--draw")
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


def generate_command(args: argparse.Namespace, argv=None) -> int:
    check_prompt_text(args.prompt)
    if not args.prompt.strip():
        raise ValueError(
            '--prompt is empty: give a task prompt, e.g. "caption en", "ocr", '
            '"answer en what color is the square?" or "detect circle"'
        )
    task = args.prompt.split()[0]
    if args.draw and task not in ("detect", "segment"):
        raise ValueError(
            "--draw saves the boxes of a 'detect ...' prompt or the masks of a "
            f"'segment ...' prompt; the prompt {args.prompt!r} asks for neither"
        )
    if args.seg_vae is not None and task != "segment":
        raise ValueError(
            "--seg-vae decodes the masks of a 'segment ...' prompt; "
            f"the prompt {args.prompt!r} asks for none"
        )
    check_sampling_flags(args)
    check_device(args.device)
    if args.draw:
        check_draw_path(args)
    # a missing or malformed VAE file fails here, before the model loads
    vae = load_mask_vae(args.seg_vae) if task == "segment" else None
    # Before the (slow) model, so that a bad image, a folder that is not a checkpoint,
    # or one without tokenizer.model fails fast.
    check_image_arg(args.image)
    image = load_image(args.image)
    check_model(args.model, used=[args.adapter])
    check_quantize(args)
    if args.adapter is not None:
        adapter_folder(args.adapter)
        check_adapter_base(args.model, args.adapter)
    if task == "segment":
        check_segment_taught(args)
    prompt = prompt_as_taught(args)
    if fully_transparent(args.image):
        print(
            f"note: every pixel of {args.image} is fully transparent, so the model "
            "sees a plain white picture",
            file=sys.stderr,
        )
    processor = PaliGemmaProcessor.from_pretrained(args.model)
    check_resolution(args, processor)
    device = resolve_device(args.device)
    model = load_pretrained(args.model, dtype=args.dtype, device=device)
    model, processor = at_asked_resolution(model, processor, args)
    if args.quantize == "int8":  # after the resampling, which rebuilds the model
        from ..quantize import quantize_int8

        quantize_int8(model)
    model = with_adapter(model, args, device)
    note = detail_note(*image.size, processor.image_size)
    if note is not None:
        print(f"note: {note}", file=sys.stderr)
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
            prompt,
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
            warning_note(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    if task == "detect":
        objects = parse_loc_tokens(text, image.width, image.height)
        for (x0, y0, x1, y1), label in objects:
            print(f"{label or '?'}: x0={x0:.0f} y0={y0:.0f} x1={x1:.0f} y1={y1:.0f}")
        if args.draw:
            draw_boxes(image, objects).save(args.draw)
            print(f"{len(objects)} boxes drawn on {args.draw}")
    if task == "segment":
        show_segments(image, parse_segments(text, image.width, image.height, vae), args)
    return 0


def show_segments(image, segments: list, args: argparse.Namespace) -> None:
    "One line per object of a segment answer; with --draw, the masks saved"
    for s in segments:
        if not s.valid:
            print(f"{s.label or '?'}: invalid ({s.text[:40]!r})")
            continue
        x0, y0, x1, y1 = s.box
        print(
            f"{s.label or '?'}: x0={x0:.0f} y0={y0:.0f} x1={x1:.0f} y1={y1:.0f} "
            f"mask={int(s.mask.sum())} pixels"
        )
    if args.draw:
        draw_segments(image, segments).save(args.draw)
        masks = sum(s.valid for s in segments)
        print(f"{masks} masks drawn on {args.draw}")
