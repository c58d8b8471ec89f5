"""Write the appendix's API reference, book/a3_api_reference.md (A.3).

Each module of paligemma_lib gets its heading, the chapters that teach it (the
notebooks that export to it, read from their `#| default_exp` and `#| export`
lines), its docstring once, as prose, and its public names: those of its
`__all__` (or, without one, those without a leading underscore), written from
their docstrings by Sphinx's autodoc when the book is built
(_ext/plain_docstrings.py turns the plain-text docstrings into prose).

    python tools/api_reference.py            # write the page
    python tools/api_reference.py --check    # fail if the page is not what it writes
"""

import argparse
import importlib
import inspect
import json
import pkgutil
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "a3_api_reference.md"
sys.path.insert(0, str(ROOT / "_ext"))
from plain_docstrings import to_rst  # noqa: E402

# the modules in the order a reader meets them, with a line for those whose
# docstring says only where they were exported from
MODULES = {
    "config": "The model's sizes: the vision tower's, the decoder's, PaliGemma's.",
    "image_processing": "",
    "siglip": "The SigLIP vision tower: patches, attention, the encoder.",
    "gemma": "",
    "input_checks": "",
    "tokenization": "",
    "processing": "",
    "model_files": "",
    "boxes": "",
    "paligemma": "",
    "kv_cache": "Key-value caches: one that grows, one preallocated.",
    "devices": "",
    "sampling": "",
    "decoding_linear": "",
    "stopping": "",
    "threads": "",
    "generation": "",
    "quantize": "",
    "weights": "",
    "lora": "LoRA: the adapter layer; adding, merging and unmerging adapters; "
    "the memory of fine-tuning.",
    "adapters": "Saving and loading LoRA adapters in PEFT's format.",
    "trainable_tokens": "Trained rows of the token table next to a LoRA adapter "
    "(PEFT's `trainable_token_indices`).",
    "data": "The synthetic worlds: shapes, OCR and receipts, their tasks and "
    "their batches.",
    "train": "",
    "batching": "",
    "optimization": "",
    "resume": "",
    "evaluation": "",
    "sharding": "",
    "training_run": "",
    "finetune": "",
    "segmentation": "",
    "mask_vae_training": "",
    "segment_eval": "",
    "segment_recipes": "",
    "segment_batches": "",
    "real_images": "",
    "real_recipes": "",
    "resolution": "",
    "small_detail": "",
    "demo": "The demo's functions: prompts, answers, boxes, receipts, masks, "
    "attention maps and the checks of their inputs.",
    "app": "",
    "show": "",
}
# modules no notebook exports, and the chapter that shows them
WRITTEN_BY_HAND = {"app": ["13_demo"], "show": []}
# a module without `__all__` whose other functions are its own plumbing: the
# names its docstring offers a user
MEMBERS = {"app": "build_app, launch"}
# the docstring nbdev gives a module whose notebooks say nothing of it
NBDEV = "Exported from the chapters of the book"

INTRO = """\
# API reference

Every public name of `paligemma_lib`, module by module, in the order the book
teaches them: under each module's name, the chapters that explain it, what the
module is for, then its functions and classes with their docstrings. The
top-level package re-exports the names a user needs most: `load_pretrained`,
`save_pretrained`, `PaliGemmaProcessor`, `answer`, `generate`, `load_image`,
`draw_boxes`, `parse_segments`, `draw_segments`. This page is written by
`tools/api_reference.py`; the names and their docstrings come from the code
when the book is built.
"""


def chapters() -> dict[str, list[str]]:
    "module -> the notebooks (book/NAME.ipynb, without the suffix) that export to it"
    found = {}
    for notebook in sorted((ROOT / "book").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        default = None
        for cell in cells:
            if cell["cell_type"] != "code":
                continue
            for line in "".join(cell["source"]).splitlines():
                if m := re.match(r"#\|\s*default_exp\s+(\w+)", line):
                    default = m.group(1)
                elif m := re.match(r"#\|\s*export(?:\s+(\w+))?\s*$", line):
                    module = m.group(1) or default
                    found.setdefault(module, [])
                    if notebook.stem not in found[module]:
                        found[module].append(notebook.stem)
    return found


def title(stem: str) -> str:
    "A chapter's title: the first heading of its notebook"
    cells = json.loads((ROOT / "book" / f"{stem}.ipynb").read_text())["cells"]
    for cell in cells:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    raise ValueError(f"book/{stem}.ipynb has no title")


def section(name: str, taught: list[str]) -> str:
    module = importlib.import_module(f"paligemma_lib.{name}")
    doc = (module.__doc__ or "").strip()
    if not doc or doc.startswith(NBDEV):
        doc = MODULES[name]
    assert doc, f"paligemma_lib.{name}: no docstring and no line in MODULES"
    links = ", ".join(f"[{title(stem)}]({stem}.ipynb)" for stem in taught)
    lines = [f"## `paligemma_lib.{name}`", ""]
    if links:
        lines += [f"Taught in {links}.", ""]
    # the docstring's lines after the first keep their indents in the source
    first, *rest = doc.splitlines()
    body = [first, *inspect.cleandoc("\n".join(rest)).splitlines()] if rest else [first]
    rst = "\n".join(to_rst(body)).strip()
    lines += ["```{eval-rst}", rst, "", f".. automodule:: paligemma_lib.{name}"]
    members = MEMBERS.get(name, "")
    lines += [f"   :members: {members}".rstrip(), "```", ""]
    return "\n".join(lines)


def page() -> str:
    import paligemma_lib

    modules = {
        m.name for m in pkgutil.iter_modules(paligemma_lib.__path__) if not m.ispkg
    }
    public = {m for m in modules if not m.startswith("_")}
    missing = public - set(MODULES)
    assert not missing, f"modules missing from tools/api_reference.py: {missing}"
    taught = chapters()
    parts = [INTRO]
    for name in MODULES:
        parts.append(section(name, taught.get(name) or WRITTEN_BY_HAND.get(name, [])))
    return "\n".join(parts).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    text = page()
    if args.check:
        if PAGE.read_text() != text:
            sys.exit(f"{PAGE} is stale: run python tools/api_reference.py")
        print(f"{PAGE.relative_to(ROOT)} is up to date")
        return
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
