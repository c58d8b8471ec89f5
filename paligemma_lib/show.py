# Hand-written, not exported from a chapter: how the book prints long text.
"""The book's column shows 80 characters of code and output. `wrapped` breaks a
longer printed line at spaces, so that a message or a repr reads without
scrolling sideways; the chapters print through it."""

import textwrap

__all__ = ["wrapped"]


def wrapped(text, width: int = 80, indent: str = "  ") -> str:
    """`text` with each line longer than `width` broken at spaces, its
    continuations indented by `indent`; lines that fit, and newlines, kept"""
    return "\n".join(
        textwrap.fill(line, width, subsequent_indent=indent) if line else line
        for line in str(text).split("\n")
    )
