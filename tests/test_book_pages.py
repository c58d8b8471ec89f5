"""The rendered book in the system Chromium, after `jupyter-book build --all -W .`:
every chapter's page loads with no broken image, its maths rendered as SVG, no
traceback in a cell's output, no code block wider than its column, and none of the
notebook's noise (issue 29): no stderr box (progress bars, warnings), no path of the
machine that built it, no object repr, no nbdev `#| default_exp` cell. One screenshot
per chapter, in _build/screenshots/. Run by .ci/run after the build: pytest -m book."""

from pathlib import Path

import pytest
import yaml
from browser import ROOT, SCREENSHOTS, block_outside, chromium

pytestmark = pytest.mark.book
HTML = ROOT / "_build" / "html"


def chapters() -> list[str]:
    "Every page of _toc.yml, in order: book/00_intro, book/01_images_to_patches, ..."
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = [toc["root"]]

    def walk(entries):
        for entry in entries:
            pages.append(entry["file"])
            walk(entry.get("sections", []))

    walk(toc["chapters"])
    return pages


@pytest.fixture(scope="module")
def browser():
    if not (HTML / "index.html").is_file():
        pytest.fail("no built book: run jupyter-book build --all -W . first")
    executable = chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable)
        yield browser
        browser.close()


# JavaScript run in each page. MathJax typesets after the page loads: wait for it.
TYPESET = "async () => { if (window.MathJax) await MathJax.startup.promise; }"
BROKEN_IMAGES = """() => [...document.images]
    .filter(img => !img.complete || img.naturalWidth === 0)
    .map(img => img.getAttribute('src'))"""
UNRENDERED_MATHS = """() => [...document.querySelectorAll('.math')]
    .filter(el => !el.querySelector('mjx-container svg'))
    .map(el => el.textContent.slice(0, 60))"""
# text of the article outside code and rendered maths, where a raw $...$ would show
PROSE = """() => {
    const article = document.querySelector('article') || document.body;
    const copy = article.cloneNode(true);
    copy.querySelectorAll('pre, code, mjx-container, script, .math')
        .forEach(el => el.remove());
    return copy.innerText;
}"""
OUTPUTS = """() => [...document.querySelectorAll('.cell_output')]
    .map(el => el.innerText)"""
STDERR = """() => [...document.querySelectorAll('.cell_output .stderr, .output.stderr')]
    .map(el => el.innerText.slice(0, 200))"""
ARTICLE = "() => (document.querySelector('article') || document.body).innerText"
# in an output: a temporary folder, the checkout that built the book, an object's repr
MACHINE = ("/tmp/", str(ROOT), " at 0x", "ipykernel_")
WIDE_CODE = """() => [...document.querySelectorAll('div.highlight pre')]
    .filter(pre => !pre.closest('.cell_output') && pre.clientWidth > 0)
    .filter(pre => pre.scrollWidth > pre.clientWidth + 1)
    .map(pre => pre.innerText.split('\\n')
        .reduce((a, b) => (a.length > b.length ? a : b)))"""


@pytest.mark.parametrize("chapter", chapters(), ids=lambda c: Path(c).name)
def test_chapter_page(browser, chapter):
    path = HTML / f"{chapter}.html"
    assert path.is_file(), f"{path} was not built"
    # 1440 px, a laptop's width: the column holds the book's 88-character code lines
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    outside = block_outside(page, ("file://", "data:"))
    page.goto(path.as_uri())
    page.evaluate(TYPESET)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"book_{Path(chapter).name}.png")

    assert page.evaluate(BROKEN_IMAGES) == [], "images that did not load"
    assert page.evaluate(UNRENDERED_MATHS) == [], "maths not rendered as SVG"
    prose = page.evaluate(PROSE)
    for raw in ("$$", "\\(", "\\["):
        assert raw not in prose, f"raw maths {raw!r} left in the text"
    for output in page.evaluate(OUTPUTS):
        assert "Traceback (most recent call last)" not in output, output[-500:]
        for trace in MACHINE:
            assert trace not in output, f"{trace!r} in an output: {output[:300]}"
    assert page.evaluate(STDERR) == [], "stderr boxes (warnings, progress bars)"
    assert "#| default_exp" not in page.evaluate(ARTICLE), "nbdev's cell shown"
    assert page.evaluate(WIDE_CODE) == [], "code lines wider than the column"
    assert outside == [], f"the page asked the network for {outside}"
    page.close()
