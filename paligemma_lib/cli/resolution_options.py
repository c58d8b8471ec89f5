# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""generate's --resolution: the model and processor at another image size (chapter
11.4), the size checked before the model loads."""

import argparse
import math
import sys

from ..resolution import at_resolution, processor_at


def check_resolution(args: argparse.Namespace, processor) -> None:
    "--resolution must be a multiple of the model's patch (read before it loads)"
    if args.resolution is None:
        return
    own = processor.image_size
    patch = own // math.isqrt(processor.num_image_tokens)
    if args.resolution < patch or args.resolution % patch:
        raise ValueError(
            f"--resolution {args.resolution}: give a multiple of {args.model}'s patch "
            f"of {patch} pixels, e.g. {2 * own} (twice its own {own})"
        )


def at_asked_resolution(model, processor, args: argparse.Namespace):
    """The model and processor at --resolution (unchanged without it), with a note
    where the model never trained at that size"""
    own = model.config.vision.image_size
    if args.resolution is None or args.resolution == own:
        return model, processor
    patch = model.config.vision.patch_size
    print(
        f"note: {args.model} sees {own} x {own} pixels as trained; at "
        f"{args.resolution} its learned positions are resampled (chapter 11.4) with "
        "no training at that size, so its answers may be worse",
        file=sys.stderr,
    )
    resized = at_resolution(model, args.resolution)
    return resized, processor_at(processor, args.resolution, patch)
