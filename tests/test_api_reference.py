"""A.3, the API reference, is what tools/api_reference.py writes from the library as
exported: a docstring changed in a chapter changes the page (issue 42)."""

import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import api_reference  # noqa: E402

import paligemma_lib  # noqa: E402


def test_the_api_page_is_up_to_date():
    assert api_reference.PAGE.read_text() == api_reference.page(), (
        "book/a3_api_reference.md is out of date: python tools/api_reference.py"
    )


def test_every_public_module_has_its_place():
    modules = {m.name for m in pkgutil.iter_modules(paligemma_lib.__path__)}
    public = {m for m in modules if not m.startswith("_")}
    missing = public - set(api_reference.MODULES) - {"__main__", "cli"}
    assert not missing, f"modules A.3 leaves out: {sorted(missing)}"
