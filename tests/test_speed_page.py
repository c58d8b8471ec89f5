"""The appendix's "Speed and memory" page and the README's speed sentence are
read from the benchmark records (issue 30): no figure typed by hand."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import speed_page  # noqa: E402


def test_the_page_is_what_the_script_writes_from_the_records():
    assert speed_page.PAGE.read_text() == speed_page.render(), (
        "book/a2_speed_and_memory.md is out of date: python tools/speed_page.py"
    )


def test_every_record_the_page_reads_names_its_machine():
    page = speed_page.PAGE.read_text()
    for name in (
        speed_page.GPU_DECODE,
        speed_page.CPU_QUIET,
        speed_page.CPU_BUSY,
        speed_page.INT8_FP32,
        speed_page.INT8_BF16,
        speed_page.DATA_PIPELINE,
    ):
        # each record is cited beside its machine, date and command
        line = next(x for x in page.splitlines() if f"results/{name}`" in x)
        assert "*Machine:*" in line and "*Date:*" in line and "*Command:*" in line


def test_the_published_records_were_not_taken_on_a_loaded_machine():
    "Only --busy runs carry load, and it is their experiment, said beside them"
    for name in (speed_page.CPU_QUIET, speed_page.INT8_FP32, speed_page.INT8_BF16):
        assert json.loads((speed_page.RESULTS / name).read_text())["busy_loops"] == 0
    busy = json.loads((speed_page.RESULTS / speed_page.CPU_BUSY).read_text())
    assert busy["busy_loops"] == 1 and "the load is the experiment" in (
        " ".join(speed_page.PAGE.read_text().split())
    )


def test_the_readme_speed_sentence_is_the_record():
    parts = json.loads((speed_page.RESULTS / speed_page.GPU_DECODE).read_text())
    ours = parts["sections"]["decode ours compiled, batch 1"]["ms_per_step"]
    best = parts["sections"]["decode transformers static compiled, batch 1"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"compiled: {ours:.2f} ms a step at batch 1" in readme
    assert f"{best['ms_per_step'] / ours:.2f} times as fast as" in readme
    assert parts["device"].startswith("NVIDIA H100") and "NVIDIA H100" in readme


def test_the_int8_figures_say_at_which_widths_they_hold():
    """Issue 33: measured 512 wide, where a layer's weights stay in the CPU's caches;
    a reader must not carry them to PaliGemma's 2048"""
    page = " ".join(speed_page.PAGE.read_text().split())
    section = page[page.index("## int8 weights on a CPU") :]
    section = section[: section.index("## ", 3)]
    for name in (speed_page.INT8_FP32, speed_page.INT8_BF16):
        rows = json.loads((speed_page.RESULTS / name).read_text())["rows"]
        assert {row["config"] for row in rows} == {speed_page.MID}
    assert speed_page.MID in section and "the decoder 512 wide" in section
    assert "at PaliGemma's (2048 wide, MLP 16,384) they are unmeasured" in section


def test_the_page_shows_the_decoding_chart_and_no_maintainer_notes():
    "Issue 42: the main table as a chart; no issue numbers, work trees or to-dos"
    page = " ".join(speed_page.PAGE.read_text().split())
    assert f"figures/{speed_page.CHART.name}" in page
    assert speed_page.CHART.is_file(), "python tools/speed_page.py draws it"
    # (the GPU script's section names each call's commit: tests/test_gpu_run.py
    # checks with it which call each part came from)
    for note in ("issue ", "+changes", "to be run", "quiet machine", " yet", "for now"):
        assert note not in page.lower(), f"a maintainer's note on the page: {note!r}"


def test_the_chart_is_drawn_the_same_twice(tmp_path):
    "The chart carries no date or version: the same records draw the same bytes"
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    speed_page.draw_decoding_chart(first)
    speed_page.draw_decoding_chart(second)
    assert first.read_bytes() == second.read_bytes()
