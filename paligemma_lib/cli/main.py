# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""The command line's parser and dispatch: one subcommand per module of this
package, bad input reported in one `error:` line with status 1."""

import argparse
import sys
import warnings
from importlib import import_module

from .. import __version__

# Each command's module of this package, and the line --help gives it. A command's
# module (and torch with it) is imported only when that command is run or asked
# for its --help: `--help` and `--version` start at once (tests/test_cli.py checks
# that these lines are the modules' own).
COMMANDS = {
    "generate": "answer one prompt about one image",
    "train": "train a model from scratch, or fine-tune one (every weight, or a LoRA "
    "adapter), on the synthetic worlds or your own examples",
    "evaluate": "the metrics table of a model on a world (segments: mask mIoU and two "
    "baselines, chapter 12.1)",
    "demo": "serve a web page that asks the model about images (Gradio); Ctrl-C stops "
    "it",
}


def parse_args(argv=None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    return build_parser(named_command(argv)).parse_args(argv)


def named_command(argv) -> str | None:
    "The command argv names: its first word that is not an option (or None)"
    first = next((word for word in argv if not word.startswith("-")), None)
    return first if first in COMMANDS else None


def command_module(name: str):
    "paligemma_lib.cli.<name>: the command's parser and its function"
    return import_module(f"{__package__}.{name}")


def build_parser(full=tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The command line: generate, train, evaluate, demo. The commands named in
    `full` (a name, or several) get their whole parser, the rest a stand-in that
    holds their --help line only"""
    full = (full,) if isinstance(full, str) or full is None else full
    parser = argparse.ArgumentParser(
        prog="python -m paligemma_lib",
        description="PaliGemma from scratch: answer, train, evaluate, serve the demo",
    )
    parser.add_argument(
        "--version", action="version", version=f"paligemma_lib {__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, summary in COMMANDS.items():
        if name in full:
            getattr(command_module(name), f"add_{name}_parser")(commands)
        else:
            commands.add_parser(name, help=summary)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    # the command is known now: its module, and torch, are imported only here
    from .options import (
        BAD_INPUT,
        one_line,
        warning_note,
    )

    run = getattr(command_module(args.command), f"{args.command}_command")
    with warnings.catch_warnings():  # restores the caller's warning display
        warnings.showwarning = warning_note
        try:
            return run(args, argv)
        except BAD_INPUT as e:  # bad input: one line, no traceback
            print(f"error: {one_line(e)}", file=sys.stderr)
            return 1
