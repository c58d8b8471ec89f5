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

from paligemma_lib.lora import LoraConfig, add_lora, lora_modules
from paligemma_lib.quantize import quantize_int8
from paligemma_lib.sharding import (
    check_shardable,
    shard_model,
    sharded_layers,
    sharding_policy,
)
from paligemma_lib.train import TrainConfig, train

SCRIPT = """
import os
import paligemma_lib.train as training
import torch.distributed as dist
from paligemma_lib.adapters import save_adapter
from paligemma_lib.lora import LoraConfig, add_lora, lora_state_dict
from paligemma_lib.sharding import data_parallel, gathered_model

fsdp, lora = sys.argv[2] == "fsdp", bool(os.environ.get("LORA"))
optimised, scattered = [], []  # AdamW's parameters; gradient reduce-scatters


def counted_optimizer(model, *args, **kw):
    optimizer = make_optimizer(model, *args, **kw)
    optimised.extend(p.numel() for g in optimizer.param_groups for p in g["params"])
    return optimizer


def counted_reduce_scatter(*, input, **kw):  # FSDP2's one call per unit and step
    scattered.append(input.numel())
    return reduce_scatter_single(input=input, **kw)


make_optimizer, training.make_optimizer = training.make_optimizer, counted_optimizer
reduce_scatter_single = dist.reduce_scatter_single
dist.reduce_scatter_single = counted_reduce_scatter
if os.environ.get("SUM_NOT_MEAN"):  # the mutation: FSDP sums the gradients

    def summing(*args, **kw):
        model = data_parallel(*args, **kw)
        for unit in model.modules():
            if hasattr(unit, "set_gradient_divide_factor"):  # every FSDP unit
                unit.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
                unit.set_gradient_divide_factor(1.0)
        return model

    training.data_parallel = summing
device = os.environ.get("TRAIN_DEVICE", "cpu")
rank, world_size = init_distributed(device)
model = toy_model()
if lora:  # both towers' attention adapted: trainable weights in every layer unit
    add_lora(model, LoraConfig(**LORA))
config = TrainConfig(
    steps=4, batch_size=8, accumulation=2, lr=1e-2, warmup_steps=1, fsdp=fsdp,
    gradient_checkpointing=fsdp,
)
history = train(
    model, ColourDataset(32), collate, config, progress=False, device=device
)
final = gathered_model(model) if fsdp else model
if rank == 0:
    if lora:  # the adapter, as a run writes it; the gathered copy's base is meta
        save_adapter(final, sys.argv[1] + ".adapter")
    weights = lora_state_dict(final) if lora else dict(final.named_parameters())
    save_file({k: v.contiguous() for k, v in weights.items()}, sys.argv[1])
    with open(sys.argv[1] + ".json", "w") as f:
        json.dump({"loss": history["loss"], "grad_norm": history["grad_norm"],
                   "scaler": training.grad_scaler(device).is_enabled(),
                   "optimised": optimised, "scattered": scattered}, f)
"""
LORA = dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"])


def torchrun(tmp_path, processes: int, mode: str, **env) -> tuple[dict, dict]:
    """(final weights, {"loss", "grad_norm"} per step) of the toy run with `processes`
    processes; mode "fsdp" (sharded, gradient checkpointing) or "plain" """
    out = tmp_path / f"weights-{processes}-{mode}.safetensors"
    script = f"LORA = {LORA!r}\n" + SCRIPT
    run_worker(
        tmp_path, worker_script(script), processes, out, mode, timeout=180, **env
    )
    from safetensors.torch import load_file

    return load_file(out), json.loads(open(f"{out}.json").read())


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory):
    """(adapter weights, history, the adapter's folder) of one plain process's LoRA
    run of the toy task"""
    folder = tmp_path_factory.mktemp("lora-reference")
    weights, history = torchrun(folder, 1, "plain", LORA="1")
    return weights, history, folder / "weights-1-plain.safetensors.adapter"


def assert_same_run(one, one_history, two, two_history):
    grad_norms = one_history["grad_norm"]
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
    # Later losses: the weights compared (all, or a LoRA run's adapters: N entries)
    # within 1e-5 an entry, so to first order |d loss| <= |grad| |d w| <= |grad| x
    # 1e-5 x sqrt(N), with |grad| the step's recorded norm (N ~ 4.5e4 and |grad| ~ 3
    # for the whole toy model: ~6e-3); plus the loss's own rounding, 1e-5 relative
    entries = sum(t.numel() for t in one.values())
    for a, b, norm in zip(one_history["loss"], two_history["loss"], grad_norms):
        bound = norm * 1e-5 * math.sqrt(entries) + 1e-5 * abs(a)
        assert abs(a - b) <= bound, (one_history, two_history)


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


# PEFT asks transformers for a property that transformers 5 renamed
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_fsdp_lora_two_processes_equal_one_without(tmp_path, lora_reference):
    """LoRA under FSDP: the frozen base sharded, the adapters trained. On the same
    global batch, 2 sharded processes train the adapters as one plain process; AdamW
    holds the adapters alone; FSDP reduce-scatters only their gradients, none of the
    frozen base's; the adapter written at the end is a one-process run's, and PEFT
    loads it."""
    from safetensors.torch import load_file

    from paligemma_lib.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapter
    from paligemma_lib.lora import count_parameters, lora_state_dict

    one, one_history, one_folder = lora_reference
    two, two_history = torchrun(tmp_path, 2, "fsdp", LORA="1")
    assert_same_run(one, one_history, two, two_history)
    model = toy_model()
    add_lora(model, LoraConfig(**LORA))
    trainable, total = count_parameters(model)
    assert set(one) == set(lora_state_dict(model)) and trainable < total / 20
    assert sum(one_history["optimised"]) == sum(two_history["optimised"]) == trainable
    # one reduce-scatter per layer unit and step (accumulation syncs the last
    # micro-batch only), of each adapter's gradient padded to a multiple of 2 rows;
    # the root unit, embeddings and all frozen, sends none
    padded = sum(2 * math.ceil(p.shape[0] / 2) * p[0].numel() for p in one.values())
    assert sum(two_history["scattered"]) == 4 * padded
    assert len(two_history["scattered"]) == 4 * len(sharded_layers(model))
    assert one_history["scattered"] == []  # one plain process: nothing to exchange
    # the adapter folders: the same config, names and (as above) weights
    folders = [one_folder, tmp_path / "weights-2-fsdp.safetensors.adapter"]
    configs = [(f / ADAPTER_CONFIG).read_text() for f in folders]
    assert configs[0] == configs[1]
    files = [load_file(f / ADAPTER_WEIGHTS) for f in folders]
    assert files[0].keys() == files[1].keys()
    loaded = toy_model()
    assert sorted(load_adapter(loaded, folders[1])) == sorted(lora_modules(model))
    for name, tensor in lora_state_dict(loaded).items():
        # as assert_same_run's weights: within 1e-5 an entry
        torch.testing.assert_close(tensor, one[name], rtol=0, atol=1e-5)
    start = lora_state_dict(model)
    name = "language_model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert not torch.equal(one[name], start[name])  # zeros at the start
    # PEFT loads it onto transformers' copy of the same base, with the same logits
    import peft
    import transformers

    from paligemma_lib.weights import save_pretrained

    save_pretrained(toy_model(), tmp_path / "base")
    theirs = transformers.PaliGemmaForConditionalGeneration.from_pretrained(
        tmp_path / "base", dtype=torch.float32
    )
    theirs = peft.PeftModel.from_pretrained(theirs, folders[1]).eval()
    batch = collate([DATA[i] for i in range(4)])
    keys = ("input_ids", "pixel_values", "attention_mask", "token_type_ids")
    with torch.no_grad():
        expected = loaded.eval()(**{k: batch[k] for k in keys}).logits
        got = theirs(**{k: batch[k] for k in keys}).logits
    real = batch["attention_mask"].bool()  # padding's logits are nobody's
    # fp32 both, other kernels and orders: products of width <= 32 (~32 x 2^-24
    # relative each) over 3 layers and a softmax, within 1e-4 on logits of order 1
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        base = toy_model().eval()(**{k: batch[k] for k in keys}).logits
    # the comparison sees the adapter: without it the logits move 10x the tolerance
    assert (base[real] - expected[real]).abs().max() > 10 * 1e-4


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
    standing in for one: 2 sharded processes against 1 plain fp32 process, equal while
    no step overflows. Each process scales its loss by the process count, so its fp16
    backward carries W times one process's per-token gradients and overflows at a
    lower scale, on its own micro-batches: which steps the scaler skips need not be one
    process's. From GradScaler's 2^16 no step overflows here; the test checks
    that rather than assuming it (the norm is global: inf if any shard overflowed).
    After an overflow every process skips alike: the test below."""
    one, one_history = torchrun(tmp_path, 1, "plain")
    t4 = {"PALIGEMMA_REHEARSE_GPU": "t4", "TRAIN_DEVICE": "cpu:0"}
    two, two_history = torchrun(tmp_path, 2, "fsdp", **t4)
    assert two_history["scaler"] and not one_history["scaler"]
    assert all(map(math.isfinite, two_history["grad_norm"])), (
        "a step overflowed: the runs are comparable only while none does",
        two_history["grad_norm"],
    )
    # fp16 autocast rounds each layer's output to fp16 (2^-11 ~ 4.9e-4 relative), some
    # ten roundings on the way through 3 layers forward and back: within 1e-2 of fp32
    # (a gradient summed instead of averaged would be 2x)
    assert math.isclose(
        two_history["grad_norm"][0], one_history["grad_norm"][0], rel_tol=1e-2
    )
    for a, b in zip(one_history["loss"], two_history["loss"]):
        # the losses: the same fp16 roundings of the layers' outputs as above
        assert math.isclose(a, b, rel_tol=1e-2), (one_history, two_history)


OVERFLOW_SCRIPT = """
import os

import paligemma_lib.train as training

rank, world_size = init_distributed("cpu")
made, steps = training.grad_scaler, []
if os.environ.get("OWN_FINDING"):  # the mutation: each process its own inf check
    from torch.distributed.tensor import DTensor

    def own_shards_only(op_call, args, kwargs):
        grads, found_inf, inv_scale = args
        op_call([g.to_local() for g in grads], found_inf, inv_scale)

    check = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
    DTensor._op_dispatcher._custom_op_handlers[check] = own_shards_only


def grad_scaler(*args, **kw):
    "The run's scaler; at its second unscale_, one inf in process 0's shard only"
    scaler = made(*args, **kw)
    unscale = scaler.unscale_

    def unscale_(optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        steps.append({"scale": scaler.get_scale(), "before": [
            p.detach().to_local().clone() for p in params]})
        if rank == 0 and len(steps) == 2:
            with torch.no_grad():
                params[0].grad.to_local().view(-1)[0] = float("inf")
        return unscale(optimizer)

    scaler.unscale_ = unscale_
    return scaler


training.grad_scaler = grad_scaler
model = toy_model()
config = TrainConfig(steps=4, batch_size=8, accumulation=2, lr=1e-2, warmup_steps=1,
                     fsdp=True)
history = train(model, ColourDataset(32), collate, config, progress=False,
                device="cpu:0")
params = list(model.parameters())
after = [s["before"] for s in steps[1:]] + [[p.detach().to_local() for p in params]]
record = [{"scale": s["scale"], "moved": any(not torch.equal(a, b) for a, b in
                                            zip(s["before"], later))}
          for s, later in zip(steps, after)]
with open(f"{sys.argv[1]}.{rank}.json", "w") as f:
    json.dump({"steps": record, "grad_norm": history["grad_norm"]}, f)
"""


def overflow_runs(tmp_path, **env) -> list[dict]:
    "Each process's record of OVERFLOW_SCRIPT's run by 2 processes"
    out = tmp_path / "overflow"
    t4 = {"PALIGEMMA_REHEARSE_GPU": "t4", **env}
    run_worker(tmp_path, worker_script(OVERFLOW_SCRIPT), 2, out, timeout=180, **t4)
    return [json.loads(open(f"{out}.{rank}.json").read()) for rank in range(2)]


def test_fsdp_fp16_overflow_in_one_shard_skips_the_step_everywhere(tmp_path):
    """FSDP leaves each process its own shard of every gradient, so an fp16 overflow
    may show in one process's shards only. The scaler all-reduces its finding: every
    process skips that step and halves its scale, and the weights and scales stay
    consistent (an inf planted in one entry of process 0's shard at step 2, the T4's
    branch rehearsed on the CPU). torch.amp.GradScaler does it through DTensor, whose
    unscale_ takes the max of the processes' findings."""
    runs = overflow_runs(tmp_path)
    assert runs[0] == runs[1]  # the same scales and skips; the global norm
    scale = 2.0**16  # GradScaler's first
    assert runs[0]["steps"] == [
        {"scale": scale, "moved": True},
        {"scale": scale, "moved": False},  # skipped
        {"scale": scale / 2, "moved": True},
        {"scale": scale / 2, "moved": True},
    ]
    norms = runs[0]["grad_norm"]
    assert math.isinf(norms[1]) and all(map(math.isfinite, norms[:1] + norms[2:]))


def test_overflow_comparison_catches_a_finding_of_its_own_shards(tmp_path):
    """The mutation: each process checks only its own shards for an inf; process 1
    then steps and keeps its scale while process 0 skips and halves its own"""
    runs = overflow_runs(tmp_path, OWN_FINDING="1")
    skipped, stepped = (run["steps"][1]["moved"] for run in runs)
    assert not skipped and stepped
    assert runs[0]["steps"][2]["scale"] == runs[1]["steps"][2]["scale"] / 2


# --- the policy and the errors, in this process (no process group) ---


def test_policy_gathers_bf16_and_reduces_fp32_only_for_bf16():
    bf16 = sharding_policy(torch.bfloat16)
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    for dtype in (torch.float16, None):
        policy = sharding_policy(dtype)
        assert (policy.param_dtype, policy.reduce_dtype) == (None, None)


@pytest.mark.parametrize(
    "device, expected",
    [
        ("cuda:0", [torch.device("cuda:0")]),
        ("cuda:1", [torch.device("cuda:1")]),
        ("cpu", None),
        ("cpu:0", None),
    ],
)
def test_ddp_is_given_the_gpu_of_every_rank_rank_0_too(monkeypatch, device, expected):
    """DistributedDataParallel's device_ids: the process's GPU on CUDA, cuda:0 as well
    as cuda:1 (index 0 is an index), and none on the CPU. DDP's constructor is faked:
    no process group, no GPU needed"""
    import paligemma_lib.sharding as sharding

    given = []

    def fake_ddp(model, device_ids=None, **kw):
        given.append(device_ids)
        return model

    monkeypatch.setattr(sharding, "DistributedDataParallel", fake_ddp)
    model = toy_model()
    assert sharding.data_parallel(model, device, world_size=2) is model
    assert given == [expected]
    assert sharding.data_parallel(model, device, world_size=1) is model  # no DDP
    assert len(given) == 1


def test_fsdp_without_torchrun_is_one_line():
    assert not torch.distributed.is_initialized()
    config = TrainConfig(steps=1, batch_size=4, warmup_steps=0, fsdp=True)
    with pytest.raises(ValueError, match="torchrun") as error:
        train(toy_model(), DATA, collate, config, progress=False)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="process group"):
        shard_model(toy_model(), "cpu")


def test_fsdp_refuses_int8_models():
    model = toy_model()
    quantize_int8(model)
    with pytest.raises(ValueError, match="int8.*without quantize") as error:
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
    args = ["--out", out, "--steps", "2", "--batch-size", "4", "--train-size", "16"]
    args += ["--eval-size", "4", "--no-progress", *flags]
    if "--model" not in flags:
        args += ["--config", "tiny"]
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
    plain_dir = tmp_path / "plain"
    plain = train_command(plain_dir, 1)
    assert plain.returncode == 0, plain.stderr[-3000:]
    record = json.loads((tmp_path / "fsdp" / "training_record.json").read_text())
    assert record["processes"] == 2 and record["train_config"]["fsdp"] is True
    assert record["segments"] == [{"steps": [0, 2], "processes": 2}]
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
    # LoRA on the model just written, sharded: the adapter, gathered, as a LoRA run's
    from paligemma_lib.adapters import load_adapter
    from paligemma_lib.weights import load_pretrained

    lora = train_command(tmp_path / "lora", 2, "--fsdp", "--lora", "--model", plain_dir)
    assert lora.returncode == 0, lora.stderr[-3000:]
    record = json.loads((tmp_path / "lora" / "training_record.json").read_text())
    assert record["processes"] == 2 and record["lora"]["r"] == 8
    assert sorted(p.name for p in (tmp_path / "lora").glob("adapter_*")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    adapted = load_adapter(load_pretrained(plain_dir), tmp_path / "lora")
    assert len(adapted) == 7 * 2  # q, k, v, o, gate, up, down in the 2 decoder layers


@pytest.mark.parametrize(
    "flags",
    [["--config", "tiny"], ["--model", "nano", "--lora"]],
    ids=["full", "lora"],
)
def test_train_fsdp_without_torchrun_is_one_line(tmp_path, flags):
    from test_train import cli, one_error_line

    args = ["--out", tmp_path / "run", "--steps", "2", "--batch-size", "2"]
    args += ["--train-size", "4", "--eval-size", "2", "--no-progress"]
    one_error_line(cli("train", *args, "--fsdp", *flags), "torchrun")


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
lora = bool(os.environ.get("LORA"))
if os.environ.get("DROP_OPTIMISER"):  # the mutation: AdamW's state not restored

    def weights_only(model, optimizer, model_state_dict, optim_state_dict, options):
        return set_model_state_dict(model, model_state_dict, options=options)

    resume.set_state_dict = weights_only


class Stop(Exception):
    pass


def stop_after_2(step, loss):
    if phase == "stop" and step == 2:
        raise Stop


rank, world_size = init_distributed("cpu")
model = toy_model()
if lora:
    from paligemma_lib.lora import LoraConfig, add_lora, lora_state_dict

    add_lora(model, LoraConfig(**LORA))
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
    weights = lora_state_dict(final) if lora else dict(final.named_parameters())
    save_file({k: v.contiguous() for k, v in weights.items()}, sys.argv[1])
    with open(sys.argv[1] + ".json", "w") as f:
        json.dump({"loss": history["loss"], "grad_norm": history["grad_norm"],
                   "segments": history["segments"]}, f)
"""


def stopped_and_resumed(tmp_path, before: int, after: int, lora=False, **env):
    """(final weights, history) of the sharded toy run (with `lora`, of its adapters
    LORA): `before` processes stop after step 2 (its checkpoint), `after` processes
    resume it to step 4"""
    import torch.distributed.checkpoint as dcp

    out_dir = tmp_path / f"run-{before}-{after}"
    weights = tmp_path / "resumed.safetensors"
    script = worker_script(f"LORA = {LORA!r}\n" + RESUME_SCRIPT)
    both = {"LORA": "1"} if lora else {}
    run_worker(tmp_path, script, before, weights, out_dir, "stop", timeout=180, **both)
    saved = out_dir / "checkpoints" / "step-0000002"
    # DCP: one file of shards per process that wrote, the index, each one's RNG states
    assert len(list(saved.glob("*.distcp"))) == before
    assert (saved / ".metadata").exists() and (saved / "training_state.pt").exists()
    index = dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    assert not [k for k in index if "lm_head" in k]  # the tied head: the embedding
    assert sorted(p.name for p in saved.glob("rng-*.pt")) == [
        f"rng-{r}.pt" for r in range(before)
    ]
    assert not weights.exists()  # it stopped
    run_worker(
        tmp_path, script, after, weights, out_dir, "resume", timeout=180, **both, **env
    )
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
    # the history (and so training_record.json) says which processes ran which steps
    assert history["segments"] == [
        {"steps": [0, 2], "processes": before},
        {"steps": [2, 4], "processes": after},
    ]
    assert_same_run(one, one_history, resumed, history)
    # a plain run (no fsdp, no process group) refuses the sharded checkpoint
    config = TrainConfig(steps=4, batch_size=8, accumulation=2, warmup_steps=1)
    out_dir = tmp_path / f"run-{before}-{after}"
    with pytest.raises(ValueError, match="sharded checkpoint.*under torchrun") as e:
        train(toy_model(), DATA, collate, config, out_dir, resume=True, progress=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("before, after", [(2, 2), (2, 1)])
def test_sharded_lora_checkpoint_resumes(tmp_path, lora_reference, before, after):
    """A LoRA run's sharded checkpoint holds the adapters and their AdamW state
    alone (the frozen base is the model the run started from, as in a plain LoRA
    checkpoint); stopped after 2 of 4 steps and resumed by 2 processes or 1, the run
    ends as one plain LoRA process's, uninterrupted: assert_same_run's tolerances,
    for the reasons of the test above"""
    import torch.distributed.checkpoint as dcp

    from paligemma_lib.lora import lora_state_dict

    one, one_history, _ = lora_reference
    resumed, history = stopped_and_resumed(tmp_path, before, after, lora=True)
    assert len(history["loss"]) == 4
    assert_same_run(one, one_history, resumed, history)
    saved = tmp_path / f"run-{before}-{after}" / "checkpoints" / "step-0000002"
    index = dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    model = toy_model()
    add_lora(model, LoraConfig(**LORA))
    stored = {k.removeprefix("model.") for k in index if k.startswith("model.")}
    assert stored == set(lora_state_dict(model))


TIED_SCRIPT = """
import torch.distributed.checkpoint as dcp
from paligemma_lib.optimization import make_optimizer, make_scheduler
from paligemma_lib.resume import load_sharded_checkpoint, save_sharded_checkpoint
from paligemma_lib.sharding import data_parallel, gathered_model

rank, world_size = init_distributed("cpu")


def sharded(seed):
    "The toy model sharded, after one AdamW step (its moments exist)"
    model = data_parallel(toy_model(seed), "cpu", world_size, fsdp=True)
    optimizer = make_optimizer(model, lr=1e-2)
    for p in model.parameters():
        p.grad = torch.full_like(p, seed + 1.0)
    optimizer.step()
    return model, optimizer, make_scheduler(optimizer, 1, 4)


written = sharded(0)
folder = save_sharded_checkpoint(sys.argv[2], *written, {"step": 1})
read = sharded(1)
load_sharded_checkpoint(folder, *read)
tied = []
for model, optimizer, _ in (written, read):
    text = model.language_model
    tied.append(text.lm_head.weight is text.model.embed_tokens.weight)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # the moments read back move the weights alike
gathered = [gathered_model(model) for model, _, _ in (written, read)]
if rank == 0:
    for i, model in enumerate(gathered):
        save_file({k: v.contiguous() for k, v in model.state_dict().items()
                   if "lm_head" not in k}, f"{sys.argv[1]}.{i}")
    with open(sys.argv[1] + ".json", "w") as f:
        json.dump({"tied": tied}, f)
"""


def test_sharded_checkpoint_stores_the_tied_embedding_once(tmp_path):
    """A full-model sharded checkpoint (2 processes, after an AdamW step) holds the
    embedding, which the LM head shares, once: no lm_head entry in DCP's index, for
    the weights or AdamW's moments. Read into a model initialised otherwise, the head
    is still the embedding, and one more AdamW step moves both models alike, bit for
    bit (the same fp32 shards, moments and step count). Seen to catch: the weights'
    state dict saved whole (the head stored a second time)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    out = tmp_path / "weights.safetensors"
    run_worker(tmp_path, worker_script(TIED_SCRIPT), 2, out, tmp_path / "run")
    saved = tmp_path / "run" / "checkpoints" / "step-0000001"
    index = dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    embedding = "language_model.model.embed_tokens.weight"
    assert [k for k in index if "lm_head" in k] == []
    assert [k for k in index if k.startswith("model.") and embedding in k] == [
        "model." + embedding
    ]
    assert json.loads(open(f"{out}.json").read()) == {"tied": [True, True]}
    written, read = load_file(f"{out}.0"), load_file(f"{out}.1")
    assert written.keys() == read.keys() and embedding in written
    for name, tensor in written.items():
        assert torch.equal(read[name], tensor), name


def test_resumed_comparison_catches_a_lost_optimiser_state(tmp_path):
    """The mutation: the weights restored but not AdamW's moments and step count; step
    3 then moves each weight by about lr = 1e-2 (a first Adam step), not as the run
    did, far beyond assert_same_run's 1e-5"""
    one, one_history = torchrun(tmp_path, 1, "plain")
    resumed, history = stopped_and_resumed(tmp_path, 2, 1, DROP_OPTIMISER="1")
    with pytest.raises(AssertionError):
        assert_same_run(one, one_history, resumed, history)


def test_readme_fsdp_commands_parse_with_two_examples_per_gpu():
    """A.1's full fine-tuning commands: options `train` takes, and 2 examples
    per GPU and micro-batch, what chapter 11.2's per-process memory counts assume"""
    import re
    import shlex
    from pathlib import Path

    from paligemma_lib.cli.main import parse_args

    readme = (Path(__file__).parents[1] / "book/a1_using_the_library.md").read_text()
    readme = readme.replace("\\\n", " ")
    pattern = r"^torchrun --nproc_per_node (\d+) -m paligemma_lib (train --fsdp .*)$"
    commands = re.findall(pattern, readme, re.MULTILINE)
    assert [n for n, _ in commands] == ["8", "2"]
    for processes, command in commands:
        args = parse_args(shlex.split(command))
        assert args.fsdp and args.gradient_checkpointing and args.save_every
        config = TrainConfig(batch_size=args.batch_size, accumulation=args.accumulation)
        assert config.micro_batch_size(int(processes)) == 2
