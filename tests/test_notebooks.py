"""Checks on the chapters as files: the shared setup cell, what the chapters import,
and clean text."""

import ast
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import run_book  # noqa: E402
from setup_cell import (  # noqa: E402
    chapters,
    is_setup_cell,
    repository_url,
    setup_cell,
)

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


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_one_setup_cell_and_unique_cell_ids(path):
    "A changed template replaces the old setup cell; no cell id is used twice"
    chapter = cells(path)
    assert sum(map(is_setup_cell, chapter)) == 1, f"{path.name}: setup cells"
    ids = [c.get("id") for c in chapter]
    assert len(ids) == len(set(ids)), f"{path.name}: repeated cell ids"


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


# What a chapter imports, against what the setup cell installs: the library's runtime
# dependencies and the extra named in the setup cell. Top-level module -> distribution.
DISTRIBUTION = {
    "torch": "torch",
    "numpy": "numpy",
    "PIL": "pillow",
    "safetensors": "safetensors",
    "sentencepiece": "sentencepiece",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
    "transformers": "transformers",
    "google": "protobuf",  # google.protobuf
    "peft": "peft",
    "gradio": "gradio",
}
# Every Jupyter kernel (Colab's too) runs on IPython: no extra needs to bring it.
KERNEL = {"IPython"}
# Imports a chapter makes only on request, with the cell saying what to install:
# (chapter, module) -> when the import runs.
ON_REQUEST = {
    ("12_fine_tuning.ipynb", "datasets"): "with CORD_FOLDER set (pip install datasets)",
    (
        "13_demo.ipynb",
        "playwright",
    ): "only where the machine has Chromium; Colab has none",
}


def setup_cell_extra() -> str:
    "The extra the setup cell installs: paligemma_lib[NAME]"
    return re.search(r"paligemma_lib\[(\w+)\]", setup_cell()).group(1)


def installed_by_setup_cell() -> set[str]:
    "Distributions the setup cell's install brings: runtime dependencies and the extra"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(requirements):
        for requirement in requirements:
            name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group()
            if name == "paligemma_lib":  # paligemma_lib[other]: that extra too
                inner = re.search(r"\[(.*)\]", requirement).group(1)
                for extra in inner.split(","):
                    yield from names(extras[extra.strip()])
            else:
                yield re.sub(r"[-_.]+", "-", name).lower()

    return set(names(project["dependencies"])) | set(names(extras[setup_cell_extra()]))


def imported_modules(source: str, package: str = "paligemma_lib") -> set[str]:
    """Dotted names of what `source` imports (IPython's %magic and !shell lines are
    skipped); relative imports are resolved against `package`"""
    code = "\n".join(
        "" if line.lstrip().startswith(("%", "!")) else line
        for line in source.splitlines()
    )
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            # `from paligemma_lib import app`: the module app, too
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def third_party(modules: set[str]) -> set[str]:
    """Top-level third-party modules imported by `modules`, following imports of
    paligemma_lib's own modules into their source (chapter 13 gets gradio that way)"""
    seen, found, todo = set(), set(), set(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        top = name.split(".")[0]
        if top != "paligemma_lib":
            if top not in sys.stdlib_module_names and top != "__future__":
                found.add(top)
            continue
        parts = name.split(".")[1:]
        path = ROOT.joinpath("paligemma_lib", *parts)
        file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if file.is_file():
            package = name if file.name == "__init__.py" else name.rsplit(".", 1)[0]
            todo |= imported_modules(file.read_text(encoding="utf-8"), package)
    return found


def missing_from_setup(chapter: str, source: str) -> list[str]:
    "What `source`, a chapter's code, imports that the setup cell does not install"
    installed = installed_by_setup_cell()
    problems = []
    for module in sorted(third_party(imported_modules(source))):
        if module in KERNEL or (chapter, module) in ON_REQUEST:
            continue
        dist = DISTRIBUTION.get(module)
        if dist is None:
            problems.append(
                f"{module}: not in tests/test_notebooks.py's DISTRIBUTION map; add it "
                f"with its distribution, and that to the [{setup_cell_extra()}] extra"
            )
        elif dist not in installed:
            problems.append(
                f"{module} (distribution {dist}): not installed by the setup cell; add "
                f"it to pyproject.toml's [{setup_cell_extra()}] extra"
            )
    return problems


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_the_setup_cell_installs_what_the_chapter_imports(path):
    problems = []
    for i, cell in enumerate(cells(path)):
        if cell["cell_type"] != "code":
            continue
        for problem in missing_from_setup(path.name, "".join(cell["source"])):
            problems.append(f"{path.name}, cell {cell.get('id', i)}: {problem}")
    assert not problems, "\n".join(problems)


def test_the_import_check_sees_what_the_setup_cell_lacks():
    "The check above would fail: on an unknown module, on an import via the library"
    assert (
        missing_from_setup("x.ipynb", "import os\nimport torch\n%matplotlib inline")
        == []
    )
    (unknown,) = missing_from_setup("x.ipynb", "from scipy import stats")
    assert unknown.startswith("scipy: not in")
    (on_request,) = missing_from_setup("x.ipynb", "import datasets")
    assert on_request.startswith("datasets")  # on request in chapter 12's cell only
    assert "gradio" in third_party({"paligemma_lib.app"})
    assert "gradio" in third_party(imported_modules("from paligemma_lib import app"))


# tools/run_book.py, on tiny notebooks (the book itself takes an hour)
def write_notebook(path: Path, *sources: str) -> None:
    stem = path.stem.split("_")[0]
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": f"c{stem}{i}",
                "metadata": {},
                "outputs": [],
                "source": source,
            }
            for i, source in enumerate(sources)
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1))


def test_run_book_records_each_chapter(tmp_path):
    book = tmp_path / "book"
    book.mkdir()
    hidden = "import os\nassert os.environ['CUDA_VISIBLE_DEVICES'] == ''"
    write_notebook(book / "01_passes.ipynb", hidden, "x = 1")
    write_notebook(book / "02_fails.ipynb", "x = 1", "raise ValueError('boom')")
    write_notebook(book / "03_hangs.ipynb", "y = 2", "import time\ntime.sleep(600)")
    write_notebook(book / "04_left_out.ipynb", "raise SystemExit")
    output = tmp_path / "out" / "book.json"
    arguments = ["01", "02", "03", "--device", "cpu", "--book", str(book)]
    status = run_book.main([*arguments, "--output", str(output), "--timeout", "40"])
    assert status == 1  # a chapter failed
    record = json.loads(output.read_text())
    assert record["passed"] is False
    assert record["environment"]["device"] == "cpu"
    assert record["environment"]["versions"]["torch"]
    rows = {row["chapter"]: row for row in record["chapters"]}
    assert list(rows) == ["01_passes.ipynb", "02_fails.ipynb", "03_hangs.ipynb"]
    assert (
        rows["01_passes.ipynb"]["passed"] and rows["01_passes.ipynb"]["error"] is None
    )
    assert rows["02_fails.ipynb"]["failed_cell"] == "c021"
    assert rows["02_fails.ipynb"]["error"] == "ValueError: boom"
    assert rows["03_hangs.ipynb"]["failed_cell"] == "c031"
    assert rows["03_hangs.ipynb"]["error"] == "timed out after 40 s"
    assert rows["03_hangs.ipynb"]["seconds"] >= 40
    assert all(row["seconds"] > 0 for row in rows.values())


def test_run_book_arguments(tmp_path, capsys):
    for wrong in (["--device", "tpu"], [], ["--device", "cpu", "--timeout", "0"]):
        with pytest.raises(SystemExit) as e:
            run_book.parse(wrong)
        assert e.value.code == 2, wrong  # argparse's usage error
    assert "--device" in capsys.readouterr().err
    book = tmp_path / "book"
    book.mkdir()
    with pytest.raises(SystemExit, match="no chapters"):
        run_book.chapters(book, [])
    for name in ["01_a.ipynb", "02_b.ipynb", "11b_c.ipynb"]:
        write_notebook(book / name, "x = 1")
    names = [p.name for p in run_book.chapters(book, ["11b", "01"])]
    assert names == ["01_a.ipynb", "11b_c.ipynb"]  # in the book's order
    with pytest.raises(SystemExit, match="no chapter starts with 07"):
        run_book.chapters(book, ["07"])
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="sees no CUDA GPU"):
            run_book.main(["--device", "cuda", "--book", str(book)])


def test_open_code_cells_are_short():
    """Issue 42: a reader sees each idea in a few lines. Of the code cells the book
    shows open, at most 10% run past 30 lines and none past 60 (plumbing is folded:
    tools/cell_lengths.py lists the long ones)"""
    import cell_lengths

    lengths = {
        (path.name, i): n for path in CHAPTERS for i, n in cell_lengths.open_cells(path)
    }
    too_long = {cell: n for cell, n in lengths.items() if n > cell_lengths.TOO_LONG}
    assert not too_long, f"open cells past {cell_lengths.TOO_LONG} lines: {too_long}"
    long = sum(n > cell_lengths.LONG for n in lengths.values())
    assert long <= 0.10 * len(lengths), f"{long} of {len(lengths)} past 30 lines"


def test_a_folded_cell_says_what_it_holds():
    "A folded code cell's button names what the fold holds, not 'Show code cell source'"
    for path in CHAPTERS:
        for i, cell in enumerate(cells(path)):
            meta = cell.get("metadata", {})
            if cell["cell_type"] != "code" or "hide-input" not in meta.get("tags", []):
                continue
            caption = meta.get("mystnb", {}).get("code_prompt_show", "")
            assert caption.startswith("Show ") and len(caption) > 12, (path.name, i)
