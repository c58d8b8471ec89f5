"""The GPU tools' shared driver: choices are made on the validation split only (issue
22 section 1). No GPU and no training: `choose` gets a fake evaluate that records the
splits it is asked for."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import gpu_driver  # noqa: E402
import train_nano_gpu  # noqa: E402
import train_receipts_gpu  # noqa: E402


def test_choose_reads_only_validation():
    asked = []
    scores = {"a": 0.2, "b": 0.9, "c": 0.5}

    def evaluate(name, split):
        asked.append((name, split))
        return {"receipt": {"all fields": scores[name]}}

    best, metrics = gpu_driver.choose(list(scores), evaluate, train_receipts_gpu.score)
    assert best == "b"
    assert asked == [(n, "validation") for n in scores]  # never "test" nor "train"
    assert set(metrics) == set(scores)


def test_choose_nano_score_on_validation():
    asked = []

    def evaluate(name, split):
        asked.append(split)
        good = name == "lr-2e-3"
        shapes = {
            t: {"exact match": 1.0 if good else 0.5}
            for t in ("caption", "count", "colour")
        } | {"detection": {"mean IoU": 0.8 if good else 0.4}}
        return {"shapes": shapes, "ocr": {"ocr": {"character error rate": 0.05}}}

    best, _ = gpu_driver.choose(
        list(train_nano_gpu.RUNS), evaluate, train_nano_gpu.score
    )
    assert best == "lr-2e-3"
    assert set(asked) == {gpu_driver.SELECTION_SPLIT} == {"validation"}


def test_choose_without_runs_says_so():
    with pytest.raises(ValueError, match="no run finished"):
        gpu_driver.choose([], lambda name, split: {}, train_receipts_gpu.score)


class FakeDriver:
    """The driver with no GPU and no training: each run 'finishes' with the files
    the tools pack, and every grade records the split it was asked for"""

    asked: list = []

    def __init__(self, out, work, base):
        self.work = work

    def say(self, *words):
        pass

    def calibrate(self, runs, budget, reserve):
        self.runs = list(runs)
        return 40

    def run_all(self, runs, steps, extra):
        for name in runs:
            folder = self.work / name
            folder.mkdir(parents=True)
            for file in (*train_nano_gpu.SHIPPED, "adapter_config.json",
                         "adapter_model.safetensors"):  # fmt: skip
                (folder / file).write_text("{}")
        return list(runs)

    def evaluate(self, folder, world, split, limit, adapter=None):
        FakeDriver.asked.append(split)
        return {"receipt": {"all fields": 0.5}}


@pytest.mark.parametrize("tool", [train_nano_gpu, train_receipts_gpu])
def test_the_gpu_tools_grade_no_test_example(tool, tmp_path, monkeypatch):
    """Test is graded once, on the dev machine, from the ledger's fresh range: the
    GPU tools read validation only (before 2026-11-28 they graded test 0-199 after
    their choice, every time they ran)"""
    FakeDriver.asked = []
    monkeypatch.setattr(tool, "Driver", FakeDriver)
    if tool is train_nano_gpu:  # its grade is per world: score what the fake gives
        monkeypatch.setattr(tool, "score", lambda metrics: 0.5)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(sys, "argv", [tool.__file__, "--work", str(tmp_path / "w")])
    assert tool.main() == 0
    assert FakeDriver.asked and set(FakeDriver.asked) == {"validation"}


def test_the_driver_grades_no_test_example(tmp_path):
    "Driver.evaluate refuses test before it loads anything"
    driver = gpu_driver.Driver(tmp_path, tmp_path, [])
    with pytest.raises(ValueError, match="validation only"):
        driver.evaluate("nano", "receipts", "test", 8)
