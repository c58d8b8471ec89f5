"""The evaluations the book reports: test examples that no choice looked at, and records
that say which evaluator made which number (issue 22 sections 1 and 2)."""

import json
import sys
from pathlib import Path

import pytest

from paligemma_lib.adapters import resolve_adapter_path
from paligemma_lib.data import SPLITS, SyntheticDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import evaluate_fresh  # noqa: E402

FRESH = ROOT / "paligemma_lib/assets/records/fresh-test-20261123.json"
# the test indices a choice looked at: the GPU tools' evaluations (shapes 0-479, OCR and
# receipts 0-199), which the chapters' earlier reports (0-95) lie inside
CHOSEN_ON = {"shapes": 480, "ocr": 200, "receipts": 200}


def test_fresh_range_is_past_every_choice():
    assert evaluate_fresh.FRESH_START >= max(CHOSEN_ON.values())
    result = json.loads(FRESH.read_text())
    first, last = result["test indices"]
    assert first == evaluate_fresh.FRESH_START and last >= first
    n = last - first + 1
    for part in [*result["nano"].values(), result["receipts"]]:
        assert len(part["rows"]) == n


def test_fresh_slice_takes_the_test_seeds_from_the_offset():
    count = evaluate_fresh.fresh("shapes", 3, "count", start=7)
    full = SyntheticDataset("shapes", "test", task="count")
    for i in range(3):
        assert count.example(i).seed == SPLITS["test"][7 + i]
        assert count[i][1:] == full[7 + i][1:]  # the same prompt and answer
    with pytest.raises(ValueError, match="examples"):
        evaluate_fresh.fresh("ocr", 2, start=len(SPLITS["test"]) - 1)


def test_receipts_record_marks_the_old_evaluator():
    record = json.loads(
        (resolve_adapter_path("receipts") / "training_record.json").read_text()
    )
    old = record["history"]["eval"][-1]["receipt exact match"]
    assert old == 3 / 64  # kept as written, not rewritten
    assert "32" in record["notes"]["history"]
    again = record["evaluations"]["receipts/validation"]
    assert again["max_new_tokens"] == 64 and again["examples"] == 64
    # the same 64 validation receipts as the saved fresh evaluation's first part
    saved = json.loads(FRESH.read_text())["receipts validation (first 64)"]
    assert saved["metrics"] == again["metrics"]


@pytest.mark.parametrize("page", ["README.md", "book/a1_using_the_library.md"])
def test_readme_numbers_are_the_fresh_evaluation(page):
    """The nano and receipts numbers of the README and of the book's page on
    using the library are those of the fresh record, rounded"""
    fresh = json.loads(FRESH.read_text())
    nano = {task: part["metrics"] for task, part in fresh["nano"].items()}
    n = len(fresh["receipts"]["rows"])
    readme = " ".join((ROOT / page).read_text().split())
    caption = nano["caption"]["caption"]["exact match"]
    count = round(nano["count"]["count"]["exact match"] * n)
    colour = nano["colour"]["colour"]["exact match"]
    iou = nano["detect"]["detection"]["mean IoU"]
    cer = nano["ocr"]["ocr"]["character error rate"]
    receipts = fresh["receipts"]["metrics"]["receipt"]["exact match"]
    first, last = fresh["test indices"]
    assert f"test examples {first}-{last}" in readme
    assert f"captions {caption:.0%} exactly" in readme
    assert f"counts {count} of {n} right" in readme
    assert colour == 1.0 and "names every colour" in readme
    assert f"mean IoU of {iou:.2f}" in readme
    assert f"{cer:.1%} character error rate" in readme
    assert f"{receipts:.1%} of {n} whole answers exactly right" in readme
    assert f"test receipts {first}-{last}" in readme


def test_the_fresh_record_names_the_files_it_scored():
    """Issue 28: the record holds the commit and the sha256 of every file of the model
    and the adapter it scored; the shipped files are still those (retrained weights
    must be scored again, on new seeds)"""
    record = json.loads(FRESH.read_text())
    assert len(record["commit"]) == 40
    files = evaluate_fresh.file_hashes()
    assert {"nano/model.safetensors", "receipts/adapter_model.safetensors"} <= set(
        files
    )
    assert record["files"] == files, "the shipped files changed since the evaluation"


def test_the_shipped_fresh_record_spends_its_seeds():
    "The record a chapter quotes ships with the package; its seeds stay spent"
    files = dict.fromkeys(evaluate_fresh.file_hashes(), "retrained")
    with pytest.raises(SystemExit, match="--start 5300"):
        evaluate_fresh.check_seeds_unused(5000, 5010, files)


def test_reported_seeds_are_refused_for_other_files(tmp_path):
    """Issue 28: test seeds are spent once reported: scoring other files on them is
    refused with the way out (--start past them); the same files, or seeds past the
    record, pass"""
    assets = tmp_path / "assets"
    for folder in evaluate_fresh.SCORED:
        (assets / folder).mkdir(parents=True)
        (assets / folder / "weights.bin").write_bytes(folder.encode())
    files = evaluate_fresh.file_hashes(assets)
    assert sorted(files) == ["nano/weights.bin", "receipts/weights.bin"]
    results = tmp_path / "results"
    results.mkdir()
    record = {"test indices": [5000, 5299], "files": files}
    (results / "fresh-test-20990101.json").write_text(json.dumps(record))
    evaluate_fresh.check_seeds_unused(5000, 5299, files, results)  # a re-run
    evaluate_fresh.check_seeds_unused(5300, 5599, files, results)  # new seeds
    (assets / "nano" / "weights.bin").write_bytes(b"retrained")
    changed = evaluate_fresh.file_hashes(assets)
    evaluate_fresh.check_seeds_unused(5300, 5399, changed, results)
    for first, last in [(5000, 5099), (5200, 5400), (4000, 5000)]:
        with pytest.raises(SystemExit, match=r"nano/weights.bin.*--start 5300"):
            evaluate_fresh.check_seeds_unused(first, last, changed, results)
    # a record that names no files spends its seeds for any files
    (results / "fresh-test-20990101.json").write_text(
        json.dumps({"test indices": [6000, 6099]})
    )
    with pytest.raises(SystemExit, match="--start 6100"):
        evaluate_fresh.check_seeds_unused(6050, 6060, files, results)


# --- chapter 12.1: the shipped segment adapter on the segments world's test scenes


def segment_evaluation() -> dict:
    record = json.loads(
        (resolve_adapter_path("segment") / "training_record.json").read_text()
    )
    return record["evaluations"]["segments/test"]


def test_segment_evaluation_scored_the_shipped_files():
    "The sha256 of the adapter's and the VAE's weights it scored are the shipped ones"
    import evaluate_segment

    evaluation = segment_evaluation()
    assert len(evaluation["commit"]) >= 40
    assert evaluation["split"] == "test"
    shipped = {
        "segment/adapter_model.safetensors": resolve_adapter_path("segment")
        / "adapter_model.safetensors",
        "segment/adapter_config.json": resolve_adapter_path("segment")
        / "adapter_config.json",
        "mask_vae/mask_vae.npz": ROOT / "paligemma_lib/assets/mask_vae/mask_vae.npz",
    }
    assert set(evaluation["files"]) == set(shipped)
    for name, path in shipped.items():
        assert evaluation["files"][name] == evaluate_segment.sha256(path), name
    # the benchmarks/results copy is the same evaluation
    copies = sorted((ROOT / "benchmarks/results").glob("segment-test-*.json"))
    assert copies and json.loads(copies[-1].read_text()) == evaluation


def test_segment_metrics_are_the_saved_grades_summary():
    from paligemma_lib.segment_eval import summarize

    evaluation = segment_evaluation()
    first, last = evaluation["indices"]
    rows = evaluation["rows"]
    assert len(rows) == last - first + 1 and first >= 1000  # past tests/test_cli.py's
    data = SyntheticDataset("segments", "test", size=last + 1)
    kinds = []
    for index, row in zip(range(first, last + 1), rows):
        assert row["seed"] == SPLITS["test"][index]
        kinds.append(row["prompt"].removeprefix("segment "))
    assert kinds[:20] == [data.example(i).labels[0] for i in range(first, first + 20)]
    assert summarize(kinds, [row["grades"] for row in rows]) == evaluation["metrics"]


def test_readme_segment_numbers_are_the_record():
    metrics = segment_evaluation()["metrics"]
    readme = " ".join((ROOT / "book/a1_using_the_library.md").read_text().split())
    first, last = segment_evaluation()["indices"]
    better = max(metrics["filled box mIoU"], metrics["class mask mIoU"])
    assert f"mask mIoU of {metrics['mIoU']:.2f}" in readme
    assert f"{better:.2f} for the better baseline" in readme
    assert f"test scenes {first}-{last}" in readme


def test_readme_segment_picture_is_a_graded_test_scene():
    """A.1's scene (the README links there) is test scene 1001 of the segments
    world, graded with the shipped adapter in its first report (kept in its record)
    and spent in the ledger, so that the fresh grade's scenes stay unseen"""
    import numpy as np

    import paligemma_lib.segmentation  # noqa: F401  (adds the segments world)
    from paligemma_lib.image_processing import load_image

    record = json.loads(
        (resolve_adapter_path("segment") / "training_record.json").read_text()
    )
    first, last = record["evaluations"]["segments/test 2026-11-26"]["indices"]
    assert first <= 1001 <= last
    fresh, fresh_last = segment_evaluation()["indices"]
    assert not fresh <= 1001 <= fresh_last
    ledger = json.loads((ROOT / "paligemma_lib/assets/ledger.json").read_text())
    assert any(e["world"] == "segments" and e["start"] <= 1001 <= e["stop"]
               for e in ledger["test ranges spent"])  # fmt: skip
    scene = SyntheticDataset("segments", "test", size=1002).example(1001)
    picture = load_image(ROOT / "book/figures/segment_scene.png")
    assert np.array_equal(np.asarray(picture), np.asarray(scene.image))
    assert scene.prompt == "segment circle"
    page = " ".join((ROOT / "book/a1_using_the_library.md").read_text().split())
    assert '--prompt "segment circle" --adapter segment --draw /tmp/masks.png' in page
    assert (ROOT / "book/figures/segment_masks.png").is_file()


def test_the_ledger_refuses_ranges_other_grades_spent():
    """A range the ledger lists is refused whoever graded it (the T4 part spent
    receipts 5000-5095, which no fresh-test record names); a range past every entry
    is fresh; the shipped record's own files on its own range re-run, spending
    nothing"""
    from ship_rules import read_ledger

    ledger = read_ledger()
    files = evaluate_fresh.file_hashes()
    with pytest.raises(SystemExit, match="receipts 5000-5095"):
        evaluate_fresh.check_ledger(5000, 5010, files, ledger)
    retrained = dict.fromkeys(files, "retrained")
    with pytest.raises(SystemExit, match="--start 5300"):
        evaluate_fresh.check_ledger(5200, 5400, retrained, ledger)
    assert evaluate_fresh.check_ledger(5300, 5599, retrained, ledger) is True
    by = "tools/evaluate_fresh.py (records/fresh-test-20261123.json)"
    mine = {"world": "shapes", "start": 5000, "stop": 5299, "by": by}
    alone = {"test ranges spent": [mine]}
    assert evaluate_fresh.check_ledger(5000, 5299, files, alone) is False
    with pytest.raises(SystemExit):  # other files on that range
        evaluate_fresh.check_ledger(5000, 5299, retrained, alone)
    with pytest.raises(SystemExit):  # past the record's own range
        evaluate_fresh.check_ledger(5000, 5300, files, alone)
