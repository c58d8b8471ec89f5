"""tools/gpu_real.py, gpu_run.py's part `real` (issue 41): the pictures packed for the
GPU and unpacked there, and the model's trip back in pieces (the rule that ships it:
tests/test_ship_rules.py).
The part itself runs in CI as `tools/gpu_run.py --rehearse`; these check the pieces
that decide what comes back and what is kept, on tiny data."""

import gzip
import io
import json
import random
import re
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_real  # noqa: E402
import gpu_run  # noqa: E402

# --- the model's trip back ---


@pytest.mark.parametrize("n", [0, 1, 6, 7, 21, 11 * 7 + 3])
def test_split_and_join_give_back_the_same_bytes(tmp_path, n):
    "Pieces <stem>.0, .1, ... of at most `size` bytes; joined in number order"
    size = 7
    data = random.Random(n).randbytes(n)
    source = tmp_path / "model.tar"
    source.write_bytes(data)
    pieces = tmp_path / "back"
    pieces.mkdir()
    names = gpu_real.split_file(source, pieces / "real-model.tar", size=size)
    count = max(1, -(-n // size))  # an empty file is still one piece
    assert names == [f"real-model.tar.{i}" for i in range(count)]
    assert sorted(p.name for p in pieces.iterdir()) == sorted(names)
    lengths = [(pieces / name).stat().st_size for name in names]
    assert all(length <= size for length in lengths)
    assert sum(lengths) == n
    assert gpu_real.join_pieces(pieces / "real-model.tar.0") == data


def test_join_orders_pieces_by_number_not_by_name(tmp_path):
    "With 12 pieces, .10 and .11 come after .9 (as text they would follow .1)"
    for i in range(12):
        (tmp_path / f"m.tar.{i}").write_bytes(bytes([i]))
    (tmp_path / "m.tar").write_bytes(b"the whole, not a piece")
    assert gpu_real.join_pieces(tmp_path / "m.tar.0") == bytes(range(12))


def test_the_model_comes_back_whole_from_its_pieces(tmp_path):
    files = {"config.json": b'{"a": 1}\n', "model.safetensors": bytes(range(256)) * 9}
    tar = tmp_path / "real-model.tar"
    with tarfile.open(tar, "w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"  # the folder that came back
    out.mkdir()
    names = gpu_real.split_file(tar, out / "real-model.tar", size=1000)
    assert len(names) > 10
    folder = gpu_real.unpack_model(out / names[0], tmp_path / "unpacked")
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)
    for name, data in files.items():
        assert (folder / name).read_bytes() == data


def test_nano_real_fits_the_pieces_that_come_back():
    "The model's tar, at nano's size, needs no more pieces than FILES lets back"
    allowed = [n for n in gpu_run.FILES if n.startswith("real-model.tar.")]
    assert allowed == [f"real-model.tar.{i}" for i in range(len(allowed))]
    assert gpu_real.PIECE <= 16 * 2**20
    shipped = ROOT / "paligemma_lib" / "assets" / "nano-real"
    sizes = [(shipped / name).stat().st_size for name in gpu_real.MODEL_FILES]
    tar_size = sum(512 + -(-s // 512) * 512 for s in sizes) + 10240  # a tar's most
    assert tar_size <= len(allowed) * gpu_real.PIECE


# --- the pictures packed here, unpacked on the GPU machine ---


def test_pack_and_unpack_give_the_library_the_same_pictures(tmp_path, monkeypatch):
    from paligemma_lib.real_images import find_fashion_mnist, mnist_5k_path

    rng = random.Random(0)
    source = tmp_path / "fashion"
    source.mkdir()
    payloads = {name: rng.randbytes(100 + i) for i, name in enumerate(gpu_real.FASHION)}
    for name, data in payloads.items():
        (source / f"{name}.gz").write_bytes(gzip.compress(data))
    digits = tmp_path / "digits" / gpu_real.DIGITS
    digits.parent.mkdir()
    digits.write_bytes(gzip.compress(b"label,pixels\n7,0,0\n"))
    monkeypatch.setenv("PALIGEMMA_FASHION_MNIST", str(source))
    monkeypatch.setenv("PALIGEMMA_MNIST_5K", str(digits))

    packed = gpu_real.pack(tmp_path / "packed", preset=0)
    assert packed == tmp_path / "packed"
    assert sorted(p.name for p in packed.iterdir()) == sorted(
        [f"{name}.xz" for name in gpu_real.FASHION] + [gpu_real.DIGITS]
    )

    out = tmp_path / "out"
    env = gpu_real.unpack(packed, out)
    assert env == {"PALIGEMMA_FASHION_MNIST": str(out),
                   "PALIGEMMA_MNIST_5K": str(out / gpu_real.DIGITS)}  # fmt: skip
    for name, data in payloads.items():
        assert gzip.decompress((out / f"{name}.gz").read_bytes()) == data, name
    assert (out / gpu_real.DIGITS).read_bytes() == digits.read_bytes()
    for key, value in env.items():  # the library, pointed there, finds them
        monkeypatch.setenv(key, value)
    assert find_fashion_mnist() == out
    assert mnist_5k_path() == out / gpu_real.DIGITS


# --- the hook in tools/gpu_run.py ---


def test_real_is_a_part_a_plain_run_leaves_out():
    assert "real" in gpu_run.PARTS and "real" not in gpu_run.DEFAULT_PARTS
    assert gpu_run.PART_FUNCTIONS["real"] is gpu_real.real
    assert set(gpu_run.BUDGETS) == set(gpu_run.PARTS)
    assert set(gpu_run.REHEARSAL_BUDGETS) == set(gpu_run.PARTS)
    # a plain call, and `--only real` alone, each fit a command's 9 minutes
    assert sum(gpu_run.BUDGETS[p] for p in gpu_run.DEFAULT_PARTS) <= 9 * 60
    assert gpu_run.BUDGETS["real"] <= 9 * 60


def write_real_run(out: Path):
    record = {"environment": {"commit": "abc"}, "parts": {"real": {}},
              "started": "2026-11-26T00:00:00",
              "finished": "2026-11-26T00:09:00"}  # fmt: skip
    (out / "run.json").write_text(json.dumps(record))


def test_check_output_wants_the_models_first_piece(tmp_path):
    write_real_run(tmp_path)
    problems = gpu_run.check_output(tmp_path, ["real"])
    assert "real wrote no real-model.tar.0" in problems, problems
    (tmp_path / "real-model.tar.0").write_bytes(b"x")
    (tmp_path / "real-model.tar.1").write_bytes(b"y")
    assert gpu_run.check_output(tmp_path, ["real"]) == []
    (tmp_path / "real-model.tar.2").write_bytes(b"z")  # a third would not come back
    assert gpu_run.check_output(tmp_path, ["real"]) == [
        "unexpected file real-model.tar.2"
    ]


def test_every_file_name_passes_the_return_trip():
    "The return trip takes names of letters, digits, '.', '_' and '-' only"
    for name in gpu_run.FILES:
        assert re.fullmatch(r"[A-Za-z0-9._-]+", name), name


def test_an_unknown_part_is_refused_with_the_parts_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        gpu_run.main(["--only", "nope", "--out", str(tmp_path / "run")])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "unknown part(s) nope" in err
    assert f"the parts: {', '.join(gpu_run.PARTS)}" in err
    assert not (tmp_path / "run").exists()  # refused before any work
