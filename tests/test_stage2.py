"""nano's stage 2 (issue 52): chapter 11.4's detail world, the character error rate
it is graded by, tools/gpu_stage2.py (gpu_run.py's part `stage2`, rehearsed here on
the CPU) and the decision that ships nano-448 (tools/ship_rules.py, gpu_ingest.py),
on planted cases and a copy of the ledger; nothing under paligemma_lib/assets is
written."""

import functools
import hashlib
import io
import json
import random
import string
import sys
import tarfile
from pathlib import Path

import pytest

import paligemma_lib.small_detail as detail
from paligemma_lib.data import KINDS, MARGIN, OCR_ALPHABET, SyntheticDataset, box_gap
from paligemma_lib.evaluation import character_error_rate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_ingest  # noqa: E402
import gpu_run  # noqa: E402
import gpu_stage2  # noqa: E402
import ship_rules  # noqa: E402

# --- the detail world ---


def test_the_detail_world_draws_small_things_on_448():
    data = SyntheticDataset("detail", "validation", size=60)
    tasks = set()
    for i in range(len(data)):
        e = data.example(i)
        tasks.add(e.task)
        assert e.world == "detail" and e.image.size == (448, 448)
        assert all(MARGIN <= min(b) and max(b) <= 448 - MARGIN for b in e.boxes)
        if e.task == "ocr":
            assert e.prompt == "ocr" and e.answer == e.text
            assert set(e.answer) <= set(OCR_ALPHABET + ". ")
            height = e.boxes[0][3] - e.boxes[0][1]
            assert 5 <= height <= 9, height  # a few pixels: capitals 7-8 px
        else:
            kind = e.prompt.split()[-3].removesuffix("s")
            assert kind in KINDS
            asked = [label for label in e.labels if label.endswith(kind)]
            assert e.answer == str(len(asked)) and len(asked) >= 1
            low, high = detail.DETAIL_SHAPES
            assert low <= len(e.boxes) <= high
            sides = {b[2] - b[0] for b in e.boxes} | {b[3] - b[1] for b in e.boxes}
            assert sides <= set(range(6, 11))
            assert all(
                box_gap(a, b) >= detail.DETAIL_GAP
                for i, a in enumerate(e.boxes)
                for b in e.boxes[:i]
            )
    assert tasks == {"ocr", "count"}


def test_an_example_is_the_same_every_time_and_a_task_can_be_asked():
    one, two = (SyntheticDataset("detail", "test", size=5) for _ in range(2))
    for i in range(5):
        a, b = one.example(i), two.example(i)
        assert a.answer == b.answer and a.image.tobytes() == b.image.tobytes()
    for task in detail.DETAIL_TASKS:
        asked = SyntheticDataset("detail", "test", size=8, task=task)
        assert {asked.example(i).task for i in range(8)} == {task}


# The SHA-256 of the raw pixels of two lines of text and a scene of shapes, computed
# with Pillow 12.3.0 and FreeType 2.14.3 (Python 3.11), as tests/test_data.py pins
# chapter 11's: an upgrade may change the text's edges; then look, and update them.
PIXELS = {
    0: "3a5918245401db97e1b00971f402dcabce045de34548b54c7b45044eaae11cb9",
    2: "4e5ecca2910e36473efdd6d03b48022f63f75233f8abb2d9823327e7f01ef6c9",
    10**9 + 10**4: "435988541394c9b75e953d1c513dfebc6a158c886ddc82388f242964b592ee9a",
}


def test_the_detail_worlds_pixels_are_pinned():
    from paligemma_lib.data import make_example

    for seed, expected in PIXELS.items():
        pixels = make_example("detail", seed).image.tobytes()
        assert hashlib.sha256(pixels).hexdigest() == expected, seed
    assert make_example("detail", 2).task == "count"


def test_the_detail_world_has_seeds_of_its_own():
    from paligemma_lib.data import SEEDS_PER_WORLD, WORLD_OFFSETS

    assert WORLD_OFFSETS["detail"] == 103 * SEEDS_PER_WORLD
    others = [o for w, o in WORLD_OFFSETS.items() if w != "detail"]
    assert all(abs(o - WORLD_OFFSETS["detail"]) >= SEEDS_PER_WORLD for o in others)


def test_the_train_command_knows_the_world():
    from paligemma_lib.cli.options import import_data, parse_worlds

    assert "detail" in import_data().WORLD_OFFSETS
    assert parse_worlds(gpu_stage2.WORLDS) == {"detail": 0.5, "shapes": 0.3, "ocr": 0.2}


# --- the character error rate, against the edit distance written out ---


def edit_distance(a: str, b: str) -> int:
    "The fewest insertions, deletions and substitutions, by its recursion"

    @functools.cache
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(
            d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1])
        )

    return d(len(a), len(b))


def test_the_character_error_rate_is_edits_over_reference_characters():
    rng = random.Random(0)
    letters = "AB1. "

    def word():
        return "".join(rng.choice(letters) for _ in range(rng.randint(0, 9)))

    for _ in range(50):
        refs = [word() + "X" for _ in range(rng.randint(1, 4))]  # never empty
        preds = [word() for _ in refs]
        edits = sum(edit_distance(p, r) for p, r in zip(preds, refs))
        expected = edits / sum(len(r) for r in refs)
        assert character_error_rate(preds, refs) == expected  # integers divided once
    assert character_error_rate(["", "AB"], ["AB", "AB"]) == 0.5
    assert character_error_rate(["ABCD"], ["A"]) == 3.0  # insertions count: above 1


# --- the decision, on planted rows ---

N = 60  # rows a task: 30 groups need 30 examples


def planted(text_wrong, caption_wrong=0, count_right=0.5, seed=0) -> list:
    """Graded rows of every world and task; `text_wrong(i)` characters of detail
    line i (8 long) wrong, or None for no answer; caption i wrong when i %
    caption_wrong == 0 (0: never)"""
    rng, rows = random.Random(seed), []

    def row(world, task, i, answer, prediction):
        rows.append({"world": world, "task": task, "index": i, "prompt": task,
                     "answer": answer, "prediction": prediction})  # fmt: skip

    box = "<loc0100><loc0100><loc0500><loc0500> circle"
    for i in range(N):
        line = "".join(rng.choice(string.ascii_uppercase) for _ in range(8))
        wrong = text_wrong(i)
        read = "" if wrong is None else "#" * wrong + line[wrong:]
        row("detail", "ocr", i, line, read)
        counted = random.Random(N + i).random() < count_right
        row("detail", "count", i, "3", "3" if counted else "1")
        captioned = not (caption_wrong and i % caption_wrong == 0)
        row(
            "shapes", "caption", i, "a red circle", "a red circle" if captioned else "x"
        )
        row("shapes", "detect", i, box, box)
        row("ocr", "ocr", i, "AB12", "AB12")
    return rows


NANO = planted(lambda i: None)  # nano at 224 reads nothing of the small text


def wrong(low: int, high: int):
    "Line i: low to high characters wrong, as a generator of its own draws"
    return lambda i: random.Random(i).randint(low, high)


def test_the_measures_read_each_world_and_task():
    m = ship_rules.stage2_measures(planted(lambda i: i % 2))
    assert m[ship_rules.SMALL_TEXT] == pytest.approx(1 - 30 / (8 * N))
    assert m["small text read"] == 0.5
    assert m["ch. 11 shapes captioned"] == 1 and m["ch. 11 text read"] == 1
    assert m["ch. 11 boxes, IoU >= 0.5"] == 1
    assert ship_rules.stage2_measures(NANO)[ship_rules.SMALL_TEXT] == 0


def test_the_goals_are_half_the_cer_and_chapter_11_within_two_points():
    nano = {ship_rules.SMALL_TEXT: 0.2} | {k: 0.9 for k in ship_rules.STAGE2_KEPT}
    met = {ship_rules.SMALL_TEXT: 0.6} | {k: 0.88 for k in ship_rules.STAGE2_KEPT}
    assert not any(ship_rules.stage2_shortfalls(met, nano).values())  # CER 0.4
    short = ship_rules.stage2_shortfalls(met | {ship_rules.SMALL_TEXT: 0.5}, nano)
    assert short["small text CER"] == pytest.approx(0.1)  # 0.5 against 0.4
    dropped = met | {"ch. 11 text read": 0.87}
    assert ship_rules.stage2_shortfalls(dropped, nano)["ch. 11 text read"] == 0.01


def test_a_model_that_meets_the_goals_and_reads_better_ships():
    new = planted(wrong(0, 2))  # CER about 1/8
    decision = ship_rules.stage2_decision(new, NANO)
    assert decision["meets the goals"] and decision["ships"]
    assert decision["rises"] == [ship_rules.SMALL_TEXT] and not decision["falls"]


def test_better_by_far_but_short_of_half_the_cer_does_not_ship():
    "CER about 5/8 against nano's 1: a rise of many standard errors, the goal missed"
    new = planted(wrong(4, 6))
    decision = ship_rules.stage2_decision(new, NANO)
    assert decision["rises"] == [ship_rules.SMALL_TEXT]
    assert decision["shortfalls"]["small text CER"] > 0
    assert decision["ships"] is False


def test_a_chapter_11_skill_lost_does_not_ship():
    "Small text read well, but one caption in ten lost (0.10 > 0.02)"
    new = planted(wrong(0, 2), caption_wrong=10)
    decision = ship_rules.stage2_decision(new, NANO)
    assert decision["shortfalls"]["ch. 11 shapes captioned"] > 0
    assert decision["ships"] is False


def test_a_measure_that_falls_by_its_margin_does_not_ship():
    "Goals met, but the small shapes counted fall far: no measure may"
    new = planted(wrong(0, 2), count_right=0.1)
    decision = ship_rules.stage2_decision(new, planted(lambda i: None, count_right=0.9))
    assert decision["meets the goals"] and "small shapes counted" in decision["falls"]
    assert decision["ships"] is False


def test_a_later_model_must_beat_the_shipped_nano_448():
    good = planted(wrong(0, 2))
    decision = ship_rules.stage2_decision(good, NANO, shipped_rows=good)
    assert decision["meets the goals"] and not decision["ships"]
    better = planted(wrong(0, 1))
    assert ship_rules.stage2_decision(better, NANO, shipped_rows=good)["ships"]


# --- the ingest, whole, with a fake grader and a copy of the ledger ---


@pytest.fixture
def ledger(tmp_path) -> Path:
    path = tmp_path / "ledger.json"
    path.write_text(ship_rules.LEDGER.read_text())
    return path


def returned(tmp_path: Path, control=True, device="cuda: NVIDIA H200",
             segments=((0, 2),)) -> dict:  # fmt: skip
    "The models a run sent back: folders with a training record"
    models = {}
    for name in ("448", "224") if control else ("448",):
        folder = tmp_path / "back" / name
        folder.mkdir(parents=True)
        starts = [{"steps": list(s), "processes": 1} for s in segments]
        (folder / "training_record.json").write_text(json.dumps(
            {"steps": 2, "seconds": 1, "train_config": {"batch_size": 2, "lr": 5e-4},
             "worlds": {"detail": 0.5}, "device": device,
             "segments": starts}))  # fmt: skip
        models[name] = folder
    return models


def fake_grader(calls: list, rows_of: dict):
    "grade(source, size, split, start, sizes), every call recorded"

    def grade(source, size, split, start, sizes):
        name = Path(source).name if str(source) != "nano" else f"nano@{size}"
        calls.append((name, size, split, start))
        rows = rows_of[name]
        return {"rows": rows, "measures": ship_rules.stage2_measures(rows),
                "model_sha256": name}  # fmt: skip

    return grade


def ingest(tmp_path, ledger, new_rows, shipped=None, test_start=None):
    calls, shipped_models = [], []
    models = returned(tmp_path)
    shipped = shipped or tmp_path / "nano-448"  # none shipped yet
    rows = {"nano@224": NANO, "nano@448": NANO, "448": new_rows, "224": NANO,
            shipped.name: new_rows}  # fmt: skip
    records = tmp_path / "records"
    record = gpu_ingest.ship_stage2(
        models, "20270101-0000", grade=fake_grader(calls, rows),
        ship=shipped_models.append, ledger=ledger, records=records,
        shipped=shipped, test_start=test_start,
    )  # fmt: skip
    return record, calls, shipped_models, records


def test_nano_448_is_chosen_on_validation_and_graded_once_after(tmp_path, ledger):
    before = ship_rules.read_ledger(ledger)
    record, calls, shipped, records = ingest(tmp_path, ledger, planted(wrong(0, 2)))
    assert record["ships"] is True and len(shipped) == 1
    assert (record["trained"]["starts"], record["trained"]["seconds"]) == (1, 1)
    *choice, test_new, test_nano = calls
    assert {c[2:] for c in choice} == {("validation", 0)}  # the same examples
    assert {c[:2] for c in choice} == {("nano@224", 224), ("nano@448", 448),
                                       ("448", 448), ("224", 224)}  # fmt: skip
    # the new model, graded where it was unpacked, before the package changes
    assert [c[:3] for c in (test_new, test_nano)] == [
        ("448", 448, "test"), ("nano@224", 224, "test")]  # fmt: skip
    start = test_new[3]
    sizes = gpu_ingest.STAGE2_SIZES
    assert start == ship_rules.fresh_start(before, sizes)
    for world, n in sizes.items():
        assert not ship_rules.overlapping(before, world, start, start + n - 1)
    after = ship_rules.read_ledger(ledger)
    new_entries = after["test ranges spent"][len(before["test ranges spent"]) :]
    # the ranges spent are the ranges graded, world by world
    assert {(e["world"], e["start"], e["stop"]) for e in new_entries} == {
        (world, start, start + n - 1) for world, n in sizes.items()
    }
    assert {c[3] for c in (test_new, test_nano)} == {start}  # both from there
    assert after["ship decisions"][-1]["model"] == "nano-448"
    saved = json.loads(
        (records / "stage2-gpu-validation-20270101-0000.json").read_text()
    )
    assert set(saved["measures"]) == {"nano at 224", "nano at 448, untrained",
                                      "new at 448", "control at 224"}  # fmt: skip
    assert (records / record["test record"]).exists()


def test_a_model_that_misses_a_goal_is_neither_shipped_nor_tested(tmp_path, ledger):
    before = ledger.read_text()
    record, calls, shipped, _ = ingest(tmp_path, ledger, planted(wrong(4, 6)))
    assert record["ships"] is False and shipped == []
    assert {c[2] for c in calls} == {"validation"}
    after = ship_rules.read_ledger(ledger)
    assert after["test ranges spent"] == json.loads(before)["test ranges spent"]
    assert after["ship decisions"][-1]["ships"] is False


def test_a_spent_test_range_is_refused_before_anything_ships(tmp_path, ledger):
    "Planted: test from index 0, which chapter 12.2's grade of shapes and ocr spent"
    before = ship_rules.read_ledger(ledger)["test ranges spent"]
    with pytest.raises(ValueError, match="graded before"):
        ingest(tmp_path, ledger, planted(wrong(0, 2)), test_start=0)
    assert ship_rules.read_ledger(ledger)["test ranges spent"] == before


def test_a_shipped_nano_448_is_graded_beside_and_must_be_beaten(tmp_path, ledger):
    shipped = tmp_path / "shipped-448"
    shipped.mkdir()
    (shipped / "model.safetensors").write_bytes(b"")
    record, calls, models, _ = ingest(
        tmp_path, ledger, planted(wrong(0, 2)), shipped=shipped
    )
    assert ("shipped-448", 448, "validation", 0) in calls
    assert record["ships"] is False and models == []  # no better than itself


# --- the part: its hooks in gpu_run.py, its tar, its rehearsal ---


def test_stage2_is_a_part_a_plain_run_leaves_out():
    assert "stage2" in gpu_run.PARTS and "stage2" not in gpu_run.DEFAULT_PARTS
    assert gpu_run.PART_FUNCTIONS["stage2"] is gpu_stage2.stage2
    assert "stage2" in gpu_run.ALONE
    assert gpu_run.INSTALL + gpu_run.BUDGETS["stage2"] <= gpu_run.CALL
    assert len(gpu_run.call_files(["stage2"])) <= 8


def test_check_output_wants_the_models_first_piece(tmp_path):
    record = {"environment": {"commit": "abc"}, "parts": {"stage2": {}},
              "started": "2027-01-01T00:00:00",
              "finished": "2027-01-01T00:09:00"}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(record))
    assert "stage2 wrote no stage2-models.tar.0" in gpu_run.check_output(
        tmp_path, ["stage2"]
    )
    (tmp_path / "stage2-models.tar.0").write_bytes(b"")
    assert gpu_run.check_output(tmp_path, ["stage2"]) == []


def test_two_models_fit_the_pieces_that_come_back():
    "Two nano models at their size (448's table is larger) in at most PIECES"
    nano = ROOT / "paligemma_lib" / "assets" / "nano"
    sizes = [(nano / name).stat().st_size for name in gpu_stage2.MODEL_FILES]
    table = (28 * 28 - 14 * 14) * 192 * 4  # the positions added at 448, float32
    tar_size = 2 * sum(512 + -(-s // 512) * 512 for s in sizes) + table + 10240
    assert tar_size <= gpu_stage2.PIECES * gpu_stage2.PIECE


def test_the_models_come_back_by_size_from_their_pieces(tmp_path):
    tar = tmp_path / gpu_stage2.TAR
    with tarfile.open(tar, "w") as archive:
        for size in ("448", "224"):
            data = (size * 999).encode()
            info = tarfile.TarInfo(f"{size}/model.safetensors")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    out.mkdir()
    names = gpu_stage2.split_file(tar, out / gpu_stage2.TAR, size=1000)
    models = gpu_stage2.unpack_models(out / names[0], tmp_path / "unpacked")
    assert sorted(models) == ["224", "448"]
    assert (models["448"] / "model.safetensors").read_bytes() == b"448" * 999


def test_grade_resamples_a_model_to_the_size_asked():
    "nano at 448: 784 image tokens; its rows name world, task and index"
    graded = gpu_stage2.grade(
        "nano", 448, "validation", 0, {"detail": 1, "shapes": 1, "ocr": 1}
    )
    assert (graded["trained at"], graded["graded at"]) == (224, 448)
    keys = [(r["world"], r["task"], r["index"]) for r in graded["rows"]]
    assert keys == [("detail", "ocr", 0), ("detail", "count", 0),
                    ("shapes", "caption", 0), ("shapes", "detect", 0),
                    ("ocr", "ocr", 0)]  # fmt: skip
    measures = {ship_rules.SMALL_TEXT, "small text read", "small shapes counted"}
    assert set(graded["measures"]) == measures | set(ship_rules.KEPT)


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    "The part on the CPU, tiny: nano at 448 and the control at 224, 2 steps each"
    out = tmp_path_factory.mktemp("stage2")
    run = gpu_run.Run(out / "out", rehearse=True)
    result = gpu_stage2.stage2(run, gpu_run.REHEARSAL_BUDGETS["stage2"])
    models = None
    if "pieces" in result:
        first = run.out / result["pieces"][0]
        models = gpu_stage2.unpack_models(first, out / "back")
    return result, models


def test_the_part_rehearsed_trains_both_and_sends_them_back(rehearsed):
    result, models = rehearsed
    assert "error" not in result, result
    assert sorted(result["finished"]) == ["224", "448"] and result["steps"] == 2
    assert set(result["pieces"]) <= set(gpu_run.FILES)
    for size, folder in models.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["vision_config"]["image_size"] == int(size)
        record = json.loads((folder / "training_record.json").read_text())
        assert record["steps"] == 2 and record["worlds"] == {
            "detail": 0.5, "shapes": 0.3, "ocr": 0.2}  # fmt: skip
    records = [models[s] / "training_record.json" for s in models]
    train = [json.loads(r.read_text())["train_config"] for r in records]
    assert train[0] == train[1]  # the same steps, batches and seed: the same examples


def test_the_ingest_grades_what_the_part_sent_back(rehearsed, tmp_path, ledger,
                                                   monkeypatch):  # fmt: skip
    "The real grader on the returned models, 10 examples a task: 2 steps ship nothing"
    _, models = rehearsed
    monkeypatch.setattr(gpu_ingest, "STAGE2_SIZES", {"detail": 10, "shapes": 10,
                                                     "ocr": 10})  # fmt: skip
    before = ledger.read_text()
    shipped = []
    record = gpu_ingest.ship_stage2(
        models, "rehearsal", ship=shipped.append, ledger=ledger,
        records=tmp_path / "records", shipped=tmp_path / "none",
    )  # fmt: skip
    assert record["ships"] is False and shipped == []
    assert record["measures"]["nano at 224"]["ch. 11 text read"] >= 0.8
    assert (
        json.loads(ledger.read_text())["test ranges spent"]
        == json.loads(before)["test ranges spent"]
    )


# --- a stage 2 trained here, without a GPU (tools/stage2_local.py) ---
import stage2_local  # noqa: E402


def test_a_run_trained_here_is_decided_by_the_same_rules_once(tmp_path, ledger):
    models = returned(tmp_path, control=False, device="cpu: x86_64, 2 cores",
                      segments=[(0, 1), (1, 2)])  # stopped once, resumed  # fmt: skip
    out = models["448"].parent  # the run's folder, OUT/448 in it
    (out / "448" / "model.safetensors").write_bytes(b"weights")
    before = ship_rules.read_ledger(ledger)["test ranges spent"]
    calls, shipped = [], []
    rows = {"nano@224": NANO, "nano@448": NANO, "448": planted(wrong(0, 2))}
    places = dict(grade=fake_grader(calls, rows), ship=shipped.append,
                  ledger=ledger, records=tmp_path / "records",
                  shipped=tmp_path / "none")  # fmt: skip
    record = stage2_local.ingest(out, **places)
    stamp = stage2_local.stamp_of(out / "448")
    assert record["ships"] is True and shipped == [out / "448"]
    assert record["trained"]["device"].startswith("cpu")
    # its record timed the resume only: no seconds are claimed for the whole run
    assert record["trained"]["starts"] == 2 and record["trained"]["seconds"] is None
    assert record["trained"]["last start"] == {"steps": [1, 2], "seconds": 1}
    assert (tmp_path / "records" / f"stage2-cpu-validation-{stamp}.json").exists()
    assert record["test record"] == f"stage2-after-cpu-{stamp}.json"
    spent = ship_rules.read_ledger(ledger)["test ranges spent"][len(before) :]
    assert spent and {e["by"] for e in spent} == {
        f"tools/stage2_local.py ingest {out}"}  # fmt: skip
    with pytest.raises(ValueError, match="decided once"):
        stage2_local.ingest(out, **places)  # the same run again


class Trainer:
    "A stand-in for the trainer's process: runs until it ends or is stopped"

    def __init__(self, command=None, ends_after=None, code=0):
        self.command, self.polls, self.ends_after = command, 0, ends_after
        self.code, self.returncode = code, None

    def poll(self):
        self.polls += 1
        if self.ends_after is not None and self.polls > self.ends_after:
            self.returncode = self.code
        return self.returncode

    def terminate(self):
        self.returncode = -15

    def wait(self):
        return 0 if self.returncode is None else self.returncode


def test_a_stopped_local_run_resumes_from_its_checkpoints(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(stage2_local.gpu_stage2, "resampled_start", ran.append)

    def popen(command):
        ran.append(command)
        return Trainer(command)

    monkeypatch.setattr(stage2_local.subprocess, "Popen", popen)
    stage2_local.train(tmp_path, 10, 4, 1e-4, 1)
    assert ran[0] == tmp_path / "start-448" and "--resume" not in ran[1]
    command = ran[1]
    assert command[command.index("--model") + 1] == str(tmp_path / "start-448")
    assert command[command.index("--worlds") + 1] == gpu_stage2.WORLDS
    (tmp_path / "start-448").mkdir()
    (tmp_path / "start-448" / "model.safetensors").write_bytes(b"")
    (tmp_path / "448" / "checkpoints").mkdir(parents=True)
    stage2_local.train(tmp_path, 10, 4, 1e-4, 1)
    assert len(ran) == 3 and ran[2][-1] == "--resume"  # not resampled again


@pytest.fixture
def clock(monkeypatch):
    "time as stage2_local sees it: each poll's sleep moves it on"
    now = [0.0]
    monkeypatch.setattr(stage2_local.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(
        stage2_local.time, "sleep", lambda s: now.__setitem__(0, now[0] + s)
    )
    return now


def checkpoints_written(schedule, clock):
    "latest_checkpoint, with checkpoint `step` written at `schedule`'s times"
    import paligemma_lib.resume as resume

    real = resume.latest_checkpoint

    def latest(out):
        for when, step in schedule.items():
            if clock[0] >= when:
                folder = Path(out) / "checkpoints" / f"step-{step:07d}"
                folder.mkdir(parents=True, exist_ok=True)
        return real(out)

    return latest


def test_past_its_minutes_a_run_stops_at_its_next_checkpoint(
    tmp_path, monkeypatch, clock
):
    import paligemma_lib.resume as resume

    # step 100 is written before the deadline (60 s), step 150 after it
    latest = checkpoints_written({0: 50, 30: 100, 90: 150}, clock)
    monkeypatch.setattr(resume, "latest_checkpoint", latest)
    trainer = Trainer()
    assert stage2_local.stop_after(trainer, tmp_path, deadline=60, poll=10) == 0
    assert trainer.returncode == -15 and 90 <= clock[0] < 100
    # not stopped at step 100, written before the time was up
    assert latest(tmp_path).name == "step-0000150"


def test_a_run_that_ends_first_gives_its_own_exit_code(tmp_path, clock):
    trainer = Trainer(ends_after=3)
    assert stage2_local.stop_after(trainer, tmp_path, deadline=600, poll=10) == 0
    assert clock[0] == 30  # waited for it, stopped nothing
    failed = Trainer(ends_after=1, code=2)  # a trainer that fails
    assert stage2_local.stop_after(failed, tmp_path, deadline=0, poll=10) == 2
