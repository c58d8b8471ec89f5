"""Sphinx extension for the appendix's API reference: our docstrings are plain
text, not reStructuredText, so autodoc shows each one as written, in a literal
block, instead of parsing its indents and asterisks as markup."""


def as_literal_block(app, what, name, obj, options, lines):
    if not any(line.strip() for line in lines):
        return
    text = [f"    {line}" if line.strip() else "" for line in lines]
    lines[:] = ["::", "", *text, ""]


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
    app.connect("autodoc-process-docstring", as_literal_block)
    app.connect("html-page-context", one_of_each_script)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
