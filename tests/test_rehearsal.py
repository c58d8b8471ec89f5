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

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
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


# the chapters issue 38 reviewed, beside 11.2 and 12 (rehearsed since issue 28):
# each names a GPU branch or says in a line of its text why it has none
REVIEWED = [
    "08_kv_cache_and_generation.ipynb",
    "08b_int8.ipynb",
    "09_loading_real_weights.ipynb",
    "11c_nano_model.ipynb",
    "12b_segmentation.ipynb",
    "13_demo.ipynb",
]
NO_BRANCH = "*No GPU branch:*"  # how that line starts
REHEARSED_CHAPTERS = "PALIGEMMA_REHEARSED_CHAPTERS"  # .ci/run: the chapters it ran


def says_no_branch(notebook: str) -> bool:
    cells = json.loads((BOOK / notebook).read_text())["cells"]
    return any(
        line.startswith(NO_BRANCH)
        for cell in cells
        if cell["cell_type"] == "markdown"
        for line in "".join(cell["source"]).splitlines()
    )


def gpu_chapters() -> set[str]:
    """The chapters with GPU code: a named branch in an open cell, or a line
    listed in CUDA_ONLY. `.ci/run` must rehearse each"""
    named = {name for name, _, src in chapter_code_cells() if BRANCH.search(src)}
    return named | {file for file, _ in CUDA_ONLY if file.endswith(".ipynb")}


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


# The lint (issue 38): every test for a GPU in the chapters' open cells and in the
# library goes through `gpu_branch`, so the rehearsal takes it, or is listed below
# with the reason the CPU cannot take it. The forms it finds are those of
# `gpu_tests`; an occurrence is named by its file and its line's text.
LIBRARY = sorted(
    p for p in (ROOT / "paligemma_lib").rglob("*.py") if p.name != "_modidx.py"
)
CUDA_ONLY = {  # (file, line): why no CPU can take it
    ("08_kv_cache_and_generation.ipynb", 'if device.type == "cuda":'): (
        "inside the branch: PyTorch's own bf16 answer exists on CUDA alone"
    ),
    (
        "08_kv_cache_and_generation.ipynb",
        "cuda_says = torch.cuda.is_bf16_supported(including_emulation=False)",
    ): "is_bf16_supported(including_emulation=False): a CUDA call",
    ("paligemma_lib/generation.py", 'if weight.device.type == "cuda":'): (
        "static addresses for CUDA graphs, which only a CUDA device records"
    ),
    (
        "paligemma_lib/generation.py",
        'mode = "reduce-overhead" if device.type == "cuda" else None',
    ): "CUDA graphs (torch.compile's reduce-overhead) need a CUDA device",
    (
        "paligemma_lib/generation.py",
        'if self.compile and token.device.type == "cuda":',
    ): ("marks a CUDA graph's step: CUDA graphs only"),
    (
        "paligemma_lib/stopping.py",
        'self.cuda, self.max_lag = torch.device(device).type == "cuda", max_lag',
    ): "pinned host memory and CUDA events: a CUDA runtime's, none on a CPU",
    (
        "paligemma_lib/stopping.py",
        "event = torch.cuda.Event() if self.cuda else None",
    ): "a CUDA event says when an asynchronous copy arrived; a CPU copies at once",
    (
        "paligemma_lib/weights.py",
        'if device.type == "cuda" and not torch.cuda.is_available():',
    ): (
        "refuses cuda on a machine without CUDA: taken on the CPU, by "
        "tests/test_weights.py"
    ),
    ("paligemma_lib/training_run.py", 'if device.type == "cuda":'): (
        "the record names the GPU: torch.cuda.get_device_name, CUDA alone"
    ),
    (
        "paligemma_lib/training_run.py",
        'return f"cuda: {torch.cuda.get_device_name(device)}"',
    ): "the GPU's name, which only CUDA knows",
    (
        "paligemma_lib/resume.py",
        'if device.type == "cuda" and device.index is not None:',
    ): "which GPU's generator this process draws from: CUDA alone (tests/gpu/)",
    ("paligemma_lib/resume.py", "return torch.cuda.current_device()"): (
        "the current GPU: CUDA alone (tests/gpu/)"
    ),
    ("paligemma_lib/resume.py", "if torch.cuda.is_available():"): (
        "saves this GPU's generator state: there is none without CUDA"
    ),
    (
        "paligemma_lib/resume.py",
        'states["cuda"] = torch.cuda.get_rng_state(_gpu(device))',
    ): "this GPU's generator state (tests/gpu/)",
    (
        "paligemma_lib/resume.py",
        "if cuda is None or not torch.cuda.is_available():",
    ): "restores a CUDA generator state: there is none without CUDA",
    ("paligemma_lib/resume.py", "torch.cuda.set_rng_state(cuda.cpu(), gpu)"): (
        "this GPU's generator state (tests/gpu/; faked on the CPU in test_train.py)"
    ),
    ("paligemma_lib/sharding.py", 'cuda = device.type == "cuda"'): (
        "DDP's device_ids name a GPU: CUDA alone (tests/gpu/; faked in test_fsdp.py)"
    ),
    ("paligemma_lib/train.py", 'if torch.device(device).type == "cuda":'): (
        "NCCL and one GPU per torchrun process on a CUDA run; gloo otherwise"
    ),
    (
        "paligemma_lib/train.py",
        'torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))',
    ): ("one GPU per torchrun process: CUDA devices only"),
    ("paligemma_lib/cli/train.py", 'if device.type == "cuda" and world_size > 1:'): (
        "each torchrun process on its own GPU: CUDA devices only"
    ),
    (
        "paligemma_lib/cli/train.py",
        'device = torch.device("cuda", torch.cuda.current_device())',
    ): "the GPU torchrun gave this process",
}
HELPERS = {  # devices.py: the helpers every branch asks, where the question is put
    'taken = device.type == "cuda" or stands_in_for_gpu(device)': "gpu_branch",
    'if device.type != "cuda":': "has_native_bf16: the stand-in, or the CPU",
    "return torch.cuda.get_device_capability(device) >= (8, 0)": (
        "has_native_bf16 on CUDA: the compute capability"
    ),
    "if torch.cuda.is_available():": "pick_device: the GPU when there is one",
    'if device.type == "cuda" and has_native_bf16(device):': "pick_device's dtype",
    'if device.type == "cuda":': "synchronize: CUDA runs asynchronously",
    "torch.cuda.synchronize(device)": "synchronize",
}
CUDA_ONLY |= {("paligemma_lib/devices.py", line): why for line, why in HELPERS.items()}


def _dotted(node) -> str:
    "torch.cuda.is_available for that expression; '' for anything not a name chain"
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return ""


def _names_cuda(node) -> bool:
    "a string constant 'cuda' ('cuda:1'), alone or in a tuple, list or set"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] == "cuda"
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_cuda(e) for e in node.elts)
    return False


def gpu_tests(source: str) -> list[tuple[int, str]]:
    """(line number, form) of each test for a GPU in `source`: a call of
    torch.cuda.* (is_available and the CUDA-only calls), torch.backends.cuda.*,
    `.is_cuda`, a comparison with "cuda" (`x.type == "cuda"`, `!=`, `"cuda" in`,
    `in ("cuda", ...)`) and `.startswith("cuda")`"""
    found = []
    for node in ast.walk(ast.parse(source)):
        form = None
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name.startswith(("torch.cuda.", "torch.backends.cuda")):
                form = name + "()"
            elif getattr(node.func, "attr", None) == "startswith" and node.args:
                form = "startswith('cuda')" if _names_cuda(node.args[0]) else None
        elif isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            form = ".is_cuda"
        elif isinstance(node, ast.Compare):
            if any(map(_names_cuda, [node.left, *node.comparators])):
                form = "a comparison with 'cuda'"
        if form is not None:
            found.append((node.lineno, form))
    return sorted(set(found))


def unlisted_gpu_tests(file: str, source: str, listed=None) -> list[str]:
    """The GPU tests of `source` (the file `file`) not listed in `listed`
    (CUDA_ONLY), and the listed lines of `file` found in `source`"""
    listed = CUDA_ONLY if listed is None else listed
    lines = source.splitlines()
    found = [(lines[n - 1].strip(), form) for n, form in gpu_tests(source)]
    return [
        f"{file}: {line}  ({form}: use gpu_branch, or list it in CUDA_ONLY)"
        for line, form in found
        if (file, line) not in listed
    ], {line for line, _ in found if (file, line) in listed}


def gpu_test_sources():
    "(file, source) of every chapter's open cell and every library module"
    for notebook, _, source in chapter_code_cells():
        yield notebook, source
    for path in LIBRARY:
        yield str(path.relative_to(ROOT)), path.read_text()


def test_the_lint_finds_every_form_of_gpu_test():
    """Seen to fail: each form, planted unlisted in a chapter's cell and in a
    library module's function, is the one finding; listed, none"""
    forms = [
        "if torch.cuda.is_available():",
        'if device.type == "cuda":',
        'if torch.device(d).type != "cuda":',
        "if x.is_cuda:",
        'if "cuda" in str(device):',
        'if device.type in ("cuda", "mps"):',
        'if str(device).startswith("cuda:"):',
        "if torch.cuda.device_count() > 1:",
    ]
    for planted in forms:
        cell = f"import torch\n\n{planted}\n    x = 1\n"
        module = f"def f(device, x):\n    {planted}\n        x = 1\n"
        for file, source in [
            ("11_data_and_training.ipynb", cell),
            ("paligemma_lib/data.py", module),
        ]:
            unlisted, _ = unlisted_gpu_tests(file, source)
            assert unlisted == [
                f"{file}: {planted}  "
                f"({gpu_tests(source)[0][1]}: use gpu_branch, or list it in "
                "CUDA_ONLY)"
            ], unlisted
            listed = {(file, planted)}
            assert unlisted_gpu_tests(file, source, listed) == ([], {planted})
    # a branch that asks gpu_branch is no finding; nor is a word in a comment
    asks = 'if gpu_branch(device, "9: x"):  # on "cuda" too\n    y = "cuda"\n'
    assert unlisted_gpu_tests("09_loading_real_weights.ipynb", asks) == ([], set())


def lint(sources, listed=None) -> tuple[list[str], list]:
    """(unlisted GPU tests, stale entries of `listed`) over `sources`, pairs of
    (file, source); `listed` defaults to CUDA_ONLY"""
    listed = CUDA_ONLY if listed is None else listed
    unlisted, used = [], set()
    for file, source in sources:
        missing, found = unlisted_gpu_tests(file, source, listed)
        unlisted += missing
        used |= {(file, line) for line in found}
    return unlisted, sorted(set(listed) - used)


def test_the_lint_fails_on_a_stale_entry():
    source = "if torch.cuda.is_available():\n    x = 1\n"
    listed = {("a.py", "if torch.cuda.is_available():"): "a reason"}
    assert lint([("a.py", source)], listed) == ([], [])
    gone = "if gpu_branch(device, 'a'):\n    x = 1\n"
    assert lint([("a.py", gone)], listed) == ([], list(listed))


def test_every_gpu_test_asks_gpu_branch_or_is_listed_cuda_only():
    """The chapters' open cells and the library: a GPU test not through
    gpu_branch and not in CUDA_ONLY fails, and so does an entry of CUDA_ONLY
    that is no longer found (stale)"""
    unlisted, stale = lint(gpu_test_sources())
    assert not unlisted, "\n".join(unlisted)
    assert not stale, f"CUDA_ONLY lists lines no longer found: {stale}"


def test_a_chapter_with_gpu_code_names_a_branch_or_says_why_not():
    """.ci/run rehearses the chapters that name a branch: a chapter with only
    CUDA-only lines would be skipped. A chapter of REVIEWED without GPU code
    says why in one line, and a chapter saying so has none"""
    named = {name for name, _, src in chapter_code_cells() if BRANCH.search(src)}
    assert gpu_chapters() == named, gpu_chapters() - named
    for notebook in REVIEWED:
        assert (notebook in named) != says_no_branch(notebook), notebook
    for path in sorted(BOOK.glob("*.ipynb")):
        if says_no_branch(path.name):
            assert path.name not in gpu_chapters(), path.name
            sources = [
                src for name, _, src in chapter_code_cells() if name == path.name
            ]
            assert not any(map(gpu_tests, sources)), path.name


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
    branch named in book/ wrote its name to the record, and every chapter with
    GPU code is among those $PALIGEMMA_REHEARSED_CHAPTERS names"""
    record = os.environ.get(REHEARSAL_RECORD)
    assert record, f"set {REHEARSAL_RECORD} to the record of a rehearsal run"
    taken = set(Path(record).read_text().splitlines())
    missing = [name for name in branch_names() if name not in taken]
    assert not missing, f"GPU branches the rehearsal did not reach: {missing}"
    ran = {Path(p).name for p in os.environ.get(REHEARSED_CHAPTERS, "").split()}
    skipped = sorted(gpu_chapters() - ran)
    assert not skipped, f"chapters with GPU code not rehearsed: {skipped}"
