"""Issue 28: the T4 rehearsal. `PALIGEMMA_REHEARSE_GPU=t4` makes the CPU take every
GPU branch with a T4's arithmetic (no native bf16: fp16 autocast and the loss scaler,
bf16 checkpoints loaded as float32) on `cpu:0`, the device `pick_device` answers then,
while plain "cpu" stays the CPU; `gpu_branch` is the one question a chapter asks,
and each named branch taken is written to $PALIGEMMA_REHEARSAL_RECORD. `.ci/run` runs
the chapters that have GPU branches that way, then `test_every_gpu_branch_was_rehearsed`
(marker `rehearsal`) reads the record."""

import ast
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from test_train import stopped_and_resumed

from paligemma_lib import train as train_module
from paligemma_lib.devices import (
    REHEARSAL,
    REHEARSAL_RECORD,
    gpu_branch,
    has_native_bf16,
    pick_device,
    rehearsal,
    stands_in_for_gpu,
)
from paligemma_lib.train import autocast_dtype, grad_scaler
from paligemma_lib.weights import resolve_dtype

BOOK = Path(__file__).resolve().parents[1] / "book"
# gpu_branch(<anything>, "<name>"): the name a chapter's branch records
BRANCH = re.compile(r"gpu_branch\(\s*[^,()]+,\s*\"([^\"]+)\"\s*\)")


@pytest.fixture
def t4(monkeypatch):
    monkeypatch.setenv(REHEARSAL, "t4")
    monkeypatch.delenv(REHEARSAL_RECORD, raising=False)


@pytest.fixture
def no_rehearsal(monkeypatch):
    monkeypatch.delenv(REHEARSAL, raising=False)
    monkeypatch.delenv(REHEARSAL_RECORD, raising=False)


def chapter_code_cells():
    "(notebook name, cell id, source) of every code cell of book/ that is not exported"
    for path in sorted(BOOK.glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and not source.startswith("#| export"):
                yield path.name, cell.get("id"), source


def branch_names() -> list[str]:
    return [n for *_, src in chapter_code_cells() for n in BRANCH.findall(src)]


def test_the_switch_reads_t4_or_nothing(monkeypatch):
    monkeypatch.delenv(REHEARSAL, raising=False)
    assert rehearsal() is None
    for value, expected in [("", None), ("t4", "t4"), (" T4 ", "t4")]:
        monkeypatch.setenv(REHEARSAL, value)
        assert rehearsal() == expected
    monkeypatch.setenv(REHEARSAL, "a100")
    with pytest.raises(ValueError, match="the one GPU rehearsed is 't4'"):
        rehearsal()


def test_without_the_switch_the_cpu_takes_no_gpu_branch(no_rehearsal):
    assert not gpu_branch("cpu") and gpu_branch("cuda")  # cuda: named, not used
    assert pick_device("cpu") == (torch.device("cpu"), torch.float32)
    assert has_native_bf16("cpu") and autocast_dtype("cpu") is None
    assert not grad_scaler("cpu").is_enabled()
    assert resolve_dtype(None, "BF16", "cpu") == torch.bfloat16


def test_the_cpu_rehearsing_a_t4_has_a_t4s_arithmetic(t4):
    """A T4 (compute capability 7.5) has no native bf16: pick_device keeps float32
    weights, training autocasts to fp16 with the scaler on, and a bf16 checkpoint
    loads as float32, exactly as `autocast_dtype("cuda", native_bf16=False)` says.
    All on cpu:0, the stand-in; "cpu" asked for by name stays the CPU, in fp32"""
    stand_in = torch.device("cpu", 0)
    assert pick_device() == (stand_in, torch.float32)
    assert stands_in_for_gpu(stand_in) and gpu_branch(stand_in)
    assert not stands_in_for_gpu("cpu") and not gpu_branch("cpu")
    assert not gpu_branch("meta") and not has_native_bf16(stand_in)
    assert autocast_dtype(stand_in) == autocast_dtype("cuda", native_bf16=False)
    assert autocast_dtype(stand_in) == torch.float16
    assert grad_scaler(stand_in).is_enabled()
    assert resolve_dtype(None, "BF16", stand_in) == torch.float32
    with train_module.autocast(stand_in):
        product = torch.randn(4, 8) @ torch.randn(8, 4)
    assert product.dtype == torch.float16  # autocast reached the CPU's matmul
    # the CPU by name: as without the rehearsal
    assert has_native_bf16("cpu") and autocast_dtype("cpu") is None
    assert not grad_scaler("cpu").is_enabled()
    assert resolve_dtype(None, "BF16", "cpu") == torch.bfloat16


def test_a_branch_taken_is_recorded(t4, monkeypatch, tmp_path):
    record = tmp_path / "record.txt"
    monkeypatch.setenv(REHEARSAL_RECORD, str(record))
    stand_in = pick_device()[0]
    assert gpu_branch(stand_in, "first") and gpu_branch(stand_in)
    assert gpu_branch(stand_in, "2") and not gpu_branch("cpu", "the CPU")
    assert record.read_text().splitlines() == ["first", "2"]
    monkeypatch.delenv(REHEARSAL)
    assert not gpu_branch(stand_in, "not taken")
    assert record.read_text().splitlines() == ["first", "2"]


def test_chapters_ask_gpu_branch_and_name_each_branch():
    """A chapter decides its GPU branch with `gpu_branch(device, "name")`, never by
    comparing a device's type itself, so the rehearsal reaches every branch and the
    record can be checked against this list"""
    names = branch_names()
    assert len(names) >= 3 and len(set(names)) == len(names), names
    for notebook, cell, source in chapter_code_cells():
        tree = ast.parse(source)
        checks = {  # a check of the helper itself may leave the branch unnamed
            id(call)
            for statement in ast.walk(tree)
            if isinstance(statement, ast.Assert)
            for call in ast.walk(statement)
        }
        for call in ast.walk(tree):
            if (
                isinstance(call, ast.Call)
                and getattr(call.func, "id", None) == "gpu_branch"
                and id(call) not in checks
            ):
                named = len(call.args) == 2 and isinstance(call.args[1], ast.Constant)
                line = ast.get_source_segment(source, call)
                assert named, f"{notebook} cell {cell}: {line} (name the branch)"
        decides = re.findall(r"^\s*(?:if|elif)\b[^\n]*\.type\s*[!=]=", source, re.M)
        assert not decides, f"{notebook} cell {cell}: {decides} (use gpu_branch)"


def test_fp16_training_resumes_bit_for_bit(t4, monkeypatch, tmp_path):
    """The real loop on cpu:0 with fp16 autocast and the loss scaler: a run stopped
    after step 5 and resumed from its step-4 checkpoint ends with the weights and the
    history of an uninterrupted run. The scaler starts at 2^18, so it skips the
    first steps (gradients overflow fp16) and halves to 2^16: its state at the
    checkpoint is not its initial one. Seen to catch: `scaler.load_state_dict`
    removed from `train` (the resumed run restarts at 2^18 and skips step 5)."""
    monkeypatch.setattr(
        train_module,
        "grad_scaler",
        lambda device: torch.amp.GradScaler("cpu", init_scale=2.0**18),
    )
    stand_in = pick_device()[0]  # cpu:0, playing a T4
    assert autocast_dtype(stand_in) == torch.float16
    uninterrupted, expected, resumed, history = stopped_and_resumed(
        tmp_path, device=stand_in
    )
    # the scaler skipped steps: an inf norm marks each
    assert not all(map(math.isfinite, expected["grad_norm"]))
    assert history["loss"] == expected["loss"]
    assert history["grad_norm"] == expected["grad_norm"]
    for (name, p), q in zip(uninterrupted.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.rehearsal
def test_every_gpu_branch_was_rehearsed():
    """Run by `.ci/run` after the chapters ran with PALIGEMMA_REHEARSE_GPU=t4: every
    branch named in book/ wrote its name to the record"""
    record = os.environ.get(REHEARSAL_RECORD)
    assert record, f"set {REHEARSAL_RECORD} to the record of a rehearsal run"
    taken = set(Path(record).read_text().splitlines())
    missing = [name for name in branch_names() if name not in taken]
    assert not missing, f"GPU branches the rehearsal did not reach: {missing}"
