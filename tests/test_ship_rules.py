"""tools/ship_rules.py and tools/gpu_ingest.py (issue 49): what ships is decided on
validation, pair by pair, by a margin of two standard errors with no measure falling by
more than its own two; test is graded once, after a ship, on examples the ledger has
never seen. The ingest runs whole here with fake graders that record what they read."""

import copy
import inspect
import json
import re
import statistics
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_ingest  # noqa: E402
import ship_rules  # noqa: E402

NANO = {"ch. 11 shapes captioned": 0.98, "ch. 11 boxes, IoU >= 0.5": 0.93,
        "ch. 11 text read": 0.885}  # fmt: skip


def measured(**changes) -> dict:
    "Measures that meet every goal and keep chapter 11's skills, but for `changes`"
    values = {"items named": 0.95, "3-digit numbers read": 0.95,
              "items counted": 1.0, **NANO}  # fmt: skip
    return values | {k.replace("_", " "): v for k, v in changes.items()}


def comparison(**z) -> dict:
    "Paired comparisons with a standard error of 0.01 and differences of z of them"
    return {m.replace("_", " "): {"new": 0.5 + 0.01 * v, "old": 0.5,
                                   "difference": 0.01 * v, "standard error": 0.01}
            for m, v in z.items()}  # fmt: skip


# --- the paired jackknife ---


def test_with_one_example_a_group_the_jackknife_is_the_paired_standard_error():
    "For a mean, the delete-one jackknife equals sd(differences) / sqrt(n) exactly"
    new = [{"k": i, "x": (i * 7) % 5 / 4} for i in range(40)]
    old = [{"k": i, "x": (i * 3) % 4 / 3} for i in range(40)]

    def mean_x(rows):
        return {"x": sum(r["x"] for r in rows) / len(rows)}

    got = ship_rules.paired_jackknife(new, old, mean_x, lambda r: r["k"], groups=40)
    diffs = [a["x"] - b["x"] for a, b in zip(new, old)]
    assert got["x"]["difference"] == pytest.approx(statistics.mean(diffs))
    assert got["x"]["standard error"] == pytest.approx(
        statistics.stdev(diffs) / 40**0.5,
        rel=1e-9,  # float64 sums of 40: 1e-9 is slack
    )


def test_the_two_models_must_answer_the_same_examples():
    rows = [{"k": i, "x": 1.0} for i in range(40)]
    with pytest.raises(ValueError, match="same examples"):
        ship_rules.paired_jackknife(
            rows, rows[1:] + rows[:1], lambda r: {"x": 1.0}, lambda r: r["k"]
        )


def test_a_scene_asked_three_questions_is_one_unit():
    "Rows of one cluster never straddle groups: 30 scenes of 3 rows, 30 groups"
    rows = [{"seed": s, "task": t, "x": float(s % 2)} for s in range(30)
            for t in range(3)]  # fmt: skip
    seen = []

    def spy(rows):
        seen.append({r["seed"] for r in rows})
        return {"x": 0.0}

    ship_rules.paired_jackknife(
        rows, rows, spy, lambda r: (r["seed"], r["task"]), lambda r: r["seed"]
    )
    left_out = [set(range(30)) - s for s in seen[2::2]]  # new's, each group out
    assert all(len(out) == 1 for out in left_out), left_out


# --- the decision ---


def test_a_rise_of_more_than_two_standard_errors_ships():
    assert ship_rules.decide(comparison(mIoU=2.5), ["mIoU"])["ships"] is True
    assert ship_rules.decide(comparison(mIoU=1.9), ["mIoU"])["ships"] is False
    assert ship_rules.decide(comparison(mIoU=0), ["mIoU"])["ships"] is False


def test_a_fall_never_ships():
    "Planted: the threshold negated (`> -2 * se`) would ship a worse adapter"
    assert ship_rules.decide(comparison(mIoU=-3), ["mIoU"])["ships"] is False
    assert ship_rules.decide(comparison(mIoU=-1), ["mIoU"])["ships"] is False


def test_no_measure_may_fall_by_more_than_its_own_two_standard_errors():
    falls = ship_rules.decide(comparison(mIoU=5, box=-2.1), ["mIoU"])
    assert falls["ships"] is False and falls["falls"] == ["box"]
    assert ship_rules.decide(comparison(mIoU=5, box=-1.9), ["mIoU"])["ships"]


def real_rows() -> list:
    "The shipped nano-real's graded answers (its test record), as a validation run"
    path = ROOT / "paligemma_lib/assets/real/real-after-gpu-20261126-1339.json"
    return json.loads(path.read_text())["rows"]


def test_the_issues_case_does_not_ship():
    """One more item named (1 in 251), but three-digit numbers 0.94 -> 0.78 and
    boxes wrecked: the old worst-shortfall rule shipped that; this one does not"""
    old = real_rows()
    new = copy.deepcopy(old)
    captions = [
        r for r in new if r["world"] == "clothing" and r["prompt"] == "caption en"
    ]
    miss = next(r for r in captions if r["prediction"] != r["answer"])
    miss["prediction"] = miss["answer"]
    three = [r for r in new if r["world"] == "handwriting" and len(r["answer"]) == 3]
    for r in [r for r in three if r["prediction"] == r["answer"]][:5]:
        r["prediction"] = r["answer"][::-1] + "0"  # 5 of 77 more numbers misread
    for r in new:
        if r["world"] == "clothing" and r["prompt"].startswith("detect"):
            r["prediction"] = "<loc0000><loc0000><loc0100><loc0100> shirt"
    nano = {k: 0.0 for k in ship_rules.KEPT}
    decision = ship_rules.real_decision(new, old, nano)
    named = decision["paired"]["items named"]
    assert named["difference"] > 0  # the aim rose, a little
    assert decision["ships"] is False
    assert "item boxes, mean IoU" in decision["falls"]
    assert "3-digit numbers read" in decision["falls"]


def test_a_model_better_by_far_on_its_aims_ships():
    "The shipped model against the CPU hour's on the same examples: it ships"
    hour = json.loads(
        (ROOT / "paligemma_lib/assets/real/real-cpu-hour-2026-11-26.json").read_text()
    )["rows"]
    decision = ship_rules.real_decision(real_rows(), hour, measured())
    assert decision["ships"] is True and not decision["falls"]
    assert "items named" in decision["rises"]


# --- chapter 12.2's goals ---


def test_a_model_that_meets_every_goal_falls_short_nowhere():
    short = ship_rules.shortfalls(measured(), NANO)
    assert set(short) == set(ship_rules.GOALS) | set(ship_rules.KEPT)
    assert all(v == 0 for v in short.values()), short


def test_each_goal_is_met_at_its_threshold_and_missed_by_the_gap():
    assert ship_rules.GOALS == {"items named": 0.90, "3-digit numbers read": 0.90,
                                "items counted": 0.97}  # fmt: skip
    met = measured(**{"items named": 0.90, "3-digit numbers read": 0.90,
                      "items counted": 0.97})  # fmt: skip
    assert max(ship_rules.shortfalls(met, NANO).values()) == 0
    short = ship_rules.shortfalls(measured(**{"items named": 0.82}), NANO)
    assert short["items named"] == pytest.approx(0.08)
    assert ship_rules.KEPT_LOSS == 0.02
    kept = ship_rules.shortfalls(measured(**{"ch. 11 text read": 0.80}), NANO)
    assert kept["ch. 11 text read"] == pytest.approx(0.065)


def test_the_goals_are_measures_the_grading_reports():
    from paligemma_lib.real_images import measures

    source = inspect.getsource(measures)
    for name in [*ship_rules.GOALS, *ship_rules.KEPT]:
        assert f'"{name}":' in source, name


# --- the ledger ---


@pytest.fixture
def ledger(tmp_path) -> Path:
    "A copy of the shipped ledger"
    path = tmp_path / "ledger.json"
    path.write_text(ship_rules.LEDGER.read_text())
    return path


def test_a_test_range_is_spent_once(ledger):
    fresh = ship_rules.fresh_start(ship_rules.read_ledger(ledger), ["segments"])
    with pytest.raises(ValueError, match=f"graded before.*grade from {fresh} on"):
        ship_rules.spend(ledger, "segments", fresh - 100, 300, "me", "a try")
    entry = ship_rules.spend(ledger, "segments", fresh, 300, "me", "a try")
    assert (entry["start"], entry["stop"]) == (fresh, fresh + 299)
    with pytest.raises(ValueError, match="graded before"):
        ship_rules.spend(ledger, "segments", fresh + 299, 1, "me", "again")
    ship_rules.spend(ledger, "clothing", fresh, 300, "me", "another world")


def test_the_ledger_holds_the_test_scenes_that_chose_or_graded():
    "The history as it happened: segments 1000-2499, the real worlds' first ones"
    book = ship_rules.read_ledger()
    assert ship_rules.fresh_start(book, ["segments"]) == 2500
    for world, stop in [("clothing", 406), ("handwriting", 599), ("shapes", 5299),
                        ("ocr", 5299), ("receipts", 5299)]:  # fmt: skip
        assert ship_rules.fresh_start(book, [world]) == stop + 1, world
    for entry in book["test ranges spent"]:
        assert entry["start"] <= entry["stop"] and entry["by"] and entry["for"]
    # the ranges that chose (nano's learning rate, the receipts adapter's targets)
    for world, stop in [("shapes", 479), ("ocr", 199), ("receipts", 199)]:
        assert ship_rules.overlapping(book, world, 0, stop), world


def reads_test(value) -> bool:
    """Whether a record (parsed JSON) holds a grade on a world's test split: a
    "split": "test", an "evaluations" key naming test, or "<world> test a-b"."""
    if isinstance(value, dict):
        if value.get("split") == "test":
            return True
        if any("test" in key for key in value.get("evaluations", {})):
            return True
        return any(reads_test(v) for v in value.values())
    if isinstance(value, list):
        return any(reads_test(v) for v in value)
    return isinstance(value, str) and re.fullmatch(r"[a-z]+ test \d+-\d+", value)


def test_every_record_that_read_test_is_in_the_ledger():
    """A grade on test, shipped or not, is named by a ledger entry: otherwise
    fresh_start would hand its examples to the next grade as unseen"""
    # the record files each entry names, exactly (a substring would let a path that
    # is part of another's pass)
    named = {
        path
        for e in ship_rules.read_ledger()["test ranges spent"]
        for path in re.findall(r"[\w./-]+\.json", e["by"])
    }
    folders = [ROOT / "benchmarks/results", ROOT / "paligemma_lib/assets"]
    records = [p for folder in folders for p in sorted(folder.rglob("*.json"))]
    assert len(records) > 20  # the folders were found
    missing = [
        str(path.relative_to(ROOT))
        for path in records
        if path != ship_rules.LEDGER
        and path.parent.name != "mask_vae"  # its own seeds, no world's test split
        and reads_test(json.loads(path.read_text()))
        and str(path.relative_to(ROOT)) not in named
    ]
    assert not missing, f"records that graded test, not in the ledger: {missing}"


# --- the segment ingest, whole, with a fake grader ---


def fake_segment_grader(calls: list, quality: dict):
    """evaluate(folder, split, start, n) with rows whose IoUs are quality[folder
    name] plus a scene's own wobble; every call recorded"""

    def evaluate(folder, split, start, n):
        from paligemma_lib.segment_eval import summarize

        calls.append((Path(folder).name, split, start, n))
        q = quality[Path(folder).name]
        rows = []
        for i in range(start, start + n):
            iou = min(1.0, max(0.0, q + 0.2 * ((i * 37) % 11 - 5) / 5))
            grades = {"model": [iou], "filled box": [0.4], "class mask": [0.5],
                      "invalid": 0}  # fmt: skip
            kind = ("circle", "square", "triangle")[i % 3]
            rows.append({"seed": i, "prompt": f"segment {kind}", "grades": grades})
        kinds = [r["prompt"].split()[-1] for r in rows]
        metrics = summarize(kinds, [r["grades"] for r in rows])
        return {"rows": rows, "metrics": metrics, "indices": [start, start + n - 1]}

    return evaluate


def adapter_tar(tmp_path: Path) -> Path:
    folder = tmp_path / "returned"
    folder.mkdir()
    for name in gpu_ingest.SEGMENT_FILES:
        (folder / name).write_text(f"new {name}")
    (folder / "training_record.json").write_text('{"steps": 1}')
    tar = tmp_path / "segment-adapter.tar"
    with tarfile.open(tar, "w") as archive:
        for path in folder.iterdir():
            archive.add(path, arcname=path.name)
    return tar


@pytest.fixture
def shipped(tmp_path) -> Path:
    folder = tmp_path / "shipped"
    folder.mkdir()
    for name in gpu_ingest.SEGMENT_FILES:
        (folder / name).write_text(f"old {name}")
    (folder / "training_record.json").write_text("{}")
    return folder


def ingest_segment(tmp_path, shipped, ledger, new_quality, stamp="20270101-0000"):
    calls = []
    grader = fake_segment_grader(calls, {"segment": new_quality, "shipped": 0.6})
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    record = gpu_ingest.ship_segment(
        adapter_tar(tmp_path), stamp, evaluate=grader, shipped=shipped,
        ledger=ledger, results=results,
    )  # fmt: skip
    return record, calls


def test_a_better_adapter_is_chosen_on_validation_then_graded_once_on_fresh_test(
    tmp_path, shipped, ledger
):
    before = ship_rules.read_ledger(ledger)
    record, calls = ingest_segment(tmp_path, shipped, ledger, 0.7)
    assert record["ships"] is True
    new, old, test = calls  # two validation grades, then one of test
    assert new[1:] == old[1:]  # the same scenes, both adapters
    assert (new[0], old[0]) == ("segment", "shipped")
    assert new[1] == "validation" and new[2:] == gpu_ingest.SEGMENT_SHIP_SCENES
    # the new adapter, graded where it was unpacked, before the package changes
    assert test[:2] == ("segment", "test")
    start, n = test[2:]
    assert not ship_rules.overlapping(before, "segments", start, start + n - 1)
    after = ship_rules.read_ledger(ledger)
    assert after["test ranges spent"][-1]["start"] == start
    assert after["ship decisions"][-1]["ships"] is True
    assert (shipped / "adapter_model.safetensors").read_text().startswith("new")
    graded = json.loads((shipped / "training_record.json").read_text())
    assert graded["evaluations"]["segments/test"]["indices"] == [start, start + n - 1]


def test_a_try_is_decided_once(tmp_path, shipped, ledger):
    """An ingest run twice on the same folder is refused before any grade: it would
    overwrite the record the first decision names"""
    ingest_segment(tmp_path, shipped, ledger, 0.6)
    decided = ledger.read_text()
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(ValueError, match="decided before"):
        ingest_segment(again, shipped, ledger, 0.7)
    assert ledger.read_text() == decided


def test_a_test_grade_that_fails_leaves_the_package_as_it_was(
    tmp_path, shipped, ledger
):
    "The test grade comes before the copy: a crash there ships nothing half-way"
    calls = []
    grader = fake_segment_grader(calls, {"segment": 0.7, "shipped": 0.6})

    def failing(folder, split, start, n):
        if split == "test":
            raise RuntimeError("the grade crashed")
        return grader(folder, split, start, n)

    with pytest.raises(RuntimeError):
        gpu_ingest.ship_segment(
            adapter_tar(tmp_path), "20270101-0000", evaluate=failing,
            shipped=shipped, ledger=ledger, results=tmp_path,
        )  # fmt: skip
    assert (shipped / "adapter_model.safetensors").read_text().startswith("old")
    assert ship_rules.read_ledger(ledger)["test ranges spent"][-1]["by"]  # spent


def test_an_adapter_no_better_reads_no_test_scene_and_stays_out(
    tmp_path, shipped, ledger
):
    before = ledger.read_text()
    record, calls = ingest_segment(tmp_path, shipped, ledger, 0.6)
    assert record["ships"] is False
    assert [c[1] for c in calls] == ["validation", "validation"]
    assert (shipped / "adapter_model.safetensors").read_text().startswith("old")
    after = ship_rules.read_ledger(ledger)
    assert after["test ranges spent"] == json.loads(before)["test ranges spent"]
    assert after["ship decisions"][-1]["ships"] is False


def test_a_second_ship_grades_test_scenes_after_the_first(tmp_path, shipped, ledger):
    "Planted: a start that reuses the shipped adapter's scenes is refused"
    _, first = ingest_segment(tmp_path, shipped, ledger, 0.7)
    (tmp_path / "returned").rename(tmp_path / "returned-1")
    _, second = ingest_segment(tmp_path, shipped, ledger, 0.8, "20270102-0000")
    one, two = first[-1][2], second[-1][2]
    assert two >= one + gpu_ingest.SEGMENT_TEST_SCENES


# --- the nano-real ingest, whole, with a fake grader ---


def fake_real_grader(calls: list, rows_of: dict):
    def evaluate(n, split, old=0, model="nano", start=0):
        name = model if isinstance(model, str) else "new"
        calls.append((name, split, start))
        return {"rows": rows_of[name], "command": f"evaluate {model}",
                "commit": "x", "model_sha256": name}  # fmt: skip

    return evaluate


def ingest_real(tmp_path, ledger, new_rows):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "training_record.json").write_text(json.dumps(
        {"steps": 1, "seconds": 1, "train_config": {"batch_size": 2},
         "worlds": {}, "device": "cpu"}))  # fmt: skip
    hour = json.loads(
        (ROOT / "paligemma_lib/assets/real/real-cpu-hour-2026-11-26.json").read_text()
    )["rows"]
    calls, shipped = [], []
    grader = fake_real_grader(calls, {"new": new_rows, "nano-real": hour, "nano": hour})
    records = tmp_path / "records"
    records.mkdir(exist_ok=True)
    record = gpu_ingest.ship_real(
        model, "20270101-0000", evaluate=grader, ship=shipped.append,
        ledger=ledger, records=records,
    )  # fmt: skip
    return record, calls, shipped


def test_nano_real_is_chosen_on_validation_and_graded_once_after(tmp_path, ledger):
    "Planted: choosing on 'test' fails here"
    before = ship_rules.read_ledger(ledger)
    record, calls, shipped = ingest_real(tmp_path, ledger, real_rows())
    assert record["ships"] is True and len(shipped) == 1
    *choice, test = calls
    assert {c[1] for c in choice} == {"validation"}
    assert {c[0] for c in choice} == {"new", "nano-real", "nano"}
    # the new model, graded where it was unpacked, before the package changes
    assert test[:2] == ("new", "test")
    assert test[2] == ship_rules.fresh_start(before, gpu_ingest.REAL_TEST_WORLDS)
    for world, n in gpu_ingest.REAL_TEST_WORLDS.items():
        assert not ship_rules.overlapping(before, world, test[2], test[2] + n - 1)
    new_entries = ship_rules.read_ledger(ledger)["test ranges spent"][
        len(before["test ranges spent"]) :
    ]
    # the ranges spent are the ranges graded, world by world
    assert {(e["world"], e["start"], e["stop"]) for e in new_entries} == {
        (world, test[2], test[2] + n - 1)
        for world, n in gpu_ingest.REAL_TEST_WORLDS.items()
    }


def test_the_test_ranges_spent_are_the_examples_graded():
    from evaluate_real_gap import test_sizes

    assert gpu_ingest.REAL_TEST_WORLDS == test_sizes(
        gpu_ingest.REAL_N, gpu_ingest.REAL_OLD
    )


def test_the_graders_refuse_a_test_range_spent(tmp_path, monkeypatch):
    "tools/evaluate_segment.py and evaluate_real_gap.py spend through the ledger"
    import evaluate_real_gap
    import evaluate_segment

    for module in (evaluate_segment, evaluate_real_gap):
        monkeypatch.setattr(module, "LEDGER", ship_rules.LEDGER)  # never written
        monkeypatch.setattr(module, "evaluate", lambda *a, **k: pytest.fail("graded"))
    monkeypatch.setattr(sys, "argv", ["x", "--start", "1000", "--split", "test"])
    with pytest.raises(ValueError, match="graded before"):
        evaluate_segment.main()
    with pytest.raises(ValueError, match="graded before"):
        evaluate_real_gap.main(["--split", "test", "--start", "0"])


def test_a_validation_grade_leaves_the_shipped_record_and_other_records(
    tmp_path, monkeypatch
):
    """A dry run on validation writes its own record, named for its split, and no
    other: not the shipped adapter's record, not a test record of the same day"""
    import evaluate_segment

    from paligemma_lib.adapters import resolve_adapter_path

    shipped = resolve_adapter_path("segment") / "training_record.json"
    before = shipped.read_bytes()
    grade = {"metrics": {"mIoU": 0.5}, "indices": [0, 1]}
    monkeypatch.setattr(evaluate_segment, "evaluate", lambda *a, **k: grade)
    monkeypatch.setattr(evaluate_segment, "ROOT", tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    monkeypatch.setattr(sys, "argv", ["x", "--split", "validation", "--n", "2"])
    evaluate_segment.main()
    assert shipped.read_bytes() == before
    [written] = (tmp_path / "benchmarks" / "results").iterdir()
    assert written.name.startswith("segment-validation-")
    with pytest.raises(SystemExit):  # the same day again: refused, not overwritten
        evaluate_segment.main()


def test_nano_real_no_better_is_not_shipped_nor_tested(tmp_path, ledger):
    hour = json.loads(
        (ROOT / "paligemma_lib/assets/real/real-cpu-hour-2026-11-26.json").read_text()
    )["rows"]
    record, calls, shipped = ingest_real(tmp_path, ledger, hour)
    assert record["ships"] is False and shipped == []
    assert {c[1] for c in calls} == {"validation"}
