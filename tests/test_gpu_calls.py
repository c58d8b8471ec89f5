"""tools/gpu_calls.py: the speed page's table of what each GPU call trained and
whether it shipped (issue 49), on fake records and on the real ones."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_calls  # noqa: E402


def segment_part(started, chosen="rows"):
    runs = {
        name: {"examples_per_s": rate, "validation": {"mIoU": miou}}
        for name, rate, miou in (("lora", 900.0, 0.61), ("rows", 800.0, 0.64))
    }
    return {"started": started, "steps": 1000, "batch_size": 64, "runs": runs,
            "finished": ["lora", "rows"], "chosen on validation": chosen,
            "part seconds": 120.0}  # fmt: skip


def real_part(started, steps):
    return {"started": started, "steps": steps, "batch_size": 128,
            "finished": ["real"], "examples_per_s": 2500.0,
            "part seconds": 240.0}  # fmt: skip


def write_call(folder, stamp, parts, rehearsal=False):
    day, time = stamp.split("-")  # the call's start, as gpu_run.py names its file
    started = f"{day[:4]}-{day[4:6]}-{day[6:]}T{time[:2]}:{time[2:]}:00+00:00"
    record = {"started": started, "rehearsal": rehearsal, "parts": parts,
              "environment": {"device": "NVIDIA H100 80GB HBM3"}}  # fmt: skip
    (folder / f"gpu-run-{stamp}.json").write_text(json.dumps(record))


def fake_world(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    segment = segment_part("2026-11-28T09:12:40+00:00")
    write_call(results, "20261128-0912", {
        "segment": segment, "real": real_part("2026-11-28T09:20:05+00:00", 900),
        "t4": {"started": "2026-11-28T09:05:00+00:00", "seconds": 60}})  # fmt: skip
    # a later call run with --only real keeps the segment part it found: once
    write_call(
        results,
        "20261128-1100",
        {"segment": segment, "real": real_part("2026-11-28T11:00:30+00:00", 1800)},
    )
    write_call(results, "20261128-1200", {"segment": segment_part(
        "2026-11-28T12:00:00+00:00")}, rehearsal=True)  # fmt: skip
    measures = {
        "new": {"items named": 0.91, "3-digit numbers read": 0.95},
        "shipped": {"items named": 0.82, "3-digit numbers read": 0.84},
    }
    (tmp_path / "real-record.json").write_text(json.dumps({"measures": measures}))
    decisions = [
        {"model": "segment", "try": "2026-11-25 (CPU, 44 min)", "ships": True,
         "decided on": "validation scenes 100-139"},
        {"model": "segment", "try": "20261128-0912", "ships": False,
         "decided on": "validation scenes 64-363", "rises": [], "falls": []},
        # the same minute, another model: not the segment part's decision
        {"model": "nano-real", "try": "20261128-0912", "ships": True,
         "decided on": "elsewhere", "records": ["real-record.json"]},
        {"model": "nano-real", "try": "20261128-0920", "ships": True,
         "decided on": "validation: 300 examples",
         "records": ["real-record.json"], "rises": ["items named"]},
    ]  # fmt: skip
    ledger = tmp_path / "ledger.json"
    ledger.write_text(json.dumps({"ship decisions": decisions}))
    return results, ledger


def test_each_training_part_is_one_row_beside_its_own_decision(tmp_path):
    results, ledger = fake_world(tmp_path)
    rows = gpu_calls.rows(results, ledger, tmp_path)
    cells = [r["cells"] for r in rows]
    assert [c[:3] for c in cells] == [
        ["28 Nov 2026, 09:12", "H100", "segment"],
        ["28 Nov 2026, 09:20", "H100", "nano-real"],
        ["28 Nov 2026, 11:00", "H100", "nano-real"],
    ]  # the repeated segment part once, the rehearsal and the T4 part not at all
    segment, real, undecided = cells
    assert segment[3:] == ["1,000 \u00d7 64", "lora 900; rows 800",
                           "lora 0.610, rows 0.640; chose rows", "no"]  # fmt: skip
    assert real[5:] == ["0.910, 0.950 (was 0.820, 0.840)", "yes"]
    assert undecided[5:] == ["-", "not decided"]
    assert [r["details"] for r in rows] == [
        "28 Nov 2026, 09:12, segment: decided on validation scenes 64-363; rose by "
        "the margin: nothing; fell by it: nothing.",
        "28 Nov 2026, 09:20, nano-real: decided on validation: 300 examples; rose "
        "by the margin: items named; fell by it: nothing.",
        "28 Nov 2026, 11:00, nano-real: the ledger holds no decision on it.",
    ]
    assert [r["examples"] for r in rows] == [2 * 64_000, 900 * 128, 1800 * 128]
    summary = gpu_calls.summary(rows)
    assert summary.startswith("3 training parts in all, 10 GPU minutes, ")
    assert summary.endswith(" 1 shipped.")


def test_a_stage2_part_shows_what_rose_by_the_margin(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    models = {"448": {"examples_per_s": 700.0}, "224": {"examples_per_s": 2000.0}}
    stage2 = {"started": "2026-11-29T08:00:10+00:00", "steps": 600, "batch_size": 128,
              "finished": ["448", "224"], "models": models}  # fmt: skip
    write_call(results, "20261129-0800", {"stage2": stage2})
    (tmp_path / "s2.json").write_text("{}")
    entry = {"model": "nano-448", "try": "20261129-0800", "ships": True,
             "decided on": "validation from index 0", "records": ["s2.json"],
             "rises": ["detail CER"]}  # fmt: skip
    ledger = tmp_path / "ledger.json"
    ledger.write_text(json.dumps({"ship decisions": [entry]}))
    (row,) = gpu_calls.rows(results, ledger, tmp_path)
    assert row["cells"][2:] == [
        "nano-448", "600 \u00d7 128", "448 700; 224 2,000", "rose: detail CER", "yes"
    ]  # fmt: skip
    assert row["examples"] == 2 * 600 * 128


def test_every_gpu_decision_of_the_ledger_is_a_row_of_the_page():
    """No decision on a GPU call's part goes unshown: each one the ledger holds
    (a try stamped to the minute) is the decision of a row, and the page shows the
    table as the script writes it"""
    ledger = json.loads(gpu_calls.LEDGER.read_text())
    decided = gpu_calls.decisions(ledger)
    assert decided, "the ledger holds GPU decisions (2026-11-26's)"
    rows = gpu_calls.rows()
    shown = {(r["cells"][2], gpu_calls.minute(r["started"])) for r in rows}
    assert set(decided) <= shown, set(decided) - shown
    page = (ROOT / "book" / "a2_speed_and_memory.md").read_text()
    assert gpu_calls.table(rows) in page and gpu_calls.summary(rows) in page


def test_the_scenes_the_page_names_are_the_ones_the_parts_read():
    """The choice's scenes are those the ledger's segment tries name, and the ship
    decision's begin past them: what chose a run does not decide its ship"""
    for entry in json.loads(gpu_calls.LEDGER.read_text())["ship decisions"]:
        if "validation scenes" in entry.get("part", {}):
            assert entry["part"]["validation scenes"] == gpu_calls.CHOICE
    assert gpu_calls.SEGMENT_SHIP_SCENES[0] == gpu_calls.SEGMENT_VALIDATION


def test_a_failed_part_is_a_row_that_says_why(tmp_path):
    """A part that trained but failed later (a run crashed, a file too many) still
    spent its minutes: its row says so, and the list under the table says why in
    the part's own words"""
    results = tmp_path / "results"
    results.mkdir()
    part = segment_part("2026-11-29T09:00:00+00:00")
    del part["runs"]["rows"]["validation"], part["runs"]["rows"]["examples_per_s"]
    part["error"] = "Traceback:\n  a | b\nRuntimeError: boom"
    # and a part that failed before it trained a step: its minutes are counted too
    # (a record older than the parts' own starts: the call's start stands in)
    untrained = {"error": "calibration failed", "part seconds": 60.0}
    write_call(results, "20261129-0900", {"segment": part, "stage2": untrained})
    ledger = tmp_path / "ledger.json"
    ledger.write_text(json.dumps({"ship decisions": []}))
    rows = gpu_calls.rows(results, ledger, tmp_path)
    row, nothing = [r["cells"] for r in rows]
    assert row[4:] == ["lora 900; rows -", "-", "failed"]
    assert nothing[::2] == ["29 Nov 2026, 09:00", "nano-448", "-", "failed"]
    assert nothing[3:6] == ["-", "-", "-"]
    assert rows[1]["details"].endswith("nano-448: the part failed: calibration failed.")
    assert gpu_calls.summary(rows).startswith("2 training parts in all, 3 GPU minutes")
    assert rows[0]["details"] == (
        "29 Nov 2026, 09:00, segment: the part failed: Traceback: a | b "
        "RuntimeError: boom."
    )
    assert "- " + rows[0]["details"] in gpu_calls.table(rows)


def test_a_try_trained_on_a_cpu_is_no_gpu_call():
    "tools/stage2_local.py's tries are stamped to the minute too, but spent no GPU"
    where = "paligemma_lib/assets/stage2/stage2-{}-validation-{}.json"
    cpu = {"model": "nano-448", "try": "20261128-2229", "ships": False,
           "records": [where.format("cpu", "20261128-2229")]}  # fmt: skip
    gpu = cpu | {"try": "20261129-0800",
                 "records": [where.format("gpu", "20261129-0800")]}  # fmt: skip
    found = gpu_calls.decisions({"ship decisions": [cpu, gpu]})
    assert list(found) == [("nano-448", "202611290800")]
