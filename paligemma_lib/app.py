# Hand-written Gradio shell, not exported from a notebook: it lays out the page.
__doc__ = """The demo (chapter 13): `python -m paligemma_lib demo`, or from
Python

    from paligemma_lib.app import build_app, launch launch(build_app(model,
    processor, adapter="receipts"), port=7860)

The model logic (prompts, generation, boxes, receipts, masks, attention maps,
input checks) is in `paligemma_lib.demo`, exported from chapter 13; this file
only lays out the page, picks the adapter of each task and turns each error
into a message in it. Gradio is imported
here, and this module only when the demo starts (`pip install
"paligemma_lib[demo]"`)."""

import json
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio loads

import gradio as gr

from .adapters import load_adapter
from .boxes import draw_boxes
from .cli.options import DEFAULT_MAX_NEW_TOKENS
from .demo import (
    EXAMPLES,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    TASK_PROMPTS,
    adapter_disabled,
    answer_attention,
    example_image,
    examples_for,
    heatmap,
    open_upload,
    run_task,
    tasks_for,
)
from .lora import lora_modules
from .model_files import resolve_model_path
from .resolution import detail_note
from .segmentation import draw_segments

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
TASK_CHOICES = [
    ("caption", "caption"),
    ("question", "question"),
    ("detect", "detect"),
    ("OCR", "ocr"),
    ("receipt to JSON", "receipt"),
    ("segment", "segment"),
]
NO_ADAPTER = "none"
# The segment task's adapter (section 12.1), held beside the model (see
# detached_adapter) and swapped in for the runs that choose it
SEGMENT_ADAPTER = "segment"
NO_SEGMENT_ADAPTER = (
    "No 'segment' adapter is served (section 12.1 trains it; demo "
    "--segment-adapter DIR serves one): this is the model's answer without it"
)
# Requests that may wait for the model at once; more get "queue full" in the page at
# once instead of waiting minutes (each run holds the model for about a second)
MAX_QUEUE = 16
MEAN = "mean of all layers"
# Local fonts only: Gradio's default theme fetches its fonts from the web
THEME = gr.themes.Default(
    font=["ui-sans-serif", "system-ui", "sans-serif"],
    font_mono=["ui-monospace", "monospace"],
)
# The answer's box as tall as its answer at any width: Gradio sizes it when the
# answer arrives, not when the window narrows after (a phone turned upright), so
# a detect answer that wraps to two lines at 390 px showed one
CSS = "#answer textarea { field-sizing: content; height: auto !important; }"


def message(text: str) -> str:
    return f"**{text}**" if text else ""


def picture(label: str, elem_id: str, visible: bool = True) -> gr.Image:
    "An image the page shows (not an input): PIL in, PNG to the browser"
    return gr.Image(
        label=label,
        type="pil",
        interactive=False,
        format="png",
        visible=visible,
        elem_id=elem_id,
    )


def image_panel(examples: dict) -> SimpleNamespace:
    "Where the image comes from: an upload or a bundled example, and its preview"
    with gr.Column():
        upload = gr.File(label="Upload an image", elem_id="upload")
        example = gr.Radio(
            list(examples), label="or a bundled example", elem_id="examples"
        )
        preview = picture("Image", "preview")
    return SimpleNamespace(upload=upload, example=example, preview=preview)


def text_label(tasks) -> str:
    "The text box's label: what the tasks offered take as text"
    objects = " or ".join(task for task in ("detect", "segment") if task in tasks)
    wanted = ["question"] if "question" in tasks else []
    wanted += [f"the object to {objects}"] if objects else []
    return ", or ".join(wanted).capitalize() or "Text (no task offered takes any)"


def task_panel(
    adapter: str | None, segment: bool, tasks, first_adapter: str
) -> SimpleNamespace:
    """The task (of `tasks`, the first chosen), its text, the adapter switch (on
    `first_adapter`, the first task's), the generation settings and Run"""
    names = [NO_ADAPTER, *([adapter] if adapter else [])]
    names += [SEGMENT_ADAPTER] if segment and adapter != SEGMENT_ADAPTER else []
    choices = [(label, value) for label, value in TASK_CHOICES if value in tasks]
    with gr.Column():
        task = gr.Radio(choices, value=tasks[0], label="Task", elem_id="task")
        text = gr.Textbox(
            label=text_label(tasks),
            placeholder="what color is the square?",
            elem_id="text",
        )
        use_adapter = gr.Radio(
            names,
            value=first_adapter,
            label="LoRA adapter",
            visible=len(names) > 1,
            elem_id="adapter",
        )
        with gr.Accordion("Generation settings", open=False):
            settings = [  # in on_run's order
                gr.Radio(
                    ["greedy", "sampling"],
                    value="greedy",
                    label="Decoding",
                    elem_id="decoding",
                ),
                gr.Slider(0.05, 2.0, 1.0, label="Temperature"),
                gr.Number(0, precision=0, label="Top-k (0: all tokens)"),
                gr.Slider(0.05, 1.0, 1.0, label="Top-p (1: all tokens)"),
                gr.Number(0, precision=0, label="Seed"),
                gr.Slider(1, 128, DEFAULT_MAX_NEW_TOKENS, step=1, label="Max tokens"),
            ]
        run = gr.Button("Run", variant="primary", elem_id="run")
        status = gr.Markdown(elem_id="message")
    return SimpleNamespace(
        task=task,
        text=text,
        use_adapter=use_adapter,
        settings=settings,
        run=run,
        status=status,
    )


def answer_panel() -> SimpleNamespace:
    "The answer, its speed, its boxes or receipt"
    with gr.Column():
        answer = gr.Textbox(label="Answer", interactive=False, elem_id="answer")
        stats = gr.Markdown(elem_id="stats")
        boxes = picture("Boxes", "boxes", visible=False)
        receipt = gr.Code(
            label="Receipt",
            language="json",
            interactive=False,
            visible=False,
            elem_id="receipt",
        )
    return SimpleNamespace(answer=answer, stats=stats, boxes=boxes, receipt=receipt)


def attention_panel(layers: int) -> SimpleNamespace:
    "For a token of the answer and a layer, the image patches it attended to"
    with gr.Column():
        token = gr.Radio([], label="Attention of the answer token", elem_id="token")
        layer = gr.Radio(
            [MEAN, *map(str, range(layers))],
            value=MEAN,
            label="Layer (heads averaged)",
            elem_id="layer",
        )
        # short enough to fit beside the image's buttons at 390 px (a phone)
        attention = picture("Patches the token looked at", "heatmap")
    return SimpleNamespace(token=token, layer=layer, attention=attention)


def cleared() -> tuple:
    "A run's outputs, empty: answer, stats, boxes, receipt, tokens, maps, heat map"
    hidden = gr.update(value=None, visible=False)
    tokens = gr.update(choices=[], value=None)
    return "", "", hidden, hidden, tokens, None, None


def failed(text: str) -> tuple:
    "The outputs of a run that did not happen: empty, and a message"
    return *cleared(), message(text)


def sampling_settings(decode, temperature, top_k, top_p) -> dict:
    "The page's decoding settings as generate's keywords"
    sampling = {"do_sample": decode == "sampling"}
    if sampling["do_sample"]:
        sampling.update(
            temperature=float(temperature),
            top_k=int(top_k) if top_k else None,
            top_p=float(top_p) if top_p < 1 else None,
        )
    return sampling


def drawn_answer(image, chosen: str, result) -> tuple:
    "The image panel's update (boxes or masks drawn, or hidden) and its note"
    if chosen == "detect":
        drawn = draw_boxes(image, result.boxes)
        return gr.update(value=drawn, visible=True, label="Boxes"), ""
    if chosen != "segment":
        return gr.update(value=None, visible=False), ""
    drawn = draw_segments(image, result.segments)
    shown = gr.update(value=drawn, visible=True, label="Masks and boxes")
    if not any(s.valid for s in result.segments):
        return shown, "The answer holds no mask to draw"
    return shown, ""


def shown_result(
    image, chosen: str, result, maps, limit: int, note="", detail=None
) -> tuple:
    """What a finished run shows: the run's outputs (as `cleared`) and a message
    (`note`, or what the run says about its answer; then `detail`, what the
    model sees of the picture, chapter 11.4)"""
    tokens = [(f"{i}: {piece}", i) for i, piece in enumerate(result.pieces)]
    stats_text = (
        f"`{result.prompt}` -> {len(result.token_ids)} token(s) in "
        f"{result.seconds:.2f} s, {result.tokens_per_second:.1f} tokens/s"
    )
    boxes_update, drawn_note = drawn_answer(image, chosen, result)
    notes = [note or drawn_note]
    receipt_update = gr.update(value=None, visible=False)
    if chosen == "receipt":
        if result.receipt is not None:
            receipt_update = gr.update(
                value=json.dumps(result.receipt, indent=2), visible=True
            )
        else:
            notes = [result.receipt_error]
    if result.truncated:
        notes.insert(
            0,
            f"The answer stopped at the {limit}-token limit before its end "
            "(<eos>): it may be cut short. Raise Max tokens under Generation "
            "settings",
        )
    if detail:
        notes.append(detail[0].upper() + detail[1:])
    note = message(". ".join(filter(None, notes)))
    return (
        result.text,
        stats_text,
        boxes_update,
        receipt_update,
        gr.update(choices=tokens, value=0 if tokens else None),
        maps,
        None if maps is None else heatmap(image, maps[0].mean(0)),
        note,
    )


@contextmanager
def adapter_chosen(model, choice: str, served: str | None, segment: dict | None):
    """Inside the block the model computes with the adapter the page chose: the one
    it carries (`served`), none, or the segment adapter's layers swapped in"""
    if choice == served:
        yield model
        return
    with adapter_disabled(model):
        layers = segment if choice == SEGMENT_ADAPTER and segment else {}
        for name, lora in layers.items():
            model.set_submodule(name, lora)
        try:
            yield model
        finally:
            for name, lora in layers.items():
                model.set_submodule(name, lora.base_layer)


def detached_adapter(model, folder) -> dict:
    """The LoraLinear layers of the adapter in `folder`, each wrapping the model's
    own Linear, but left out of the model (adapter_chosen swaps them in): one
    model in memory serves several adapters"""
    with adapter_disabled(model):  # the served adapter out while this one loads
        load_adapter(model, folder)
        layers = lora_modules(model)
        for name, lora in layers.items():
            model.set_submodule(name, lora.base_layer)
    return layers


def page_handlers(model, processor, adapter: str | None, segment=None, examples=None):
    """The page's event handlers, bound to the one model every session shares;
    `segment`: the segment adapter's layers (detached_adapter), or None"""

    def on_upload(file, chosen):
        """A new image: the previous answer goes (it was about another image),
        the adapter is the task's, no example stays picked; a file that is not a
        readable image leaves its message for Run too"""
        if file is None:
            return None, None, "", *cleared(), on_task(chosen), "", None
        try:
            image = open_upload(file)
            return image, image, "", *cleared(), on_task(chosen), "", None
        except (ValueError, OSError) as e:
            status, adapter_now = message(str(e)), on_task(chosen)
            return None, None, status, *cleared(), adapter_now, str(e), None

    def on_example(name):
        if not name:  # the page's 7 outputs, all but the image left as they are
            return None, None, "", gr.update(), gr.update(), gr.update(), ""
        _, _, example_task, example_text = (examples or EXAMPLES)[name]
        image = example_image(name)
        adapter_now = on_task(example_task)
        return image, image, "", example_task, example_text, adapter_now, ""

    def on_task(chosen):
        "Each task's adapter: the served one for receipts, the segment one"
        if adapter and chosen == "receipt":
            return adapter
        if chosen == "segment" and (segment or adapter == SEGMENT_ADAPTER):
            return SEGMENT_ADAPTER
        return NO_ADAPTER

    def on_run(
        image, chosen, typed, adapter_choice, decode, temp, k, p, s, n, unread=""
    ):
        "`unread`: the message of the last upload, when it was not an image"
        if image is None and unread:
            return failed(
                f"No image to ask about: the upload was not a readable image "
                f"({unread}). Upload another image or pick an example"
            )
        if image is None:
            return failed("Upload an image or pick an example first")
        sampling = sampling_settings(decode, temp, k, p)
        no_segment = chosen == "segment" and on_task("segment") == NO_ADAPTER
        note = NO_SEGMENT_ADAPTER if no_segment else ""
        try:
            with adapter_chosen(model, adapter_choice, adapter, segment):
                result = run_task(
                    model,
                    processor,
                    image,
                    chosen,
                    typed,
                    max_new_tokens=int(n),
                    seed=int(s) if sampling["do_sample"] else None,
                    **sampling,
                )
                maps = (
                    answer_attention(
                        model, processor, image, result.prompt, result.token_ids
                    )
                    .mean(2)
                    .numpy()  # [T, L, side, side]
                    if result.token_ids
                    else None
                )
        except ValueError as e:
            return failed(str(e))
        except Exception as e:  # a bug: the page says so, the console has the trace
            traceback.print_exc()
            return failed(f"internal error ({type(e).__name__}: {e})")
        detail = detail_note(image.width, image.height, processor.image_size)
        return shown_result(image, chosen, result, maps, int(n), note, detail)

    def on_token(image, maps, index, which):
        if image is None or maps is None or index is None:
            return None
        grids = maps[int(index)]  # [L, side, side]
        grid = grids.mean(0) if which == MEAN else grids[int(which)]
        return heatmap(image, grid)

    return SimpleNamespace(
        on_upload=on_upload,
        on_example=on_example,
        on_task=on_task,
        on_run=on_run,
        on_token=on_token,
    )


def connect(source, controls, shown, looked, states, on):
    """Each control's event to its handler (`on`, from page_handlers); `states`:
    the image, the attention maps, the last failed upload's message"""
    image_state, maps_state, unread_state = states
    # One queue for the events that set the image and the run that reads it, so a
    # Run pressed right after picking an example waits for the example's image
    # (separate queues let the run read the image before it was set).
    # concurrency_limit=1 is also what makes the adapter switch safe: every
    # session shares this one model, and on_run's adapter_chosen swaps its
    # layers in place for the length of a run, so two runs at once, one with the
    # adapter and one without, would each compute with the other's layers. With
    # one run at a time across all sessions, none can see another's switch
    # (tests/test_app.py: test_concurrent_sessions_switching_adapters).
    serial = {"concurrency_id": "image", "concurrency_limit": 1}
    run_outputs = [
        *(shown.answer, shown.stats, shown.boxes, shown.receipt),
        *(looked.token, maps_state, looked.attention),
    ]
    status = controls.status
    source.upload.upload(
        on.on_upload,
        [source.upload, controls.task],
        [image_state, source.preview, status, *run_outputs, controls.use_adapter]
        + [unread_state, source.example],
        **serial,
    )
    example_outputs = [image_state, source.preview, status, controls.task]
    source.example.input(
        on.on_example,
        source.example,
        [*example_outputs, controls.text, controls.use_adapter, unread_state],
        **serial,
    )
    controls.task.input(on.on_task, controls.task, controls.use_adapter)
    run_inputs = [image_state, controls.task, controls.text, controls.use_adapter]
    controls.run.click(
        on.on_run,
        [*run_inputs, *controls.settings, unread_state],
        [*run_outputs, status],
        **serial,
    )
    for control in (looked.token, looked.layer):
        control.change(
            on.on_token,
            [image_state, maps_state, looked.token, looked.layer],
            looked.attention,
        )


def build_app(
    model,
    processor,
    adapter: str | None = None,
    segment: dict | None = None,
    examples: dict = EXAMPLES,
    tasks=tuple(TASK_PROMPTS),
) -> gr.Blocks:
    """The page. `model` may carry one LoRA adapter, named `adapter`; the page
    lets the user switch it (it follows the task: on for the receipt task, off
    for the others, the first task, caption, included).
    `segment`: the layers of a segment adapter (detached_adapter), on by default
    for the segment task. `examples`: the bundled examples offered (EXAMPLES, or
    examples_for the served model, with chapter 12.2's real pictures), those of
    the tasks offered. `tasks`: the tasks offered (tasks_for the served model:
    those it learnt), in TASK_PROMPTS' order"""
    examples = {name: e for name, e in examples.items() if e[2] in tasks}
    on = page_handlers(model, processor, adapter, segment, examples)
    with gr.Blocks(title="PaliGemma from scratch", analytics_enabled=False) as app:
        image_state = gr.State(None)  # the PIL image asked about
        maps_state = gr.State(None)  # [T, L, side, side]: attention, heads averaged
        unread_state = gr.State("")  # the last upload's message, if not an image
        gr.Markdown(
            "# PaliGemma from scratch: the demo\n"
            "Upload an image or pick an example, choose a task, press **Run**. "
            f"Images up to {MAX_IMAGE_BYTES // 2**20} MiB and "
            f"{MAX_IMAGE_PIXELS // 10**6} megapixels."
        )
        with gr.Row():
            source = image_panel(examples)
            controls = task_panel(adapter, bool(segment), tasks, on.on_task(tasks[0]))
        with gr.Row():
            shown = answer_panel()
            looked = attention_panel(model.config.text.num_hidden_layers)

        connect(
            source,
            controls,
            shown,
            looked,
            (image_state, maps_state, unread_state),
            on,
        )
    return app


def launch(
    app: gr.Blocks,
    host: str = "127.0.0.1",
    port: int | None = None,
    inline: bool | None = None,
    prevent_thread_lock: bool = False,
):
    """Serve the page on host:port, never through a public share link. Uploads
    over MAX_IMAGE_BYTES are refused by Gradio as they arrive, before they are
    written to disk; at most MAX_QUEUE requests wait for the model"""
    if host not in LOCAL_HOSTS:
        print(
            f"warning: --host {host} serves the demo to every machine that can reach "
            "this one, with no login; use 127.0.0.1 to keep it on this machine",
            file=sys.stderr,
        )
    app.queue(max_size=MAX_QUEUE)
    return app.launch(
        max_file_size=MAX_IMAGE_BYTES,
        server_name=host,
        server_port=port,
        share=False,
        inline=inline,
        inbrowser=False,
        prevent_thread_lock=prevent_thread_lock,
        ssr_mode=False,
        theme=THEME,
        css=CSS,
        footer_links=[],
        quiet=True,
    )


def browser_address(host: str, port: int) -> str:
    """The address a browser on this machine opens: a server on every interface
    (0.0.0.0) is reached at the loopback address, which the line says"""
    if host in ("0.0.0.0", ""):
        return f"http://127.0.0.1:{port} (listening on every interface, port {port})"
    return f"http://{host}:{port}"


def serve(
    model_path,
    adapter_path=None,
    host="127.0.0.1",
    port=7860,
    device="auto",
    segment_path=None,
):
    "Load the model (and adapters) and serve the demo until Ctrl-C"
    from .processing import PaliGemmaProcessor
    from .weights import load_pretrained, resolve_device

    processor = PaliGemmaProcessor.from_pretrained(model_path)
    model = load_pretrained(model_path, device=resolve_device(device))
    name = None
    if adapter_path is not None:
        load_adapter(model, adapter_path)
        name = Path(adapter_path).name
    segment = None if segment_path is None else detached_adapter(model, segment_path)
    print(f"serving {model_path}" + (f" with adapter {name}" if name else ""))
    if segment_path is not None:
        print(f"segment task: adapter {Path(segment_path).name}")
    print(f"open {browser_address(host, port)} (Ctrl-C stops)")
    # only the tasks the model learnt, and those of the adapters served (each
    # without a training record taken to teach the task the page uses it for)
    folder = resolve_model_path(model_path)
    roles = {adapter_path: "receipt", segment_path: "segment"}
    tasks = tasks_for(folder, {f: task for f, task in roles.items() if f})
    # the receipt example only where the receipt task is offered
    examples = examples_for(folder, receipts="receipt" in tasks)
    app = build_app(model, processor, name, segment, examples, tasks)
    launch(app, host=host, port=port)
    return 0
