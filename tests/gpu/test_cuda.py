"""The branches only CUDA takes (issue 38): skipped without a CUDA GPU; on one,
`tools/gpu_run.py` runs them first. Each names the library code it executes. The
CPU tests cover the same functions' other branches; these check what a CPU cannot
run: CUDA graphs, pinned host flags and CUDA events, int8's cast route on the GPU,
NCCL with `set_device`, `init_device_mesh("cuda")`, DDP's `device_ids`, CUDA's RNG
states, bf16 autocast and the bf16 MixedPrecisionPolicy, fp16 with the scaler on a
GPU, and the nano model on CUDA."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_quantize import fp16_bound  # noqa: E402

from paligemma_lib import PaliGemmaProcessor, load_pretrained  # noqa: E402
from paligemma_lib.data import SyntheticDataset  # noqa: E402
from paligemma_lib.generation import generate  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_run.py)"
)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def exact_float32():
    "TF32 off: float32 on the GPU rounds as float32 does, so tokens compare"
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def nano():
    "The shipped nano model in float32 on the GPU, its processor, 4 test scenes"
    model = load_pretrained("nano", device="cuda").eval()
    processor = PaliGemmaProcessor.from_pretrained("nano")
    scenes = SyntheticDataset({"shapes": 1}, split="test", size=4)
    images, prompts, answers = zip(*(scenes[i] for i in range(4)))
    batch = processor(list(images), list(prompts))
    return model, processor, batch.to("cuda"), list(answers)


def run(model, batch, **kwargs):
    return generate(
        model,
        batch.input_ids,
        batch.pixel_values,
        batch.attention_mask,
        batch.token_type_ids,
        max_new_tokens=24,
        **kwargs,
    )


def test_compiled_decoding_with_cuda_graphs_equals_eager(nano):
    "generation._new_cache (mark_static_address), reduce-overhead, mark_step_begin"
    model, _, batch, _ = nano
    eager = run(model, batch)
    first = run(model, batch, compile=True)  # records the graphs
    again = run(model, batch, compile=True)  # replays them, the cache reused
    assert torch.equal(first, eager) and torch.equal(again, eager)


def test_stopping_on_cuda_equals_the_cpu(nano):
    """stopping._StepFlags: pinned host flags read through CUDA events a step or
    two late; rows finishing at different steps pad after <eos>, as on the CPU"""
    model, processor, batch, answers = nano
    tokens = run(model, batch)
    cpu_model = load_pretrained("nano").eval()
    cpu = run(cpu_model, batch.to("cpu"))
    assert torch.equal(tokens.cpu(), cpu)
    decoded = [processor.decode(row) for row in tokens.cpu()]
    # every answer ends as the truth does: the class detected, the count, the
    # caption's last shape (the boxes are a few bins off the truth)
    assert [d.split()[-1] for d in decoded] == [a.split()[-1] for a in answers]
    lengths = {int((row != 0).sum()) for row in tokens}
    assert len(lengths) > 1  # rows really finished at different steps


def test_int8_cast_route_on_cuda_is_within_the_float16_bound(nano):
    "quantize.Int8Linear.cast_product on the GPU, float16: the derived bound"
    from paligemma_lib.quantize import Int8Linear, quantize_int8

    model = load_pretrained("nano", device="cuda", dtype=torch.float16).eval()
    quantize_int8(model)
    layer = next(m for m in model.modules() if isinstance(m, Int8Linear))
    x = 3 * torch.randn(8, layer.in_features, device="cuda", dtype=torch.float16)
    assert layer.route(x) == "cast"
    with torch.no_grad():
        y = layer(x)
    exact, allowed = fp16_bound(x.cpu(), layer.cpu())
    assert ((y.cpu().double() - exact).abs() <= allowed).all()
    layer.cuda()
    _, _, batch, _ = nano
    tokens = run(model, batch.to(dtype=torch.float16), compile=True)
    assert tokens.shape[0] == 4 and (tokens[:, 0] > 0).all()


def test_auto_loads_onto_the_gpu_in_its_dtype():
    "weights.resolve_device('auto') and devices.pick_device on CUDA"
    from paligemma_lib.devices import has_native_bf16

    model = load_pretrained("nano", device="auto")
    weight = model.language_model.lm_head.weight
    native = torch.cuda.get_device_capability() >= (8, 0)
    assert weight.device.type == "cuda" and has_native_bf16(weight.device) == native


def test_cuda_rng_states_round_trip_and_survive_fewer_gpus():
    """resume.rng_states/set_rng_states: this GPU's generator restored; the old
    layout (every GPU's state, a list: a 2-GPU run resumed on 1) does not crash"""
    from paligemma_lib.resume import rng_states, set_rng_states

    states = rng_states("cuda")
    first = torch.rand(4, device="cuda")
    set_rng_states(states, "cuda")
    assert torch.equal(torch.rand(4, device="cuda"), first)
    two_gpus = dict(states, cuda=[states["cuda"], torch.cuda.get_rng_state()])
    set_rng_states(two_gpus, "cuda")
    assert torch.equal(torch.rand(4, device="cuda"), first)


@pytest.mark.parametrize("capability", [None, (7, 5)])
def test_training_steps_on_cuda(capability, monkeypatch):
    """train.autocast_dtype/grad_scaler on the GPU: bf16 autocast where the GPU has
    it, else (a T4's capability, 7.5) fp16 with the loss scaler; finite losses"""
    from paligemma_lib.data import Collator
    from paligemma_lib.train import TrainConfig, autocast_dtype, train

    if capability is not None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    expected = torch.float16 if capability else torch.bfloat16
    if capability is None and torch.cuda.get_device_capability() < (8, 0):
        expected = torch.float16
    assert autocast_dtype("cuda") == expected
    model = load_pretrained("nano")
    processor = PaliGemmaProcessor.from_pretrained("nano")
    data = SyntheticDataset({"shapes": 1}, split="train", size=64)
    config = TrainConfig(steps=4, batch_size=8, lr=1e-4, warmup_steps=1)
    history = train(
        model, data, Collator(processor), config, device="cuda", progress=False
    )
    assert len(history["loss"]) == 4
    assert all(torch.isfinite(torch.tensor(history["loss"])))


def torchrun(tmp_path, *flags, steps=2):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node=1", "-m", "paligemma_lib", "train", "--config", "tiny",
        "--out", str(tmp_path), "--steps", str(steps), "--batch-size", "4",
        "--train-size", "32", "--eval-size", "4", "--no-progress", *flags,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_on_one_gpu_saves_and_resumes(mode, tmp_path):
    """train.init_distributed (NCCL, set_device), sharding.data_parallel (DDP's
    device_ids) or shard_model (init_device_mesh("cuda"), bf16
    MixedPrecisionPolicy), checkpoints with CUDA's RNG state, resumed"""
    flags = ["--fsdp"] if mode == "fsdp" else []
    flags += ["--save-every", "1", "--device", "cuda"]
    torchrun(tmp_path, *flags)
    last = tmp_path / "checkpoints" / "step-0000002"
    shutil.rmtree(last)  # resume from step 1: step 2 again, RNG states restored
    torchrun(tmp_path, *flags, "--resume")
    assert last.is_dir()
    assert (tmp_path / "training_record.json").is_file()


def test_torchrun_on_the_cpu_of_a_gpu_machine(tmp_path):
    "train --device cpu under torchrun on a GPU machine: gloo, not NCCL"
    torchrun(tmp_path, "--fsdp", "--device", "cpu")
    assert (tmp_path / "training_record.json").is_file()


def test_an_evaluator_computes_where_the_model_is(nano):
    "evaluation.make_evaluator without a device: the loss on the model's GPU"
    from paligemma_lib.data import Collator
    from paligemma_lib.evaluation import make_evaluator

    model, processor, _, _ = nano
    data = SyntheticDataset({"shapes": 1}, split="validation", size=8)
    metrics = make_evaluator(processor, data, Collator(processor))(model)
    assert 0 < metrics["validation loss"] < 5  # nano knows its world
