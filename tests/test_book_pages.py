"""The rendered book in the system Chromium, after `jupyter-book build --all -W .`:
every chapter's page loads with no broken image, its maths rendered as SVG, no
traceback in a cell's output, and what a reader sees (issue 29): at 1280 px no code
or output box wider than its column and no figure shown below 0.7 of its natural
width; at 390 px (a phone) no page wider than the window; at both widths no word
or number of a table cell broken over two lines, and no JavaScript error on load;
on a phone, the menu button opens the chapter list (issue 42); none of the notebook's
noise: no stderr box (progress bars, warnings), no path of the machine that built
it, no object repr, no nbdev `#| default_exp` cell. Screenshots of every page at
both widths, in _build/screenshots/. Run by .ci/run after the build: pytest -m book."""

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
# code and output boxes that scroll sideways: their longest line
WIDE_BOXES = """() => [...document.querySelectorAll('article pre')]
    .filter(pre => pre.clientWidth > 0)
    .filter(pre => pre.scrollWidth > pre.clientWidth + 1)
    .map(pre => pre.innerText.split('\\n')
        .reduce((a, b) => (a.length > b.length ? a : b)))"""
# figures shown below 0.7 of their natural width: their text shrinks with them
SHRUNK_IMAGES = """() => [...document.querySelectorAll('article img')]
    .filter(img => img.naturalWidth > 0 && img.clientWidth > 0)
    .filter(img => img.clientWidth < 0.7 * img.naturalWidth)
    .map(img => `${img.getAttribute('src').slice(-60)}: ${img.naturalWidth} px `
        + `shown at ${img.clientWidth}`)"""
# the search fields and buttons a reader sees: one, the sidebar's (or the
# header's button on a phone, where the sidebar is folded)
SEARCH_BOXES = """() => [...document.querySelectorAll(
        '.search-button-field, .search-button')]
    .filter(el => el.getBoundingClientRect().width > 0).length"""
# at a phone's width: the page itself must not scroll sideways
PAGE_WIDTH = "() => document.documentElement.scrollWidth"
# the words of table cells broken over two lines: each whitespace-separated
# word of a cell's text must lie on one line ("PaliGemma-3B" may break after
# its hyphen, as prose does; a number such as -0.5 or 2024-03-15 may not)
BROKEN_WORDS = """() => {
    const broken = [];
    const words = /\\S+?((?<=[A-Za-z])-(?=\\S)|$|(?=\\s))/g;
    for (const cell of document.querySelectorAll('article td, article th')) {
        if (cell.getClientRects().length === 0) continue;
        const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            for (const match of node.data.matchAll(words)) {
                if (!match[0]) continue;
                const range = document.createRange();
                range.setStart(node, match.index);
                range.setEnd(node, match.index + match[0].length);
                const tops = [...range.getClientRects()]
                    .filter(rect => rect.width > 0)
                    .map(rect => rect.top);
                if (tops.length && Math.max(...tops) - Math.min(...tops) > 4)
                    broken.push(`${match[0]} (in: ${cell.innerText.slice(0, 60)})`);
            }
        }
    }
    return broken;
}"""
WIDEST = """() => [...document.querySelectorAll('article *')]
    .filter(el => el.getBoundingClientRect().right > window.innerWidth + 1)
    .filter(el => !el.closest('pre, .highlight, .cell_output, mjx-container'))
    .slice(0, 5).map(el => el.tagName + ': ' + el.textContent.slice(0, 60))"""


@pytest.mark.parametrize("chapter", chapters(), ids=lambda c: Path(c).name)
def test_chapter_page(browser, chapter):
    path = HTML / f"{chapter}.html"
    assert path.is_file(), f"{path} was not built"
    # 1280 px, a laptop's width: the column holds the book's 79-character code
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    outside = block_outside(page, ("file://", "data:"))
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
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
    assert page.evaluate(WIDE_BOXES) == [], "code or output wider than its box"
    assert page.evaluate(SHRUNK_IMAGES) == [], "figures shrunk below 0.7"
    assert page.evaluate(SEARCH_BOXES) == 1, "one search box"
    assert page.evaluate(BROKEN_WORDS) == [], "table cells that break a word"
    assert outside == [], f"the page asked the network for {outside}"
    assert errors == [], "JavaScript errors on load"
    page.close()


@pytest.mark.parametrize("chapter", chapters(), ids=lambda c: Path(c).name)
def test_chapter_page_on_a_phone(browser, chapter):
    "At 390 px, a phone's width, the page is no wider than the window"
    page = browser.new_page(viewport={"width": 390, "height": 844})
    outside = block_outside(page, ("file://", "data:"))
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto((HTML / f"{chapter}.html").as_uri())
    page.evaluate(TYPESET)
    page.screenshot(path=SCREENSHOTS / f"phone_{Path(chapter).name}.png")
    width = page.evaluate(PAGE_WIDTH)
    assert width <= 390, f"{width} px wide: {page.evaluate(WIDEST)}"
    assert page.evaluate(SEARCH_BOXES) == 1, "one search button"
    assert page.evaluate(BROKEN_WORDS) == [], "table cells that break a word"
    # the menu: the button a reader sees opens the chapter list, whose links
    # can be clicked (trial: every check of a click, without the click)
    menu = open_menu(page)
    menu.locator("a.reference.internal").first.click(trial=True, timeout=2000)
    assert outside == [], f"the page asked the network for {outside}"
    assert errors == [], "JavaScript errors on load"
    page.close()


def open_menu(page):
    "Press the phone's menu button; the chapter list it opened"
    button = page.locator(".bd-header-article .primary-toggle")
    assert button.is_visible(), "no menu button in the article's header"
    button.click()
    menu = page.locator("#pst-primary-sidebar-modal")
    menu.wait_for(state="visible", timeout=2000)
    return menu


def test_menu_on_a_phone(browser):
    "At 390 px the menu opens the chapter list and a chapter link in it works"
    page = browser.new_page(viewport={"width": 390, "height": 844})
    block_outside(page, ("file://", "data:"))
    page.goto((HTML / "book" / "05_gemma_decoder.html").as_uri())
    menu = open_menu(page)
    page.screenshot(path=SCREENSHOTS / "phone_menu.png")
    links = menu.locator("nav a.reference.internal")
    assert links.count() >= len(chapters()) - 1, "the chapter list is incomplete"
    chapter = menu.locator('a.reference[href$="08_kv_cache_and_generation.html"]')
    assert chapter.is_visible(), "chapter 8's link is not visible in the menu"
    chapter.click()
    page.wait_for_url("**/08_kv_cache_and_generation.html")
    assert page.locator("article h1").first.is_visible()
    # and the page's own contents, behind the button at the right
    page.locator(".bd-header-article .secondary-toggle").click()
    contents = page.locator("#pst-secondary-sidebar-modal")
    contents.wait_for(state="visible", timeout=2000)
    assert contents.locator("a").first.is_visible(), "the page's contents are empty"
    page.close()
