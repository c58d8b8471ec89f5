# Hand-written, not exported from a notebook.
"""Everything a lent GPU must do, in one command (issue 38).

    python3 tools/gpu_run.py --out DIR             # on the GPU machine: 9 min, H100
    python3 tools/gpu_run.py --out DIR --only t4,speed  # again, some parts only
    python3 tools/gpu_run.py --rehearse --out DIR  # the same on a CPU, tiny (CI)
    python3 tools/gpu_run.py --ingest DIR          # here, afterwards: results in place
    python3 tools/gpu_run.py --fetch-wheels        # here, before: .whl/ for the GPU

A GPU comes rarely (15 minutes, its start included; a command at most 10; 8 files
back), so its work is this one prepared command, rehearsed on the CPU by CI. Run from
a plain copy of the repository with the machine's own python (torch, transformers,
peft there); it installs nothing but the wheels in `.whl/` (Jupyter's kernel and
nbclient, for the chapters: `--fetch-wheels` downloads them here), into a temporary
folder.

The parts, in order, each within its own budget (`BUDGETS`, seconds), each writing
to DIR as soon as it has results, so that a run cut short returns what it did:

1. branches: tests/gpu (every CUDA-only branch of the library) and, side by side,
   the chapters with GPU branches executed on CUDA with their own checks
   (tools/run_book.py --device cuda).
2. t4: the GPU plays Colab's T4: compute capability 7.5 (so the library picks fp16
   autocast and the loss scaler, as on a T4), memory capped at 15 GiB, two data
   workers. Chapter 12's GPU recipe (the receipts adapter, 600 steps of 64) with its
   time, examples per second, peak memory and metrics on 96 validation receipts;
   then a LoRA step of PaliGemma-3B's shapes (random weights) under the same cap, its
   frozen weights in float32 (what `pick_device` gives a T4) and in float16.
3. segment: two recipes of the `segment` adapter at a GPU's scale (by default `low`
   and `boxes`: the shipped recipe at a quarter of its rate, without and with the
   boxes world), each going on from the shipped adapter (`train --from-adapter
   segment`; GPU_SEGMENT_FROM, GPU_SEGMENT_RUNS and `segment_runs` say how to
   change that), side by side for the same minutes; the choice on validation
   scenes 0-63; the chosen adapter comes back as one file, for --ingest to decide
   on (tools/gpu_ingest.py).
4. speed: benchmarks/gpu.py --short at PaliGemma-3B's shapes (random bf16 weights).

GPU_TRAIN_COMPILE=1 makes the segment and real parts train with `train --compile`
(chapter 11.2); they train eagerly otherwise, as the shipped models did.

Five parts run only when asked for (--only): `real`, nano-real's training, going on
from the shipped nano-real (a call of its own, tools/gpu_real.py); `stage2`, nano's
stage 2 at 448 beside a control at 224 (a call of its own, tools/gpu_stage2.py);
`profile`, where a training step of both recipes goes (tools/gpu_profile.py); and
`decode`, where a compiled decoding step of PaliGemma-3B's shapes goes, kernel class by
kernel class against the bandwidth, with the candidate fixes side by side
(tools/gpu_decode.py; its table goes into run.json, no file of its own); and
`resolution`, the prefill and a decoding step at 224, 448 and 896 px at
PaliGemma-3B's shapes (benchmarks/resolution.py --device cuda, chapter 11.4). A whole
call, the wheels' install included, ends within CALL, its clock started before torch's
import. What a call carries and untracks to fit 64 MiB: tests/test_packaging.py's
CALL_PLANS (A.4).

DIR receives at most 8 files: those of the parts the call runs (`PART_FILES`) and
`COMMON_FILES`. --ingest DIR (on this machine) puts them where
they belong: benchmarks/results/, the speed page (A.2), chapter 12's bars for its GPU
branch, and a returned adapter or model into the package only if tools/ship_rules.py's
rule says so on validation, beside the shipped one; then it is graded once on test
examples the ledger (paligemma_lib/assets/ledger.json) has never seen
(tools/gpu_ingest.py).
"""

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

STARTED = time.time()  # a call's clock starts here, before torch's import (main)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import gpu_decode  # noqa: E402
import gpu_ingest  # noqa: E402
import gpu_profile  # noqa: E402
import gpu_real  # noqa: E402
import gpu_stage2  # noqa: E402

PARTS = ("branches", "t4", "segment", "speed", "real", "profile", "decode", "stage2",
         "resolution")  # fmt: skip
# what a plain run does; `real` (nano-real's training, issue 41) and `stage2` (nano's
# stage 2, issue 52) take a call alone, `profile` (where a training step goes, issue
# 49), `decode` (where a decoding step goes, issue 50) and `resolution` (224, 448 and
# 896 px timed, issue 52) a call or the rest of one
DEFAULT_PARTS = ("branches", "t4", "segment", "speed")
BUDGETS = {"branches": 180, "t4": 90, "segment": 180, "speed": 60,  # 510 s
           "real": 500, "profile": 240, "decode": 300, "stage2": 500,
           "resolution": 90}  # fmt: skip
INSTALL = 30  # the wheels' install (about 10 s), inside the call's 9 minutes
CALL = 9 * 60  # a whole call: the install and every part end within it
SLACK = 15  # the parts end this much before CALL: a child's kill, the last record
# the CPU rehearsal: the same steps, tiny
REHEARSAL_BUDGETS = {"branches": 240, "t4": 150, "segment": 200, "speed": 40,
                     "real": 150, "profile": 300, "decode": 120,
                     "stage2": 240, "resolution": 60}  # fmt: skip
REHEARSAL_CALL = 30 * 60
RETURNED = 8  # the most files a call brings back
COMMON_FILES = ("run.json", "log.txt")  # every call's
PART_FILES = {  # what each part may write into DIR
    "branches": ("book.json",), "t4": (), "segment": ("segment-adapter.tar",),
    "speed": ("speed.json",), "real": ("real-model.tar.0", "real-model.tar.1"),
    "profile": ("profile.json",), "decode": (), "resolution": ("resolution.json",),
    "stage2": tuple(f"{gpu_stage2.TAR}.{i}" for i in range(gpu_stage2.PIECES)),
}  # fmt: skip
FILES = COMMON_FILES + tuple(name for files in PART_FILES.values() for name in files)
# the chapters whose cells branch on a GPU; chapter 13 has none (its page runs the
# model where it was loaded), and its Gradio is not on the GPU machine
CHAPTERS = ("08_", "08b", "09_", "11b", "11c", "12_", "12b")
REHEARSED_CHAPTER = "08b"  # the CPU rehearsal runs one chapter: CI runs them all
# what the chapters need on the GPU machine beyond its own packages (its python 3.12
# has torch, transformers, peft, matplotlib, pytest...): Jupyter's kernel and nbclient
WHEELS = (
    "asttokens==3.0.2 comm==0.2.3 debugpy==1.8.22 decorator==5.3.1 executing==2.3.0 "
    "fastjsonschema==2.22.3 ipykernel==7.4.0 ipython==9.18.1 "
    "ipython_pygments_lexers==1.1.1 jedi==0.20.1 jsonschema==4.26.0 "
    "jsonschema-specifications==2025.9.1 jupyter_client==8.10.0 jupyter_core==5.9.1 "
    "matplotlib-inline==0.2.2 nbclient==0.11.0 nbformat==5.11.1 nest_asyncio==1.6.0 "
    "parso==0.8.7 pexpect==4.9.0 platformdirs==4.14.8 prompt_toolkit==3.0.53 "
    "ptyprocess==0.7.0 pure_eval==0.2.4 pyzmq==27.3.0 referencing==0.37.0 "
    "rpds-py==2026.9.1 stack_data==0.6.3 tornado==6.6.1 traitlets==5.16.1 "
    "wcwidth==0.9.4"
).split()
T4_MEMORY = 15 * 2**30  # what Colab's T4 offers a process
T4_WORKERS = 2  # Colab's CPU cores
# the shipped adapter's recipe, and the winner of chapter 12.1's comparison on the
# CPU (tools/compare_segment_recipes.py): the same adapter with the 128 <seg> rows of
# the tied embedding trained too
SEGMENT_LORA = ["--lora", "--lora-targets", "all", "--lora-r", "16",
                "--lora-alpha", "32", "--lr", "2e-3"]  # fmt: skip
SEGMENT_RECIPES = {"lora": SEGMENT_LORA,
                   "rows": [*SEGMENT_LORA, "--lora-tokens", "seg"],
                   # issue 49 section 3: the boxes limit the masks
                   "loc": [*SEGMENT_LORA, "--lora-tokens", "seg,loc"],
                   # going on from a trained adapter, a gentler rate: on the CPU,
                   # 40 steps of 8 from the shipped one graded 0.48 at 2e-3 and
                   # 0.54 at 5e-4 on 16 validation scenes (the shipped: 0.57)
                   "low": [*SEGMENT_LORA[:-1], "5e-4"],
                   # issue 49 section 3: `low` with the boxes world (chapter 12.1)
                   # mixed in, detect on the same scenes (its --worlds replaces the
                   # part's); at 2e-3, 2 rehearsal steps made the shipped adapter
                   # answer segment prompts with boxes alone
                   "boxes": [*SEGMENT_LORA[:-1], "5e-4", "--worlds",
                             "segments=0.75,boxes=0.25"]}  # fmt: skip
# each call goes on from the shipped adapter (issue 49 section 4): GPU_SEGMENT_FROM
# names another (a folder), or "none" for new adapters; GPU_SEGMENT_RUNS picks the
# recipes run side by side. Default low,boxes: going on from the shipped adapter at
# 2e-3 undid it on the CPU (above), and 300 steps of 8 from it (validation scenes
# 0-39, 2026-11-27) graded 0.606 at 5e-4 (`low`), 0.592 with `boxes` and 0.618 at
# 1e-4 against the shipped adapter's 0.649: no CPU continuation beat it, so the GPU
# tries the gentler rate, with and without the boxes world, for thousands of steps
SEGMENT_FROM = "segment"
# what every run of the segment part shares (its runs add their recipe, and workers)
SEGMENT_BASE = ["--model", "nano", "--batch-size", "64", "--worlds", "segments=1",
                "--train-size", "5000000"]  # fmt: skip


def segment_runs(env=os.environ) -> dict:
    "The segment part's runs: {name: the train command's flags}"
    from gpu_driver import compile_flags

    names = env.get("GPU_SEGMENT_RUNS", "low,boxes").split(",")
    unknown = [n for n in names if n not in SEGMENT_RECIPES]
    if unknown or not names:
        raise ValueError(
            f"GPU_SEGMENT_RUNS={env.get('GPU_SEGMENT_RUNS')}: choose among "
            f"{', '.join(SEGMENT_RECIPES)}"
        )
    start = env.get("GPU_SEGMENT_FROM", SEGMENT_FROM)
    origin = [] if start == "none" else ["--from-adapter", start]
    origin += compile_flags(env)  # GPU_TRAIN_COMPILE=1: train --compile
    return {name: [*SEGMENT_RECIPES[name], *origin] for name in names}


SEGMENT_VALIDATION = 64  # validation scenes the choice reads
CHAPTER_12 = ROOT / "book" / "12_fine_tuning.ipynb"  # its GPU branch's bars


class Run:
    "DIR, the record run.json, the log; every part writes through it"

    def __init__(self, out: Path, rehearse: bool, started: float | None = None):
        self.out, self.rehearse = out, rehearse
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "log.txt", "a")
        self.record = {
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "rehearsal": rehearse,
            "command": " ".join(["python3 tools/gpu_run.py", *sys.argv[1:]]),
            "environment": environment(),
            "parts": {},
        }
        if (out / "run.json").exists():  # --only: the earlier parts stay
            earlier = json.loads((out / "run.json").read_text())
            self.record["parts"] = {
                name: provenance(earlier) | part
                for name, part in earlier.get("parts", {}).items()
            }
        self.budgets = REHEARSAL_BUDGETS if rehearse else BUDGETS
        # every part ends by this time, whatever its own budget (time.time())
        began = time.time() if started is None else started  # main: STARTED
        self.deadline = began + (REHEARSAL_CALL if rehearse else CALL) - SLACK

    def left(self) -> float:
        "Seconds until the call's deadline"
        return self.deadline - time.time()

    def say(self, *words):
        line = " ".join(str(w) for w in words)
        print(line, flush=True)
        print(line, file=self.log, flush=True)

    def save(self):
        (self.out / "run.json").write_text(json.dumps(self.record, indent=1) + "\n")

    def command(self, command: list, timeout: float, env=None) -> dict:
        "Run `command` (output to the log) within `timeout` s: its status and time"
        self.say("$", " ".join(map(str, command)))
        start = time.perf_counter()
        try:
            done = subprocess.run(
                list(map(str, command)), cwd=ROOT, stdout=self.log,
                stderr=subprocess.STDOUT, env=env, timeout=max(1, timeout),
            )  # fmt: skip
            status = done.returncode
        except subprocess.TimeoutExpired:
            status = f"killed after {timeout:.0f} s"
        return {"status": status, "seconds": round(time.perf_counter() - start, 1)}


def provenance(record: dict) -> dict:
    "Which call a part came from: its commit and start (kept when --only adds parts)"
    return {"commit": record["environment"]["commit"], "started": record["started"]}


def environment() -> dict:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "peft", "numpy"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    cuda = torch.cuda.is_available()
    return versions | {
        "device": torch.cuda.get_device_name() if cuda else platform.machine(),
        "cpus": os.cpu_count(),
        "commit": os.environ.get("GPU_RUN_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
            text=True,
        ).stdout.strip() or None,
    }  # fmt: skip


def install_wheels(run: Run):
    "The wheels of .whl/ into a temporary folder the children import from"
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    paths = [str(ROOT)]
    if wheels and not run.rehearse:
        target = Path(tempfile.gettempdir()) / "gpu-run-site"
        run.command(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--upgrade", "--target", target, *wheels],
            timeout=INSTALL,
        )  # fmt: skip
        paths.insert(0, str(target))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])


# --- part 1: every CUDA-only branch, and the chapters on CUDA ---


def branches(run: Run, budget: float) -> dict:
    start, device = time.perf_counter(), "cpu" if run.rehearse else "cuda"
    chapters = [REHEARSED_CHAPTER] if run.rehearse else list(CHAPTERS)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    junit = Path(tempfile.mkdtemp()) / "gpu-tests.xml"
    tests = subprocess.Popen(
        [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider",
         f"--junitxml={junit}"],
        cwd=ROOT, stdout=run.log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    book = run.command(
        [sys.executable, "tools/run_book.py", "--device", device, "--parallel",
         len(chapters), "--timeout", budget - 10, "--output", run.out / "book.json",
         *chapters],
        timeout=budget, env=env,
    )  # fmt: skip
    try:  # the tests had the chapters' time; they may have what is left
        tests.wait(timeout=max(5, budget - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        tests.kill()
    result = {"tests": junit_results(junit), "chapters": book}
    if (run.out / "book.json").exists():
        chapters = json.loads((run.out / "book.json").read_text())["chapters"]
        result["chapters"] = {
            row["chapter"]: "passed" if row["passed"] else
            f"FAILED at {row['failed_cell']}: {row['error']}"
            for row in chapters
        }  # fmt: skip
    return result


def junit_results(path: Path) -> dict:
    "test name -> passed / skipped / the failure's first line, from pytest's XML"
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {"error": "pytest wrote no results (killed, or did not start)"}
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = f"{child.tag}: {(child.get('message') or '')[:300]}"
            elif child.tag == "skipped":
                outcome = f"skipped: {(child.get('message') or '')[:100]}"
        results[case.get("name")] = outcome
    return results


# --- part 2: the T4, as nearly as this GPU can play it ---


def play_t4():
    """This process as Colab's T4: on CUDA, compute capability 7.5 (no native bf16:
    the library then autocasts to fp16 with the loss scaler) and 15 GiB; on a CPU,
    `cpu:0` under PALIGEMMA_REHEARSE_GPU=t4. The device, and its name"""
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, T4_MEMORY / total))
        torch.cuda.get_device_capability = lambda device=None: (7, 5)
        return torch.device("cuda")
    os.environ["PALIGEMMA_REHEARSE_GPU"] = "t4"
    return torch.device("cpu:0")


def peak_memory(device) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if device.type == "cuda" else None


def t4_child(result: Path, rehearse: bool):
    "Chapter 12's GPU recipe, then LoRA at 3B's shapes, in a T4's arithmetic"
    import torch

    device = play_t4()
    from paligemma_lib.train import autocast_dtype

    record = {"device": str(device), "autocast": str(autocast_dtype(device))}
    record["receipts recipe"] = receipts_recipe(device, rehearse)
    result.write_text(json.dumps(record, indent=1))
    record["3b lora"] = {}
    for dtype in (torch.float32, torch.float16):
        record["3b lora"][str(dtype)] = lora_3b(device, dtype, rehearse)
        result.write_text(json.dumps(record, indent=1))


def receipts_recipe(device, rehearse: bool) -> dict:
    "Chapter 12's GPU branch: the shipped adapter's settings, 600 of its steps"
    import torch
    from torch.utils.data import Subset

    from paligemma_lib import PaliGemmaProcessor, load_pretrained
    from paligemma_lib.adapters import resolve_adapter_path
    from paligemma_lib.data import Collator, SyntheticDataset
    from paligemma_lib.evaluation import compute_metrics, predict
    from paligemma_lib.lora import LoraConfig, add_lora
    from paligemma_lib.model_files import read_json
    from paligemma_lib.train import TrainConfig, train

    record = read_json(resolve_adapter_path("receipts") / "training_record.json")
    shipped = record["train_config"]
    steps, keep = (4, ()) if rehearse else (600, ("batch_size", "lr"))
    keep += ("min_lr_ratio", "weight_decay", "max_grad_norm")
    config = TrainConfig(
        steps=steps,
        warmup_steps=max(1, shipped["warmup_steps"] * steps // shipped["steps"]),
        **({"batch_size": 2, "lr": 2e-3} if rehearse else {}),
        **{k: shipped[k] for k in keep},
    )
    processor = PaliGemmaProcessor.from_pretrained("nano")
    model = load_pretrained("nano", device=device)
    torch.manual_seed(0)
    add_lora(model, LoraConfig(r=8, target_modules="all-linear"))
    model.to(device)
    stream = SyntheticDataset({"receipts": 1}, split="train", size=100_000)
    start = time.perf_counter()
    history = train(
        model, stream, Collator(processor), config, device=device, progress=False,
        workers=T4_WORKERS,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    n = 8 if rehearse else 96
    # validation: this adapter ships nothing, and a grade of it must not spend test
    # (until 2026-11-27 it read test 5000-5095; the ledger lists those calls)
    validation = SyntheticDataset({"receipts": 1}, split="validation", size=n)
    rows = predict(model.eval(), processor, Subset(validation, range(n)), 32, 64)
    losses = history["loss"]
    return {
        "steps": steps,
        "batch_size": config.batch_size,
        "workers": T4_WORKERS,
        "seconds": round(seconds, 1),
        "examples_per_s": round(steps * config.batch_size / seconds, 1),
        "peak_memory_bytes": peak_memory(device),
        "skipped_steps": sum(not math.isfinite(g) for g in history["grad_norm"]),
        "loss_first_5": sum(losses[:5]) / len(losses[:5]),
        "loss_last_5": sum(losses[-5:]) / len(losses[-5:]),
        "validation": f"receipts validation 0-{n - 1}",
        "metrics": compute_metrics(rows)["receipt"],
    }


def lora_3b(device, dtype, rehearse: bool, steps: int = 3) -> dict:
    """One LoRA recipe step after another at PaliGemma-3B's shapes, random weights
    in `dtype`, chapter 10's default targets r=8, gradient checkpointing, batch 2 of
    301 tokens, the library's autocast with the loss scaler: fits or not"""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu import prompts, tiny_config

    from paligemma_lib.config import PaliGemmaConfig
    from paligemma_lib.lora import LoraConfig, add_lora
    from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
    from paligemma_lib.train import autocast, grad_scaler, set_gradient_checkpointing

    config = tiny_config() if rehearse else PaliGemmaConfig()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = optimizer = None
    try:
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = PaliGemmaForConditionalGeneration(config)
        finally:
            torch.set_default_dtype(default)
        model.requires_grad_(False)
        add_lora(model, LoraConfig(r=8, dtype=torch.float32))
        set_gradient_checkpointing(model)
        inputs = prompts(config, 2, device, dtype, text_tokens=301 - 256 - 1)
        types = torch.zeros_like(inputs["input_ids"])
        types[:, -20:] = 1  # the answer
        labels = inputs["input_ids"].masked_fill(types == 0, -100)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        scaler = grad_scaler(device)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            with autocast(device):
                loss = model(**{**inputs, "token_type_ids": types}, labels=labels).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return {
            "fits": True,
            "step_s": [round(t, 3) for t in times],
            "loss": loss.item(),
            "peak_memory_bytes": peak_memory(device),
            "sequence_length": inputs["input_ids"].shape[1],
        }
    except torch.OutOfMemoryError as e:
        return {"fits": False, "error": str(e).splitlines()[0][:300]}
    finally:
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()


def t4(run: Run, budget: float) -> dict:
    result = Path(tempfile.mkdtemp()) / "t4.json"
    status = run.command(
        [sys.executable, __file__, "--child", "t4", "--result", result,
         *(["--rehearse"] if run.rehearse else [])],
        timeout=budget,
    )  # fmt: skip
    found = json.loads(result.read_text()) if result.exists() else {}
    return status | found


# --- part 3: the segment adapter, a GPU's minutes ---


def segment(run: Run, budget: float) -> dict:
    from gpu_driver import Driver

    work = Path(tempfile.mkdtemp()) / "segment"
    size, workers = (2, 1) if run.rehearse else (64, max(1, (os.cpu_count() - 2) // 2))
    base = [*SEGMENT_BASE, "--workers", workers]
    base[base.index("--batch-size") + 1] = size
    os.environ["OMP_NUM_THREADS"] = "1"  # 2 runs x (1 + workers) processes
    driver = Driver(work, work, list(map(str, base)))
    driver.log = run.log  # one log
    reserve = 15 if run.rehearse else 30  # the validation grades
    probe, floor = (3, 2) if run.rehearse else (30, 100)
    runs = segment_runs()
    steps = driver.calibrate(runs, budget, reserve, probe, floor, eval_size=2)
    if steps is None:
        return {"error": "calibration failed (the log says why)"}
    if run.rehearse:
        steps = floor
    left = budget - (time.time() - driver.begin) - reserve
    # the run's own evaluation at the end: a few scenes (the grade below counts)
    final = ["--eval-every", "0", "--eval-size", "8"]
    finished = driver.run_all(runs, steps, final, timeout=left)
    result = {"steps": steps, "batch_size": size, "workers per run": workers,
              "finished": finished, "runs": {}}  # fmt: skip
    for name in finished:
        record = json.loads((work / name / "training_record.json").read_text())
        n = 8 if run.rehearse else SEGMENT_VALIDATION
        graded = work / name / "validation.json"  # a child: it ends at the budget
        status = run.command(
            [sys.executable, __file__, "--child", "segment-grade", "--folder",
             work / name, "--n", n, "--result", graded],
            timeout=budget - (time.time() - driver.begin),
        )  # fmt: skip
        if not graded.exists():
            result["runs"][name] = {"validation": status}
            continue
        metrics = json.loads(graded.read_text())
        result["runs"][name] = {
            "seconds": record["seconds"],
            "examples_per_s": round(steps * size / record["seconds"], 1),
            "validation": metrics,
        }
        run.say(f"segment {name}: validation mIoU {metrics['mIoU']:.3f}")
    graded = [n for n in finished if "mIoU" in result["runs"][n]["validation"]]
    if not graded:
        return result | (
            {"error": "no run was graded in the budget"} if finished else {}
        )
    best = max(graded, key=lambda n: result["runs"][n]["validation"]["mIoU"])
    result["chosen on validation"] = best
    with tarfile.open(run.out / "segment-adapter.tar", "w") as tar:  # the chosen
        for file in ("adapter_config.json", "adapter_model.safetensors",
                     "training_record.json"):  # fmt: skip
            tar.add(work / best / file, arcname=file)
    return result


def segment_grade(folder: Path, split: str, start: int, n: int):
    "Chapter 12.1's metrics of a run's adapter on `n` scenes of `split`"
    from evaluate_segment import grade_scenes

    from paligemma_lib import PaliGemmaProcessor, load_pretrained
    from paligemma_lib.adapters import load_adapter
    from paligemma_lib.devices import pick_device

    device, _ = pick_device()  # float32: the grade, not the speed, counts
    model = load_pretrained("nano", device=device)
    load_adapter(model, folder)
    model.to(device)
    processor = PaliGemmaProcessor.from_pretrained("nano")
    return grade_scenes(model.eval(), processor, split, start, n, batch_size=64)[3]


# --- part 4: speed ---


def speed(run: Run, budget: float) -> dict:
    flags = ["--config", "tiny", "--device", "cpu", "--bandwidth", "1e11"]
    flags = flags if run.rehearse else []
    status = run.command(
        [sys.executable, "benchmarks/gpu.py", "--short", "--budget", budget - 30,
         "--out", run.out, "--file", run.out / "speed.json", *flags],
        timeout=budget,
    )  # fmt: skip
    found = run.out / "speed.json"
    sections = json.loads(found.read_text())["sections"] if found.exists() else {}
    return status | {
        name: round(r["ms_per_step"], 2) if "ms_per_step" in r else r
        for name, r in sections.items()
        if name.startswith("decode")
    }


# --- part 7: decode ---


def decode(run: Run, budget: float) -> dict:
    """tools/gpu_decode.py in a child, ended at the budget; its rows (written after
    each) go into run.json, the whole table under `table`"""
    folder = Path(tempfile.mkdtemp())
    flags = ["--rehearse"] if run.rehearse else []
    status = run.command(
        [sys.executable, "tools/gpu_decode.py", "--out", folder,
         "--budget", budget - 15, *flags],
        timeout=budget,
    )  # fmt: skip
    found = folder / "decode.json"
    table = json.loads(found.read_text()) if found.exists() else {}
    if not table.get("rows"):
        raise RuntimeError(f"gpu_decode.py measured no row: {status}")
    return status | {"rows": gpu_decode.summary(table), "table": table}


# --- part 9: resolution ---


def resolution(run: Run, budget: float) -> dict:
    """benchmarks/resolution.py (chapter 11.4, issue 52): the prefill and a decoding
    step at 224, 448 and 896 px, PaliGemma-3B's shapes in bf16 on the GPU (the
    speed page's GPU rows)"""
    # rehearsed: the models built as on the GPU (random, bf16), at nano's shapes
    tiny = ["--device", "cpu", "--random-nano", "--repeats", "1"]
    device = tiny if run.rehearse else ["--device", "cuda"]
    found = run.out / "resolution.json"
    status = run.command(
        [sys.executable, "benchmarks/resolution.py", *device, "--out", found],
        timeout=budget,
    )
    rows = json.loads(found.read_text())["rows"] if found.exists() else {}
    keep = ("prefill ms", "decode ms a step")
    return status | {f"{size} px": {k: r[k] for k in keep} for size, r in rows.items()}


PART_FUNCTIONS = {"branches": branches, "t4": t4, "segment": segment, "speed": speed,
                  "real": gpu_real.real, "profile": gpu_profile.profile,
                  "decode": decode, "stage2": gpu_stage2.stage2,
                  "resolution": resolution}  # fmt: skip


ALONE = ("real", "stage2")  # parts that take a call of their own


def call_files(parts) -> tuple:
    "The files a call running `parts` may bring back"
    return COMMON_FILES + tuple(name for p in parts for name in PART_FILES[p])


def run_parts(out: Path, parts: list[str], rehearse: bool, started=None) -> int:
    "The parts in one call, whose clock started at `started` (time.time(); now)"
    run = Run(out, rehearse, started)
    run.say(f"gpu_run: {run.record['environment']}; parts {', '.join(parts)}")
    install_wheels(run)
    for part in parts:
        budget = min(run.budgets[part], run.left())  # the call's end comes first
        run.say(f"== {part} (at most {budget:.0f} s)")
        start = time.perf_counter()
        try:
            if budget < 10:
                raise TimeoutError(f"{budget:.0f} s left of the call: not started")
            result = PART_FUNCTIONS[part](run, budget)
        except Exception as e:  # recorded; the next part runs
            traceback.print_exc(file=run.log)
            result = {"error": f"{type(e).__name__}: {e}"}
        result["part seconds"] = round(time.perf_counter() - start, 1)
        result |= provenance(run.record)
        run.record["parts"][part] = result
        run.save()
        run.say(f"{part}: {json.dumps(result)[:1500]}")
    run.record["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    run.save()
    problems = check_output(out, parts, rehearse)
    for problem in problems:
        run.say("PROBLEM:", problem)
    return 1 if problems else 0


def call_groups(parts) -> list[list[str]]:
    """`parts` as GPU calls would run them: each of ALONE in a call of its own,
    the others together"""
    together = [p for p in parts if p not in ALONE]
    return ([together] if together else []) + [[p] for p in parts if p in ALONE]


def check_output(out: Path, parts: list[str], rehearse: bool = False) -> list[str]:
    """What is wrong with DIR for the machine's return trip and for --ingest: more
    than RETURNED files (in a rehearsal of parts no call runs together, more than
    RETURNED of one call's, `call_groups`), an unexpected name, a part without its
    record or its file"""
    problems = []
    names = sorted(p.name for p in out.iterdir())
    groups = call_groups(parts) if rehearse else [None]
    for group in groups:
        mine = names if group is None else [n for n in names if n in call_files(group)]
        if len(mine) > RETURNED:
            what = "" if group is None else f" of a call running {', '.join(group)}"
            problems.append(
                f"{len(mine)} files{what} in {out}; at most {RETURNED} come back"
            )
    problems += [f"unexpected file {n}" for n in names if n not in FILES]
    record = json.loads((out / "run.json").read_text())
    for key in ("environment", "parts", "started", "finished"):
        if key not in record:
            problems.append(f"run.json has no {key!r}")
    expected = {"branches": "book.json", "speed": "speed.json",
                "segment": "segment-adapter.tar",
                "real": "real-model.tar.0", "profile": "profile.json",
                "stage2": f"{gpu_stage2.TAR}.0",
                "resolution": "resolution.json"}  # fmt: skip
    for part in parts:
        if part not in record.get("parts", {}):
            problems.append(f"run.json has no part {part!r}")
        elif "error" in record["parts"][part]:
            problems.append(f"{part}: {record['parts'][part]['error']}")
        if part in expected and expected[part] not in names:
            problems.append(f"{part} wrote no {expected[part]}")
    t4_record = record.get("parts", {}).get("t4", {})
    if "t4" in parts and "metrics" not in t4_record.get("receipts recipe", {}):
        problems.append("t4: no metrics of the receipts recipe")
    return problems


# --- afterwards, on this machine ---


def ingest(folder: Path) -> int:
    "The results of a GPU run where they belong (see the module's docstring)"
    record = json.loads((folder / "run.json").read_text())
    if record.get("rehearsal"):
        raise SystemExit(
            f"{folder} holds a rehearsal, not a GPU run: nothing to ingest"
        )
    stamp = datetime.fromisoformat(record["started"]).strftime("%Y%m%d-%H%M")

    def part_stamp(part: str) -> str:  # the call that ran it (--only keeps earlier)
        started = record["parts"].get(part, {}).get("started", record["started"])
        return datetime.fromisoformat(started).strftime("%Y%m%d-%H%M")

    results = ROOT / "benchmarks" / "results"
    device = re.sub(r"[^a-z0-9]+", "-", record["environment"]["device"].lower())
    copies = {
        "run.json": f"gpu-run-{stamp}.json",
        "book.json": f"book-cuda-{stamp}.json",
        "speed.json": f"gpu-speed-{device.strip('-')}-{part_stamp('speed')}.json",
        "profile.json": f"gpu-profile-{device.strip('-')}-{part_stamp('profile')}.json",
        "resolution.json": f"resolution-cuda-{part_stamp('resolution')}.json",
    }
    for name, target in copies.items():
        if (folder / name).exists():
            shutil.copyfile(folder / name, results / target)
            print(f"{name} -> benchmarks/results/{target}")
    table = record["parts"].get("decode", {}).get("table")
    if table:  # the decode part's table: a file of its own here
        target = f"decode-profile-{device.strip('-')}-{part_stamp('decode')}.json"
        (results / target).write_text(json.dumps(table, indent=1) + "\n")
        print(f"decode part -> benchmarks/results/{target}")
    t4_record = record["parts"].get("t4", {}).get("receipts recipe")
    if t4_record and "metrics" in t4_record:
        set_chapter_bars(t4_record, f"benchmarks/results/{copies['run.json']}")
    if (folder / "segment-adapter.tar").exists():
        gpu_ingest.ship_segment(folder / "segment-adapter.tar", part_stamp("segment"))
    if (folder / "real-model.tar.0").exists():
        model = gpu_real.unpack_model(
            folder / "real-model.tar.0", Path(tempfile.mkdtemp())
        )
        gpu_ingest.ship_real(model, part_stamp("real"))
    if (folder / f"{gpu_stage2.TAR}.0").exists():
        models = gpu_stage2.unpack_models(
            folder / f"{gpu_stage2.TAR}.0", Path(tempfile.mkdtemp())
        )
        gpu_ingest.ship_stage2(models, part_stamp("stage2"))
    subprocess.run([sys.executable, "tools/speed_page.py"], cwd=ROOT, check=True)
    return 0


def bars(metrics: dict, n: int) -> dict:
    """The bars chapter 12's GPU branch asserts: each field's accuracy as the GPU
    run measured it, less three binomial standard errors of an n-receipt sample (a
    perfect score counted as one miss in n, for a margin)"""
    out = {}
    for name, value in metrics.items():
        if name == "examples":
            continue
        p = min(value, 1 - 1 / n)
        bar = round(value - 3 * (p * (1 - p) / n) ** 0.5, 3)
        if bar > 0:  # a bar of 0 asserts nothing
            out[name] = bar
    return out


def set_chapter_bars(recipe: dict, source: str, chapter: Path = CHAPTER_12):
    "Write the bars into chapter 12's GPU branch: the one line that holds them"
    notebook = json.loads(chapter.read_text())
    values = bars(recipe["metrics"], recipe["metrics"]["examples"])
    for cell in notebook["cells"]:
        lines = cell["source"]
        for i, text in enumerate(lines):
            if text.lstrip().startswith("GPU_BARS = "):
                indent = text[: len(text) - len(text.lstrip())]
                end = "\n" if text.endswith("\n") else ""
                lines[i] = f"{indent}GPU_BARS = {json.dumps(values)}{end}"
                lines[i - 1] = f"{indent}# {source}: T4 part, less 3 SE\n"
                text = json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
                chapter.write_text(text)
                print(f"chapter 12: GPU_BARS = {values}")
                return
    raise SystemExit("chapter 12 has no line 'GPU_BARS = ...' to set")


def fetch_wheels() -> int:
    "WHEELS for the GPU machine (CPython 3.12, x86-64 Linux) into .whl/, here"
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux1_x86_64"]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *[f"--platform={p}" for p in platforms],
        "-d",
        ROOT / ".whl",
        *WHEELS,
    ]
    return subprocess.run(list(map(str, command))).returncode  # fmt: skip


@contextlib.contextmanager
def scratch():
    """Every temporary file of this process and of its children (TMPDIR) in one folder,
    removed at the end: a rehearsal in CI, or an ingest, leaves nothing behind"""
    folder = tempfile.mkdtemp(prefix="gpu-run-")
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    try:
        yield Path(folder)
    finally:
        os.environ.pop("TMPDIR", None)
        if saved[0] is not None:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the folder that comes back")
    parser.add_argument("--only", help=f"comma-separated parts of {', '.join(PARTS)}")
    parser.add_argument("--rehearse", action="store_true", help="on a CPU, tiny")
    parser.add_argument("--ingest", type=Path, help="a GPU run's folder, here")
    parser.add_argument(
        "--fetch-wheels", action="store_true", help="the GPU machine's wheels, here"
    )
    parser.add_argument(
        "--pack-real-data", action="store_true", help="the part real's data, here"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "t4":
        t4_child(args.result, args.rehearse)
        return 0
    if args.child == "segment-grade":
        metrics = segment_grade(args.folder, "validation", 0, args.n)
        args.result.write_text(json.dumps(metrics) + "\n")
        return 0
    if args.ingest:
        with scratch():
            return ingest(args.ingest)
    if args.fetch_wheels:
        return fetch_wheels()
    if args.pack_real_data:
        print(f"packed into {gpu_real.pack()}")
        return 0
    if args.out is None:
        parser.error("--out DIR is needed (or --ingest DIR)")
    every = PARTS if args.rehearse else DEFAULT_PARTS  # CI rehearses them all
    parts = args.only.split(",") if args.only else list(every)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(
            f"unknown part(s) {', '.join(unknown)}; the parts: {', '.join(PARTS)}"
        )
    if args.rehearse:
        os.environ["PALIGEMMA_REHEARSE_GPU"] = "t4"
    with scratch():
        return run_parts(args.out, parts, args.rehearse, STARTED)


if __name__ == "__main__":
    sys.exit(main())
