"""The setup cell that opens every chapter, and the command that writes it there.

Every chapter's first code cell is the same few lines: in Colab they install
`paligemma_lib` with the `chapters` extra from the repository named in
`_config.yml` (`repository.url`), keeping Colab's own torch; anywhere else they do
nothing. `tests/test_notebooks.py` checks every chapter against `setup_cell()`.

    python tools/setup_cell.py      # write the cell into every chapter of book/
"""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TEMPLATE = """\
# Setup. In Colab: install the book's library, paligemma_lib, with what the
# chapters use, keeping Colab's own torch. Anywhere else: nothing (see README).
import sys

if "google.colab" in sys.modules:
    import os
    import subprocess
    from importlib.metadata import version

    repo = "{url}"
    source = os.environ.get("PALIGEMMA_LIB_SOURCE", f"git+{{repo}}")
    keep = "/tmp/keep-torch.txt"
    with open(keep, "w") as f:  # never replace Colab's CUDA torch
        f.write(f"torch=={{version('torch')}}\\n")
    pip = [sys.executable, "-m", "pip", "install", "-q", "-c", keep]
    subprocess.run([*pip, f"paligemma_lib[chapters] @ {{source}}"], check=True)"""


def repository_url() -> str:
    "`repository.url` from _config.yml, the one place the book's home is written"
    config = (ROOT / "_config.yml").read_text(encoding="utf-8")
    match = re.search(r"^repository:\s*\n\s+url:\s*(\S+)", config, re.M)
    if match is None:
        raise ValueError("_config.yml has no repository.url")
    return match.group(1)


def setup_cell() -> str:
    return TEMPLATE.format(url=repository_url())


def chapters() -> list[Path]:
    return sorted((ROOT / "book").glob("[0-9][0-9]*_*.ipynb"))


def is_setup_cell(cell: dict) -> bool:
    "The setup cell, written by this or by an older template"
    first = "".join(cell["source"]).split("\n", 1)[0]
    return cell.get("id") == "setup" or first == TEMPLATE.split("\n", 1)[0]


def write(path: Path) -> None:
    "Put the title cell first and the setup cell second: the first code cell"
    nb = json.loads(path.read_text(encoding="utf-8"))
    source = setup_cell()
    # every setup cell goes, this one and those an older template wrote
    cells = [c for c in nb["cells"] if not is_setup_cell(c)]
    title = next(c for c in cells if c["cell_type"] == "markdown")
    cells.remove(title)
    cell = {
        "cell_type": "code",
        "execution_count": None,
        "id": "setup",
        "metadata": {  # folded in the rendered book, its button saying what it is
            "mystnb": {
                "code_prompt_show": "Show the setup (in Colab: installs the library)",
                "code_prompt_hide": "Hide the setup",
            },
            "tags": ["hide-input"],
        },
        "outputs": [],
        "source": source.splitlines(keepends=True),
    }
    nb["cells"] = [title, cell, *cells]
    text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    for path in chapters():
        write(path)
        print("setup cell written:", path.relative_to(ROOT))
