"""Checks on the chapters as files: the shared setup cell, and clean text."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from setup_cell import chapters, repository_url, setup_cell  # noqa: E402

CHAPTERS = chapters()


def cells(path):
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def test_every_chapter_is_found():
    assert len(CHAPTERS) >= 9, CHAPTERS


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_first_code_cell_is_the_setup_cell(path):
    first = next(c for c in cells(path) if c["cell_type"] == "code")
    assert "".join(first["source"]) == setup_cell(), (
        f"{path.name}: the first code cell is not the setup cell; "
        "run `python tools/setup_cell.py`"
    )


def test_setup_cell_names_the_repository_of_config_yml():
    url = repository_url()
    assert url.startswith("https://"), url
    assert f'repo = "{url}"' in setup_cell()
    assert "paligemma_lib[chapters]" in setup_cell()


# Only tab and newline belong in a notebook's text. A backslash sequence in a
# non-raw Python string ("\a" in "\approx") turns into a control character.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_no_control_characters(path):
    for i, cell in enumerate(cells(path)):
        text = "".join(cell["source"])
        bad = CONTROL.search(text)
        assert bad is None, (
            f"{path.name}, cell {i}: control character {bad.group()!r} in "
            f"{text[max(0, bad.start() - 30) : bad.end() + 10]!r}"
        )
