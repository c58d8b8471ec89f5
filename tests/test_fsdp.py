"""Chapter 11.2: FSDP2 (paligemma_lib/sharding.py) under torchrun. Two gloo processes on
the CPU with the model sharded train like one process without FSDP on the same global
batch; the errors a user meets first are one line each."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from test_train import DATA, collate, run_worker, toy_model, worker_script

from paligemma_lib.lora import LoraConfig, add_lora
from paligemma_lib.quantize import quantize_int8
from paligemma_lib.sharding import (
    check_shardable,
    shard_model,
    sharding_policy,
)
from paligemma_lib.train import TrainConfig, train

SCRIPT = """
import os
import paligemma_lib.train as training
from paligemma_lib.sharding import data_parallel, gathered_model

fsdp = sys.argv[2] == "fsdp"
if os.environ.get("SUM_NOT_MEAN"):  # the mutation: FSDP sums the gradients

    def summing(*args, **kw):
        model = data_parallel(*args, **kw)
        for unit in model.modules():
            if hasattr(unit, "set_gradient_divide_factor"):  # every FSDP unit
                unit.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
                unit.set_gradient_divide_factor(1.0)
        return model

    training.data_parallel = summing
rank, world_size = init_distributed()
model = toy_model()
config = TrainConfig(
    steps=4, batch_size=8, accumulation=2, lr=1e-2, warmup_steps=1, fsdp=fsdp,
    gradient_checkpointing=fsdp,
)
device = os.environ.get("TRAIN_DEVICE", "cpu")
history = train(
    model, ColourDataset(32), collate, config, progress=False, device=device
)
final = gathered_model(model) if fsdp else model
if rank == 0:
    save_file(dict(final.named_parameters()), sys.argv[1])
    with open(sys.argv[1] + ".json", "w") as f:
        json.dump({"loss": history["loss"], "grad_norm": history["grad_norm"],
                   "scaler": training.grad_scaler(device).is_enabled()}, f)
"""


def torchrun(tmp_path, processes: int, mode: str, **env) -> tuple[dict, dict]:
    """(final weights, {"loss", "grad_norm"} per step) of the toy run with `processes`
    processes; mode "fsdp" (sharded, gradient checkpointing) or "plain" """
    out = tmp_path / f"weights-{processes}-{mode}.safetensors"
    run_worker(
        tmp_path, worker_script(SCRIPT), processes, out, mode, timeout=180, **env
    )
    from safetensors.torch import load_file

    return load_file(out), json.loads(open(f"{out}.json").read())


def assert_same_run(one, one_history, two, two_history):
    # Step 1: the same weights, the same sums in another order (within each process,
    # then across; FSDP's all-gather moves fp32 values without arithmetic). Each
    # gradient entry sums ~10^3 fp32 terms (tokens x width): rounding below
    # 10^3 x eps32 ~ 1.2e-4 of the sum of magnitudes; the norm, dominated by its large
    # entries, moves less. The loss sums ~10^2 token losses: ~10^2 x eps32 ~ 1e-5.
    assert math.isclose(
        two_history["grad_norm"][0], one_history["grad_norm"][0], rel_tol=1e-4
    ), (one_history, two_history)
    # the loss: ~10^2 token losses summed in another order, ~10^2 x eps32 ~ 1e-5
    assert math.isclose(two_history["loss"][0], one_history["loss"][0], rel_tol=1e-5), (
        one_history,
        two_history,
    )
    assert one.keys() == two.keys()
    for name in one:
        # Adam's update is at most lr = 1e-2 per step per entry whatever the
        # gradient's scale; gradients equal to ~1e-4 relative move 4 updates by far
        # less than 1e-5
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5)
    # Later losses: weights within 1e-5 an entry, N ~ 4.5e4 entries, so
    # |d loss| <= |grad| |d w| <= 3 x 1e-5 x sqrt(N) ~ 6e-3 on losses of ~1 to 8
    for a, b in zip(one_history["loss"], two_history["loss"]):
        assert abs(a - b) <= 6e-3, (one_history, two_history)


def test_fsdp_two_processes_equal_one_without(tmp_path):
    """Same global batch (8 = 2 processes x 2 micro-batches x 2); the sharded run also
    recomputes its layers (gradient checkpointing) and accumulates without syncing
    the first micro-batch. The final weights are gathered from the shards."""
    one, one_history = torchrun(tmp_path, 1, "plain")
    two, two_history = torchrun(tmp_path, 2, "fsdp")
    assert_same_run(one, one_history, two, two_history)
    start = toy_model().state_dict()
    name = "multi_modal_projector.linear.weight"
    assert not torch.equal(one[name], start[name])


def test_fsdp_comparison_catches_summed_gradients(tmp_path):
    """The mutation: FSDP sums the processes' gradients instead of averaging them (the
    loss is already scaled by the process count), doubling step 1's gradient"""
    one, one_history = torchrun(tmp_path, 1, "plain")
    two, two_history = torchrun(tmp_path, 2, "fsdp", SUM_NOT_MEAN="1")
    # twice the plain gradient, within assert_same_run's 1e-4 for the reduction order
    assert math.isclose(
        two_history["grad_norm"][0], 2 * one_history["grad_norm"][0], rel_tol=1e-4
    )
    with pytest.raises(AssertionError):
        assert_same_run(one, one_history, two, two_history)


def test_fsdp_one_process_equals_plain(tmp_path):
    "torchrun with one process: FSDP's wrapper alone, the weights of a plain run"
    one, one_history = torchrun(tmp_path, 1, "plain")
    sharded, sharded_history = torchrun(tmp_path, 1, "fsdp")
    assert_same_run(one, one_history, sharded, sharded_history)


def test_fsdp_on_a_rehearsed_t4_scales_fp16_losses(tmp_path):
    """The T4's branch (fp16 autocast and the loss scaler, no cast by FSDP) on the CPU
    standing in for one: 2 sharded processes against 1 plain fp32 process"""
    one, one_history = torchrun(tmp_path, 1, "plain")
    t4 = {"PALIGEMMA_REHEARSE_GPU": "t4", "TRAIN_DEVICE": "cpu:0"}
    two, two_history = torchrun(tmp_path, 2, "fsdp", **t4)
    assert two_history["scaler"] and not one_history["scaler"]
    # fp16 autocast rounds each layer's output to fp16 (2^-11 ~ 4.9e-4 relative), some
    # ten roundings on the way through 3 layers forward and back: within 1e-2 of fp32
    # (a gradient summed instead of averaged would be 2x)
    assert math.isclose(
        two_history["grad_norm"][0], one_history["grad_norm"][0], rel_tol=1e-2
    )
    for a, b in zip(one_history["loss"], two_history["loss"]):
        # the losses: the same fp16 roundings of the layers' outputs as above
        assert math.isclose(a, b, rel_tol=1e-2), (one_history, two_history)


# --- the policy and the errors, in this process (no process group) ---


def test_policy_gathers_bf16_and_reduces_fp32_only_for_bf16():
    bf16 = sharding_policy(torch.bfloat16)
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    for dtype in (torch.float16, None):
        policy = sharding_policy(dtype)
        assert (policy.param_dtype, policy.reduce_dtype) == (None, None)


def test_fsdp_without_torchrun_is_one_line():
    assert not torch.distributed.is_initialized()
    config = TrainConfig(steps=1, batch_size=4, warmup_steps=0, fsdp=True)
    with pytest.raises(ValueError, match="torchrun") as error:
        train(toy_model(), DATA, collate, config, progress=False)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="process group"):
        shard_model(toy_model(), "cpu")


def test_fsdp_refuses_int8_and_lora_models():
    model = toy_model()
    quantize_int8(model)
    with pytest.raises(ValueError, match="int8.*without quantize") as error:
        check_shardable(model)
    assert "\n" not in str(error.value)
    model = toy_model()
    add_lora(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="LoRA") as error:
        check_shardable(model)
    assert "\n" not in str(error.value)


def test_fsdp_refuses_a_batch_the_processes_do_not_divide():
    config = TrainConfig(steps=1, batch_size=6, warmup_steps=0, fsdp=True)
    # what train checks first, with world() = (rank, 4) under torchrun
    with pytest.raises(ValueError, match="choose a multiple of 4"):
        config.micro_batch_size(4)


# --- the command line: train --fsdp ---


def train_command(out, processes: int, *flags) -> subprocess.CompletedProcess:
    "`train` of the tiny model for 2 steps, under torchrun with `processes` processes"
    args = ["--config", "tiny", "--out", out, "--steps", "2", "--batch-size", "4"]
    args += ["--train-size", "16", "--eval-size", "4", "--no-progress", *flags]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
            "-m",
            "paligemma_lib",
            "train",
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )


def test_train_fsdp_writes_the_gathered_model_transformers_loads(tmp_path):
    import transformers
    from safetensors.torch import load_file

    sharded = train_command(tmp_path / "fsdp", 2, "--fsdp")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    plain = train_command(tmp_path / "plain", 1)
    assert plain.returncode == 0, plain.stderr[-3000:]
    record = json.loads((tmp_path / "fsdp" / "training_record.json").read_text())
    assert record["processes"] == 2 and record["train_config"]["fsdp"] is True
    two = load_file(tmp_path / "fsdp" / "model.safetensors")
    one = load_file(tmp_path / "plain" / "model.safetensors")
    assert two.keys() == one.keys()
    for name in one:
        # as above: Adam moves each entry by at most lr = 1e-3 a step, and gradients
        # equal to ~1e-4 relative move 2 steps by far less than 1e-5
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5)
    reloaded, info = transformers.PaliGemmaForConditionalGeneration.from_pretrained(
        tmp_path / "fsdp", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys"))
    assert not info["mismatched_keys"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--fsdp", "--model", "nano", "--lora"], ["--fsdp", "LoRA"]),
        (["--fsdp"], ["torchrun"]),  # one process, not started by torchrun
    ],
)
def test_train_fsdp_bad_flags_are_one_line(tmp_path, flags, words):
    from test_train import cli, one_error_line

    args = ["--out", tmp_path / "run", "--steps", "2", "--batch-size", "2"]
    args += ["--train-size", "4", "--eval-size", "2", "--no-progress"]
    if "--model" not in flags:
        args += ["--config", "tiny"]
    one_error_line(cli("train", *args, *flags), *words)


def test_a_checkpoint_from_before_fsdp_still_resumes():
    "A checkpoint's settings without the fsdp field: it was off (the default)"
    from dataclasses import asdict

    from paligemma_lib.train import _check_resumable

    config = TrainConfig(steps=2, batch_size=4, warmup_steps=0)
    old = {k: v for k, v in asdict(config).items() if k != "fsdp"}
    _check_resumable({"config": old, "num_examples": 8}, config, 8, "ckpt")
    sharded = TrainConfig(steps=2, batch_size=4, warmup_steps=0, fsdp=True)
    with pytest.raises(ValueError, match="fsdp: False -> True"):
        _check_resumable({"config": old, "num_examples": 8}, sharded, 8, "ckpt")


# --- sharded checkpoints (DCP): stopped, resumed with another number of processes ---

RESUME_SCRIPT = """
import os

import paligemma_lib.resume as resume
from paligemma_lib.sharding import gathered_model
from torch.distributed.checkpoint.state_dict import set_model_state_dict

out_dir, phase = sys.argv[2], sys.argv[3]
if os.environ.get("DROP_OPTIMISER"):  # the mutation: AdamW's state not restored

    def weights_only(model, optimizer, model_state_dict, optim_state_dict):
        set_model_state_dict(model, model_state_dict)

    resume.set_state_dict = weights_only


class Stop(Exception):
    pass


def stop_after_2(step, loss):
    if phase == "stop" and step == 2:
        raise Stop


rank, world_size = init_distributed()
model = toy_model()
config = TrainConfig(
    steps=4, batch_size=8, accumulation=2, lr=1e-2, warmup_steps=1, fsdp=True,
    gradient_checkpointing=True, save_every=2,
)
try:
    history = train(
        model, ColourDataset(32), collate, config, out_dir=out_dir,
        resume=phase == "resume", progress=False, on_step=stop_after_2,
    )
except Stop:
    sys.exit(0)
final = gathered_model(model)
if rank == 0:
    save_file(dict(final.named_parameters()), sys.argv[1])
    with open(sys.argv[1] + ".json", "w") as f:
        json.dump({"loss": history["loss"], "grad_norm": history["grad_norm"]}, f)
"""


def stopped_and_resumed(tmp_path, before: int, after: int, **env):
    """(final weights, history) of the sharded toy run: `before` processes stop after
    step 2 (its checkpoint), `after` processes resume it to step 4"""
    out_dir = tmp_path / f"run-{before}-{after}"
    weights = tmp_path / "resumed.safetensors"
    script = worker_script(RESUME_SCRIPT)
    run_worker(tmp_path, script, before, weights, out_dir, "stop", timeout=180)
    saved = out_dir / "checkpoints" / "step-0000002"
    # DCP: one file of shards per process that wrote, the index, each one's RNG states
    assert len(list(saved.glob("*.distcp"))) == before
    assert (saved / ".metadata").exists() and (saved / "training_state.pt").exists()
    assert sorted(p.name for p in saved.glob("rng-*.pt")) == [
        f"rng-{r}.pt" for r in range(before)
    ]
    assert not weights.exists()  # it stopped
    run_worker(tmp_path, script, after, weights, out_dir, "resume", timeout=180, **env)
    from safetensors.torch import load_file

    assert sorted(p.name for p in (out_dir / "checkpoints").iterdir()) == [
        "step-0000002",
        "step-0000004",
    ]  # no hidden folder left behind
    return load_file(weights), json.loads(open(f"{weights}.json").read())


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_sharded_checkpoint_resumes_on_another_process_count(tmp_path, before, after):
    """Stopped after 2 of 4 steps and resumed with another number of processes: the
    run of one plain process, uninterrupted. The checkpoint holds the fp32 shards and
    AdamW's moments bit for bit, and the data order is a function of (step, seed)
    (global_batch) and of the rank (shard), not of the RNG states, so each step sees
    the same global batch whatever the process count; what differs from the plain run
    is the order of the sums, within and across processes: assert_same_run's
    tolerances, derived above."""
    one, one_history = torchrun(tmp_path, 1, "plain")
    resumed, history = stopped_and_resumed(tmp_path, before, after)
    assert len(history["loss"]) == 4  # 2 from the checkpoint's history, 2 resumed
    assert_same_run(one, one_history, resumed, history)
    # a plain run (no fsdp, no process group) refuses the sharded checkpoint
    config = TrainConfig(steps=4, batch_size=8, accumulation=2, warmup_steps=1)
    out_dir = tmp_path / f"run-{before}-{after}"
    with pytest.raises(ValueError, match="sharded checkpoint.*under torchrun") as e:
        train(toy_model(), DATA, collate, config, out_dir, resume=True, progress=False)
    assert "\n" not in str(e.value)


def test_resumed_comparison_catches_a_lost_optimiser_state(tmp_path):
    """The mutation: the weights restored but not AdamW's moments and step count; step
    3 then moves each weight by about lr = 1e-2 (a first Adam step), not as the run
    did, far beyond assert_same_run's 1e-5"""
    one, one_history = torchrun(tmp_path, 1, "plain")
    resumed, history = stopped_and_resumed(tmp_path, 2, 1, DROP_OPTIMISER="1")
    with pytest.raises(AssertionError):
        assert_same_run(one, one_history, resumed, history)


def test_readme_fsdp_commands_parse_with_two_examples_per_gpu():
    """The README's full fine-tuning commands: options `train` takes, and 2 examples
    per GPU and micro-batch, what chapter 11.2's per-process memory counts assume"""
    import re
    import shlex
    from pathlib import Path

    from paligemma_lib.cli.main import parse_args

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    readme = readme.replace("\\\n", " ")
    pattern = r"^torchrun --nproc_per_node (\d+) -m paligemma_lib (train .*)$"
    commands = re.findall(pattern, readme, re.MULTILINE)
    assert [n for n, _ in commands] == ["8", "2"]
    for processes, command in commands:
        args = parse_args(shlex.split(command))
        assert args.fsdp and args.gradient_checkpointing and args.save_every
        config = TrainConfig(batch_size=args.batch_size, accumulation=args.accumulation)
        assert config.micro_batch_size(int(processes)) == 2
