"""Sphinx extension for the appendix's API reference: our docstrings are plain
text, not reStructuredText, so autodoc shows each one as written, in a literal
block, instead of parsing its indents and asterisks as markup."""


def as_literal_block(app, what, name, obj, options, lines):
    if not any(line.strip() for line in lines):
        return
    text = [f"    {line}" if line.strip() else "" for line in lines]
    lines[:] = ["::", "", *text, ""]


def setup(app):
    app.connect("autodoc-process-docstring", as_literal_block)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
