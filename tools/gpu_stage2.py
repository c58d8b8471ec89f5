# Hand-written, not exported from a notebook.
"""tools/gpu_run.py's part `stage2` (issue 52): nano's stage 2, the paper's second
stage at nano's scale.

    python3 tools/gpu_run.py --out DIR --only stage2   # there: trains, sends back
    python3 tools/gpu_run.py --ingest DIR              # here: graded, maybe shipped

The part resamples the shipped nano's positions to 448 (chapter 11.4's
`at_resolution`), saves that as a checkpoint, and trains it briefly at 448 on
chapter 11.4's detail world (typed text and shapes too small for 224) mixed with
chapter 11's shapes and text. Beside it, side by side, the same training of nano at
224, the same steps over the same examples: the control, which tells what training
on the world buys from what the resolution buys. The steps are calibrated to the
budget on both runs together (or GPU_STAGE2_STEPS=N, a count an earlier call's rate
fits, saves the probe); if that leaves fewer than MIN_STEPS, the control is dropped
and the 448 run calibrated alone. The models come back in one tar, in
pieces under 16 MiB (the return trip's limit a file).

`--ingest` grades them here (`grade`: the detail world's text by character error
rate and its counts by exact match, chapter 11's skills as chapter 12.2 grades
them) beside nano at 224 and nano resampled with no training, all on the same
validation examples, and ships the 448 model as `nano-448` only if it meets the
issue's goals (tools/ship_rules.py's stage-2 rule); then it is graded once on test
examples the ledger has never listed (tools/gpu_ingest.py's `ship_stage2`).
"""

import hashlib
import json
import os
import tarfile
import tempfile
import time
from pathlib import Path

import ship_rules
from gpu_real import MODEL_FILES, PIECE, join_pieces, split_file

RESOLUTION = 448  # the paper's stage 2
CONTROL = 224  # nano's own size
# chapter 11's worlds keep as much weight as the new one: their skills must stay
WORLDS = "detail=0.5,shapes=0.3,ocr=0.2"
STAGE2_RUN = [
    "--lr", "5e-4", "--batch-size", "128", "--worlds", WORLDS,
    "--train-size", "5000000",
]  # fmt: skip
MIN_STEPS = 500  # fewer with the control beside it: the control is dropped
TAR = "stage2-models.tar"  # its pieces: stage2-models.tar.0, .1, ...
PIECES = 4  # at most, of PIECE bytes: two nano models and their records need 3


def resampled_start(folder: Path, size: int = RESOLUTION) -> Path:
    "The shipped nano, its positions resampled to `size`, saved as a checkpoint"
    from paligemma_lib import PaliGemmaProcessor, load_pretrained
    from paligemma_lib.resolution import at_resolution, processor_at
    from paligemma_lib.weights import save_pretrained

    nano = load_pretrained("nano")
    processor = PaliGemmaProcessor.from_pretrained("nano")
    patch = nano.config.vision.patch_size
    save_pretrained(
        at_resolution(nano, size),
        folder,
        processor=processor_at(processor, size, patch),
    )
    return folder


def stage2(run, budget: float) -> dict:
    "The part: resample, calibrate, train both runs, send the models back"
    from gpu_driver import Driver

    work = Path(tempfile.mkdtemp()) / "stage2"
    begin = time.time()
    start = resampled_start(work / "start-448")
    size = 2 if run.rehearse else 128
    # a rehearsal's batches are drawn in the trainer's process: on a CPU the
    # two runs' workers would only take its cores
    workers = 0 if run.rehearse else max(1, (os.cpu_count() - 2) // 2)
    base = [*STAGE2_RUN, "--workers", str(workers)]
    if run.rehearse:
        base[base.index("--batch-size") + 1] = str(size)
    runs = {str(RESOLUTION): ["--model", str(start)], str(CONTROL): ["--model", "nano"]}
    driver = Driver(work, work, base)
    driver.log = run.log
    driver.begin = begin
    reserve = 20 if run.rehearse else 30  # packing the models
    probe, floor = (3, 2) if run.rehearse else (30, 100)
    steps = os.environ.get("GPU_STAGE2_STEPS")  # a rate an earlier call measured
    if steps is None or run.rehearse:
        steps = driver.calibrate(runs, budget, reserve, probe, floor, eval_size=2)
    else:
        steps = int(steps)
    if steps is not None and steps < MIN_STEPS and not run.rehearse:
        run.say(f"stage2: {steps} steps with the control; the 448 run alone")
        del runs[str(CONTROL)]
        steps = driver.calibrate(runs, budget, reserve, probe, floor, eval_size=2)
    if steps is None:
        return {"error": "calibration failed (the log says why)"}
    steps = floor if run.rehearse else steps
    left = budget - (time.time() - begin) - reserve
    # the run's own grade at the end, a few examples (--ingest grades them all)
    final = ["--eval-every", "0", "--eval-size", "2" if run.rehearse else "8"]
    finished = driver.run_all(runs, steps, final, timeout=left)
    result = {"steps": steps, "batch_size": size, "workers per run": workers,
              "runs": list(runs), "finished": finished, "flags": base}  # fmt: skip
    if str(RESOLUTION) not in finished:
        return result | {"error": "the 448 run did not finish in its budget"}
    result["models"] = {}
    tar = work / TAR
    with tarfile.open(tar, "w") as archive:
        for name in finished:
            folder = work / name
            record = json.loads((folder / "training_record.json").read_text())
            weights = (folder / "model.safetensors").read_bytes()
            result["models"][name] = {
                "seconds": record["seconds"],
                "examples_per_s": round(steps * size / record["seconds"], 1),
                "final_metrics": record.get("final_metrics"),
                "model_sha256": hashlib.sha256(weights).hexdigest(),
            }
            for file in MODEL_FILES:
                archive.add(folder / file, arcname=f"{name}/{file}")
    result["pieces"] = split_file(tar, run.out / TAR, size=PIECE)
    if len(result["pieces"]) > PIECES:
        return result | {"error": f"{len(result['pieces'])} pieces: {PIECES} come back"}
    rates = {n: m["examples_per_s"] for n, m in result["models"].items()}
    run.say(f"stage2: {steps} steps; examples/s {rates}")
    return result


def unpack_models(first_piece: Path, into: Path) -> dict:
    "The returned models' folders by size ({'448': folder, '224': folder}), from pieces"
    into.mkdir(parents=True, exist_ok=True)
    tar = into / TAR
    tar.write_bytes(join_pieces(first_piece))
    with tarfile.open(tar) as archive:
        archive.extractall(into / "models", filter="data")
    return {p.name: p for p in sorted((into / "models").iterdir()) if p.is_dir()}


# --- the grades, here (tools/gpu_ingest.py's ship_stage2) ---

# what a grade asks, by world and task: the detail world's text and counts, and
# chapter 11's skills as chapter 12.2 keeps them (shapes: one scene a task)
ASKED = {"detail": ("ocr", "count"), "shapes": ("caption", "detect"), "ocr": ("ocr",)}
MAX_NEW_TOKENS = 64  # the longest answer asked, 3 boxes of one kind: about 20


def ask(model, processor, world: str, task: str, split: str, start: int, n: int):
    """The model's greedy answers to examples start .. start+n-1 of `split` of
    `world`, asking `task`: rows with the world, the index and the seed"""
    from torch.utils.data import Subset

    from paligemma_lib.data import SyntheticDataset
    from paligemma_lib.evaluation import predict

    data = SyntheticDataset(world, split=split, size=start + n, task=task)
    indices = range(start, start + n)
    rows = predict(model, processor, Subset(data, indices), 32, MAX_NEW_TOKENS)
    for i, row in zip(indices, rows, strict=True):
        row |= {"world": world, "task": task, "index": i, "seed": data.seeds[i]}
    return rows


def grade(source, size: int, split: str, start: int, sizes: dict) -> dict:
    """The model `source` (nano, or a folder) at `size` px (its positions
    resampled when it was trained at another) on `sizes[world]` examples of
    each task of ASKED[world] from index `start` of `split`: its rows, the
    measures (ship_rules.stage2_measures) and its weights' sha256"""
    import torch

    import paligemma_lib.small_detail  # noqa: F401  (the detail world)
    from paligemma_lib import PaliGemmaProcessor, load_pretrained
    from paligemma_lib.devices import pick_device
    from paligemma_lib.model_files import resolve_model_path
    from paligemma_lib.resolution import at_resolution, processor_at

    torch.manual_seed(0)
    device, _ = pick_device()  # float32 weights: the grade, not the speed, counts
    model = load_pretrained(source, device=device).eval()
    processor = PaliGemmaProcessor.from_pretrained(source)
    own = model.config.vision.image_size
    if size != own:
        patch = model.config.vision.patch_size
        model = at_resolution(model, size).eval()
        processor = processor_at(processor, size, patch)
    started = time.perf_counter()
    rows = [
        row
        for world, tasks in ASKED.items()
        for task in tasks
        for row in ask(model, processor, world, task, split, start, sizes[world])
    ]
    weights = resolve_model_path(source) / "model.safetensors"
    return {
        "model": str(source), "trained at": own, "graded at": size,
        "split": split, "start": start, "sizes": sizes,
        "model_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "seconds": round(time.perf_counter() - started, 1),
        "measures": ship_rules.stage2_measures(rows), "rows": rows,
    }  # fmt: skip
