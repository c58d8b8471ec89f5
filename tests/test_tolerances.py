"""Every tolerance in the chapters and the tests is explicit where needed, and says why.

Two static rules over every code cell of book/*.ipynb and every tests/*.py:

1. A comparison (`assert_close`, `allclose`, `isclose`, `assert_allclose`) with a
   Python float taken from a tensor among the values it compares (`.item()`,
   `float(...)`) passes its tolerance explicitly. A Python float is a float64 to
   `torch.testing.assert_close`, so between two Python floats it gets float64's
   tolerance (1e-7 relative and absolute), and `math.isclose` gets 1e-9: a float32
   result (`x.item()`) against a float64 reference then fails on a machine that
   rounds differently. Compute the reference in float64, cast it to float32, and
   compare tensors at float32's tolerance, or state the tolerance.
2. Every explicit tolerance (`rtol=`, `atol=`, `rel_tol=`, `abs_tol=`, `tolerance=`,
   `tol=`, `pytest.approx(rel=, abs=)`, or a name such as `tol = 1e-4`) whose value
   holds a number has a comment giving its reason: on its own line, on the
   statement's lines up to it, or in the block of comment lines just above the
   statement. `#|` directives and `# noqa` do not count.
"""

import ast
import io
import json
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPARISONS = {"assert_close", "allclose", "isclose", "assert_allclose"}
TOLERANCE_KEYWORDS = {"rtol", "atol", "rel_tol", "abs_tol", "tolerance", "tol"}
APPROX_KEYWORDS = {"rel", "abs"}  # pytest.approx
TOLERANCE_NAME = re.compile(r"(^|_)(r|a|rel_|abs_)?tol(erance)?s?($|_)", re.I)


def sources() -> list[tuple[str, str]]:
    "(where, source): one per code cell of each chapter, one per test file"
    found = []
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
            if cell["cell_type"] == "code":
                where = f"{path.relative_to(ROOT)} cell {cell.get('id', i)}"
                found.append((where, "".join(cell["source"])))
    for path in sorted((ROOT / "tests").glob("*.py")):
        found.append((str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")))
    return found


def without_magics(source: str) -> str:
    "IPython's %magics and !shell lines become blank lines (line numbers kept)"
    return "\n".join(
        "" if line.lstrip().startswith(("%", "!")) else line
        for line in source.splitlines()
    )


def comment_lines(source: str) -> set[int]:
    "Line numbers (1-based) holding a comment that can give a reason"
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string
            if text.startswith("#|") or re.match(r"#\s*noqa\b", text):
                continue
            lines.add(token.start[0])
    return lines


def call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def python_float(node: ast.AST) -> str | None:
    """What makes `node` a Python float taken from a tensor, if anything does. A float
    literal alone does not: Python arithmetic on literals is float64 on both sides"""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            if isinstance(sub.func, ast.Attribute) and sub.func.attr == "item":
                return ".item()"
            if isinstance(sub.func, ast.Name) and sub.func.id == "float":
                return "float(...)"
    return None


def holds_number(node: ast.AST) -> bool:
    return any(
        isinstance(sub, ast.Constant)
        and isinstance(sub.value, int | float)
        and not isinstance(sub.value, bool)
        for sub in ast.walk(node)
    )


def statements_of(tree: ast.AST) -> dict[int, ast.stmt]:
    "id(node) -> the innermost statement holding it"
    owner = {}

    def visit(node, stmt):
        for child in ast.iter_child_nodes(node):
            here = child if isinstance(child, ast.stmt) else stmt
            owner[id(child)] = here
            visit(child, here)

    visit(tree, None)
    return owner


def violations(where: str, source: str) -> list[str]:
    source = without_magics(source)
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return [f"{where}: does not parse ({e})"]
    comments = comment_lines(source)
    owner = statements_of(tree)
    found = []

    lines = source.splitlines()

    def has_reason(node: ast.AST) -> bool:
        stmt = owner.get(id(node))
        first = stmt.lineno if stmt is not None else node.lineno
        while first > 1 and lines[first - 2].lstrip().startswith("#"):
            first -= 1  # the comment block just above the statement
        return any(first <= n <= node.end_lineno for n in comments)

    def line(node) -> str:
        return lines[node.lineno - 1].strip()

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = call_name(node)
            keywords = {k.arg for k in node.keywords}
            if name in COMPARISONS:
                compared = [*node.args[:2]] + [
                    k.value for k in node.keywords if k.arg in {"actual", "expected"}
                ]
                why = next(filter(None, map(python_float, compared)), None)
                explicit = keywords & TOLERANCE_KEYWORDS
                if why and not explicit:
                    found.append(
                        (
                            node.lineno,
                            f"{where}, line {node.lineno}: {name}() compares a Python "
                            f"float ({why}) at the default (float64) tolerance; give "
                            f"rtol/atol and their reason: {line(node)}",
                        )
                    )
            wanted = TOLERANCE_KEYWORDS | (
                APPROX_KEYWORDS if name == "approx" else set()
            )
            for k in node.keywords:
                if (
                    k.arg in wanted
                    and holds_number(k.value)
                    and not has_reason(k.value)
                ):
                    found.append(
                        (
                            k.value.lineno,
                            f"{where}, line {k.value.lineno}: {k.arg}= "
                            f"has no comment giving its reason: {line(k.value)}",
                        )
                    )
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            tolerance = [n for n in names if TOLERANCE_NAME.search(n)]
            if tolerance and node.value is not None and holds_number(node.value):
                if not has_reason(node):
                    found.append(
                        (
                            node.lineno,
                            f"{where}, line {node.lineno}: the tolerance "
                            f"{tolerance[0]} has no comment giving its reason: "
                            f"{line(node)}",
                        )
                    )
    return [message for _, message in sorted(found)]


SOURCES = sources()


@pytest.mark.parametrize("where,source", SOURCES, ids=[where for where, _ in SOURCES])
def test_tolerances_are_explicit_and_explained(where, source):
    found = violations(where, source)
    assert not found, "\n".join(found)


# The rules themselves, on small sources: what they flag and what they leave alone.
GOOD = """
ref = float(math.exp(2.0))  # float64
assert_close(loss, torch.tensor(ref, dtype=torch.float32))
assert_close(ours, theirs)
# float32, 256 products in a sum: a few float32 epsilons
torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
assert math.isclose(total.item(), 3.0, rel_tol=1e-6)  # float32's epsilon x 8 steps
assert torch.allclose(
    a,
    b,
    atol=1e-6,  # one float32 rounding of values below 8
)
tol = 4 * torch.finfo(torch.bfloat16).eps  # four bf16 roundings
assert_close(x, y, atol=tol, rtol=0)  # the reason is at tol
assert math.isclose(schedule[10], 0.5)  # Python floats (float64) on both sides
"""

BAD = """
torch.testing.assert_close(loss.item(), reference)  # a comment, but no tolerance
assert math.isclose(float(y), 2.5)
assert torch.allclose(a, b, atol=1e-3)
#| export
x = torch.isclose(a, b, rtol=1e-4)
tolerance = 1e-3
"""


def test_the_rules_leave_correct_code_alone():
    assert violations("good", GOOD) == []


def test_the_rules_flag_each_kind_of_violation():
    found = violations("bad", BAD)
    assert len(found) == 5, "\n".join(found)
    assert "line 2: assert_close() compares a Python float (.item())" in found[0]
    assert "line 3: isclose() compares a Python float (float(...))" in found[1]
    assert "line 4: atol= has no comment" in found[2]
    assert "line 6: rtol= has no comment" in found[3]  # a directive is no reason
    assert "line 7: the tolerance tolerance has no comment" in found[4]
