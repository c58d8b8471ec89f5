"""paligemma_lib.show.wrapped: how the chapters print long text in the column"""

from paligemma_lib.show import wrapped


def test_long_lines_break_at_spaces_and_nothing_is_lost():
    text = "short line\n\n" + " ".join(f"word{i}" for i in range(40))
    out = wrapped(text, width=30)
    lines = out.split("\n")
    assert lines[:2] == ["short line", ""]  # lines that fit, and blank ones, kept
    assert all(len(line) <= 30 for line in lines)
    assert all(line.startswith("  ") for line in lines[3:])  # continuations
    assert out.split() == text.split()  # the same words, in order


def test_a_word_longer_than_the_width_is_broken_to_fit():
    "A path or a repr with no space still fits the column"
    lines = wrapped("x" * 50, width=20).split("\n")
    assert all(len(line) <= 20 for line in lines)
    assert "".join(line.strip() for line in lines) == "x" * 50
