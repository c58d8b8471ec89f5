"""Sphinx extension for the appendix's API reference (A.3, written by
tools/api_reference.py): our docstrings are plain text, not reStructuredText.
Autodoc would read their asterisks, underscores and indents as markup; shown in
a literal block they were highlighted as Python ("for" and "or" coloured). Here
each docstring becomes prose: its paragraphs as paragraphs, `name` as code, the
"name: what it is" lines of the arguments as a list, an indented example as
plain code. A module's own docstring is written once, by the page, above its
names; the methods PyTorch calls for the reader (`forward`, `extra_repr`) are
left out."""

import re

# "name: ...", "images, prompts: ...", "**kw: ...": a line that describes an argument
ITEM = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*(?:, \*{0,2}[A-Za-z_][\w.]*)*): (.*)$")
CODE = re.compile(r"`([^`]+)`")
# names a reader never calls: PyTorch calls them
HIDDEN = {"forward", "extra_repr"}


def inline(text: str) -> str:
    "Plain text as reST inline text: `name` as code, every other character as itself"

    def escape(plain: str) -> str:
        return re.sub(r"([\\*_|`\[\]<>:])", r"\\\1", plain)

    pieces, end = [], 0
    for match in CODE.finditer(text):
        pieces.append(escape(text[end : match.start()]))
        code = match.group(1).strip()
        pieces.append(rf"\ ``{code}``\ " if "``" not in code else escape(code))
        end = match.end()
    pieces.append(escape(text[end:]))
    out = "".join(pieces)
    # a paragraph that starts with "-", "1." or ".." is text, not a list or a comment
    return "\\" + out if out[:1] in "-+*#=.>0123456789" and out else out


def blocks(lines: list[str]) -> list[list[str]]:
    "The docstring's blocks, split at blank lines"
    found, block = [], []
    for line in lines:
        if line.strip():
            block.append(line.rstrip())
        elif block:
            found.append(block)
            block = []
    if block:
        found.append(block)
    return found


def block_to_rst(block: list[str]) -> list[str]:
    "One block of plain text as reST: code, a list of arguments, or a paragraph"
    if all(line.startswith(" ") for line in block):
        # an indented example: plain code, not highlighted as Python
        indent = min(len(line) - len(line.lstrip()) for line in block)
        return [".. code-block:: text", ""] + ["   " + line[indent:] for line in block]
    # items: a line at the left margin that names an argument starts one; an
    # indented line continues the item or paragraph above it, and so does a
    # line at the margin after an item's line that did not end its sentence
    parts = []  # (is_item, name, words)
    for line in block:
        match = ITEM.match(line)
        if match and not line.startswith(" "):
            parts.append((True, match.group(1), [match.group(2)]))
        elif (
            line.startswith(" ")
            or not parts
            or not parts[-1][0]
            or not parts[-1][2][-1].endswith(".")
        ):
            if not parts:
                parts.append((False, "", []))
            parts[-1][2].append(line.strip())
        else:
            parts.append((False, "", [line.strip()]))
    out = []
    for is_item, name, words in parts:
        text = inline(" ".join(words))
        if is_item:
            out += [f"- \\ ``{name}``: {text}"]
        else:
            out += ["", text, ""]
    return out


def to_rst(lines: list[str]) -> list[str]:
    "A plain-text docstring's lines as reST prose"
    out = []
    for block in blocks(lines):
        out += [""] + block_to_rst(block) + [""]
    # one blank line between blocks, and one after a list
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(out).strip("\n"))
    return text.split("\n") + [""]


def as_prose(app, what, name, obj, options, lines):
    if what == "module":
        # the page writes the module's docstring once, above its names
        lines[:] = []
        return
    if any(line.strip() for line in lines):
        lines[:] = to_rst(lines)


def skip_hidden(app, what, name, obj, skip, options):
    if name in HIDDEN or name.startswith("_"):
        return True
    return None


def one_of_each_script(app, pagename, templatename, context, doctree):
    """Every script once on a page. Sphinx-thebe adds its inline settings
    (`const THEBE_JS_URL = ...`) twice under Jupyter Book, once with the file
    name None and once with "" (Sphinx's registry and its builder each keep
    one), and a second `const` of the same name is a JavaScript error on every
    page ("Identifier 'THEBE_JS_URL' has already been declared")."""
    seen, scripts = set(), []
    for script in context.get("script_files", []):
        attributes = getattr(script, "attributes", {})
        name = str(getattr(script, "filename", script) or "")
        key = (name, *sorted(attributes.items()))
        if key not in seen:
            seen.add(key)
            scripts.append(script)
    context["script_files"] = scripts


def setup(app):
    app.connect("autodoc-process-docstring", as_prose)
    app.connect("autodoc-skip-member", skip_hidden)
    app.connect("html-page-context", one_of_each_script)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
