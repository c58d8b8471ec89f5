# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""The command line's parser and dispatch: one subcommand per module of this
package, bad input reported in one `error:` line with status 1."""

import argparse
import sys
import warnings

from .. import __version__
from .demo import add_demo_parser, demo_command
from .evaluate import add_evaluate_parser, evaluate_command
from .generate import add_generate_parser, generate_command
from .options import BAD_INPUT, HelpFormatter, one_line, warning_note
from .train import add_train_parser, train_command


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
    add_generate_parser(commands)
    add_train_parser(commands)
    add_evaluate_parser(commands)
    add_demo_parser(commands)
    return parser


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
        warnings.showwarning = warning_note
        try:
            return COMMANDS[args.command](args, argv)
        except BAD_INPUT as e:  # bad input: one line, no traceback
            print(f"error: {one_line(e)}", file=sys.stderr)
            return 1
