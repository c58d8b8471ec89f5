# Hand-written, not exported from a notebook.
"""How long the code cells a reader sees open are (issue 42), chapter by chapter.

    python tools/cell_lengths.py            # a table, then the totals
    python tools/cell_lengths.py 05 11b     # those chapters, each long cell listed

An open cell is a code cell the built book shows with its source: not tagged
hide-input, hide-cell, remove-input or remove-cell (a folded cell shows a button
with its caption, `metadata.mystnb.code_prompt_show`). Its length is its number of
source lines. The book's aim: at most 10% of open cells past 30 lines, none past 60.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = {"hide-input", "hide-cell", "remove-input", "remove-cell"}
LONG, TOO_LONG = 30, 60


def open_cells(path: Path) -> list[tuple[int, int]]:
    "(index, lines) of each open code cell of a notebook"
    cells = json.loads(path.read_text())["cells"]
    return [
        (i, len(c["source"]))
        for i, c in enumerate(cells)
        if c["cell_type"] == "code"
        and not HIDDEN & set(c.get("metadata", {}).get("tags", []))
    ]


def main(prefixes: list[str]) -> int:
    paths = sorted((ROOT / "book").glob("*.ipynb"))
    chosen = [p for p in paths if not prefixes or p.name.startswith(tuple(prefixes))]
    total = long = too_long = 0
    for path in chosen:
        cells = open_cells(path)
        n_long = sum(n > LONG for _, n in cells)
        n_too = sum(n > TOO_LONG for _, n in cells)
        total, long, too_long = total + len(cells), long + n_long, too_long + n_too
        print(
            f"{path.name:42} open {len(cells):3}  >{LONG} {n_long:3}  "
            f">{TOO_LONG} {n_too:3}"
        )
        if prefixes:
            for i, n in cells:
                if n > LONG:
                    print(f"    cell {i}: {n} lines")
    share = long / total if total else 0.0
    print(
        f"{'all':42} open {total:3}  >{LONG} {long:3} ({share:.0%})  "
        f">{TOO_LONG} {too_long:3}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
