"""The library's module graph (issue 30): every import between paligemma_lib's
modules, at the top or inside a function, read from the source; no cycle."""

import ast
from pathlib import Path

from paligemma_lib.lora import DEFAULT_TARGETS
from paligemma_lib.quantize import DECODER_LINEARS

PACKAGE = Path(__file__).resolve().parents[1] / "paligemma_lib"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    "The paligemma_lib modules `path` imports, wherever the import statement is"
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the package a relative import starts from
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            # `from . import data` names a module too
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name.startswith("paligemma_lib.")}
    return found


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in imports(path) if m in paths and m != name}
        for name, path in paths.items()
    }


def test_the_module_graph_has_no_cycle():
    edges = graph()
    done, path = set(), []

    def visit(name):
        if name in path:
            cycle = path[path.index(name) :] + [name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        path.append(name)
        for imported in sorted(edges[name]):
            visit(imported)
        path.pop()
        done.add(name)

    for name in sorted(edges):
        visit(name)
    # the graph is read
    assert "paligemma_lib.weights" in edges["paligemma_lib.adapters"]


def test_int8_and_lora_name_the_same_decoder_projections():
    "Chapter 8.1 spells the names itself (it comes before chapter 10's LoRA)"
    assert DECODER_LINEARS == tuple(DEFAULT_TARGETS)


MODULE_LINES, FUNCTION_LINES, COMMAND_LINES = 600, 100, 300


def test_modules_and_functions_are_short():
    """Issue 30: no module over 600 lines (nbdev's index `_modidx.py` is data),
    no command module over 300, no function or method over 100"""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_modidx.py":
            continue
        text = path.read_text()
        where = path.relative_to(PACKAGE.parent)
        limit = COMMAND_LINES if path.parent.name == "cli" else MODULE_LINES
        if len(text.splitlines()) > limit:
            too_long.append(f"{where}: {len(text.splitlines())} lines > {limit}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    too_long.append(f"{where}: {node.name} {lines} lines")
    assert not too_long, "\n".join(too_long)
    assert len(list(PACKAGE.rglob("*.py"))) > 20  # the files are read
