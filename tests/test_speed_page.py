"""The appendix's "Speed and memory" page and the README's speed sentence are
read from the benchmark records (issue 30): no figure typed by hand."""

import json
import sys
from pathlib import Path

import pytest

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
        line = next(x for x in page.splitlines() if f"{speed_page.place(name)}`" in x)
        assert "*Machine:*" in line and "*Date:*" in line and "*Command:*" in line


def test_the_published_records_were_not_taken_on_a_loaded_machine():
    "Only --busy runs carry load, and it is their experiment, said beside them"
    for name in (speed_page.CPU_QUIET, speed_page.INT8_FP32, speed_page.INT8_BF16):
        assert speed_page.record(name)["busy_loops"] == 0
    busy = speed_page.record(speed_page.CPU_BUSY)
    assert busy["busy_loops"] == 1 and "the load is the experiment" in (
        " ".join(speed_page.PAGE.read_text().split())
    )


def test_the_readme_speed_sentence_is_the_record():
    parts = speed_page.record(speed_page.GPU_DECODE)
    ours = parts["sections"]["decode ours compiled, batch 1"]["ms_per_step"]
    best = parts["sections"]["decode transformers static compiled, batch 1"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"compiled: {ours:.2f} ms a step at batch 1" in readme
    assert f"{best['ms_per_step'] / ours:.2f} times as fast as" in readme
    assert parts["device"].startswith("NVIDIA H100") and "NVIDIA H100" in readme


def test_the_readme_h200_sentence_is_the_pages_h200_record():
    "The README's H200 figures are the page's H200 table: the same record"
    (h200,) = [name for name, _ in speed_page.GPU_DECODES
               if speed_page.record(name)["device"] == "NVIDIA H200"]  # fmt: skip
    parts = speed_page.record(h200)["sections"]
    ours = parts["decode ours compiled, batch 1"]["ms_per_step"]
    theirs = parts["decode transformers static compiled, batch 1"]["ms_per_step"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    page = " ".join(speed_page.PAGE.read_text().split())
    sentence = (
        f"on an H200, {ours:.2f} ms against its {theirs:.2f}, "
        f"{theirs / ours:.2f} times as fast."
    )
    assert sentence in readme
    # and the page shows the same three figures, from the same record
    assert f"| ours, compiled (CUDA graphs) | {ours:.2f} |" in page
    assert f"| `transformers`, static cache, compiled | {theirs:.2f} |" in page
    assert f"ours is {theirs / ours:.2f} times as fast" in page


def test_the_int8_figures_say_at_which_widths_they_hold():
    """Issue 33: measured 512 wide, where a layer's weights stay in the CPU's caches;
    a reader must not carry them to PaliGemma's 2048"""
    page = " ".join(speed_page.PAGE.read_text().split())
    section = page[page.index("## int8 weights on a CPU") :]
    section = section[: section.index("## ", 3)]
    for name in (speed_page.INT8_FP32, speed_page.INT8_BF16):
        rows = speed_page.record(name)["rows"]
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


def test_the_decode_profile_section_reads_the_newest_record(tmp_path):
    "Issue 50: the GPU part `decode`, once ingested, is a section and a figure"
    import gpu_decode

    assert speed_page.decode_profile(tmp_path) == ""  # no record: no section
    times = {c: [100.0] for c in gpu_decode.CLASSES}  # µs, one step
    nbytes = dict.fromkeys(gpu_decode.CLASSES, 10**8)
    row = {"generate ms a step": 1.5, "replayed ms a step": 1.0,
           "host ms a step": 0.5, "tokens equal eager": True,
           "classes": gpu_decode.class_table(times, nbytes, steps=1)}  # fmt: skip
    row = gpu_decode.with_limits(row, bandwidth=1e12)
    rows = {"bf16, batch 1, as shipped": row, "int8, batch 1, as shipped": row,
            "bf16, batch 8, as shipped": {"skipped": "out of time"}}  # fmt: skip
    for stamp, device in [("20261201-0900", "old"), ("20261202-0900", "H100")]:
        record = {"device": device, "torch": "2.11", "bandwidth": 1e12, "rows": rows}
        name = f"decode-profile-x-{stamp}.json"
        (tmp_path / name).write_text(json.dumps(record))
    text = speed_page.decode_profile(tmp_path)
    assert "*Machine:* H100, PyTorch 2.11" in text  # the newest
    # 6 classes x 0.1 ms; 0.6 GB at 1 TB/s; the step 1.5 ms
    assert (
        "| bf16, batch 1, as shipped | 1.50 | 1.00 | 0.60 | 0.40 | 0.50 | 0.60 | 40% |"
        in text
    )
    assert "| bf16, batch 8, as shipped | - | - | - | - | - | - | out of time |" in text
    assert text.count("| LM head | 0.100 | 1 | 0.100 | 0.100 | 100% |") == 2
    chart = tmp_path / "profile.png"
    speed_page.draw_decode_profile(record, chart)
    assert chart.stat().st_size > 1000


def test_the_resolution_section_shows_the_newest_gpu_record(tmp_path):
    "Issue 52: the GPU rows come from the GPU script's part `resolution`"
    assert speed_page.gpu_resolution(tmp_path) == ""  # no record: no section
    for stamp, prefill in (("20261201-0900", 99.0), ("20261202-0900", 12.5)):
        rows = {
            str(size): {"image tokens": tokens, "prefill ms": prefill * k,
                        "decode ms a step": 14.0 + k, "prefill FLOPs": k,
                        "prefill x 224": k, "FLOPs x 224": k, "step x 224": 1.0}
            for size, tokens, k in ((224, 256, 1), (448, 1024, 4), (896, 4096, 16))
        }  # fmt: skip
        command = "python benchmarks/resolution.py --device cuda"
        record = {"device": "NVIDIA H100", "torch": "2.11", "rows": rows,
                  "command": command}  # fmt: skip
        (tmp_path / f"resolution-cuda-{stamp}.json").write_text(json.dumps(record))
    text = speed_page.gpu_resolution(tmp_path)
    assert "## Resolution on a GPU" in text
    assert "| 896 | 4,096 | 200.0 | 16.00 | 16.00 | 30.00 | 1.00 |" in text  # newest
    assert "1584.0" not in text and "1,584.0" not in text  # not the older
    assert "*Date:* 2026-12-02 09:00" in text
    rows["448"]["image tokens"] = 1000  # not 3B's 32 x 32 patches: the prose is wrong
    (tmp_path / "resolution-cuda-20261203-0900.json").write_text(
        json.dumps(record | {"rows": rows})
    )
    with pytest.raises(AssertionError):
        speed_page.gpu_resolution(tmp_path)


def test_the_recipe_data_section_reads_the_newest_quiet_record():
    "benchmarks/data_rate.py's newest record, taken with at most one other busy core"
    found = speed_page.data_rates()
    assert found, "no benchmarks/results/data-rate-cpu-*.json"
    run = speed_page.record(found[-1])
    assert run["load average"][0] < 2.0  # one thread timed, on two cores
    page = speed_page.PAGE.read_text()
    assert f"{speed_page.place(found[-1].name)}`" in page
    for name, row in run["rows"].items():
        assert f"| {name} | {row['batch']} | {row['examples/s']:,.0f} |" in page
