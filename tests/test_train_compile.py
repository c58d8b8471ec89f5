"""Chapter 11.2's faster step (issue 49 section 2): the forward's value checks run on
the host before the batch moves, so a step reads back only its loss and gradient
norm, and `TrainConfig.compile` runs the forward and backward as one torch.compile
graph that computes what the eager step computes."""

import collections
import copy
import sys

import pytest
import torch
from test_train import DATA, collate, toy_model

from paligemma_lib.input_checks import _InputsChecked
from paligemma_lib.optimization import make_optimizer, make_scheduler
from paligemma_lib.train import (
    TrainConfig,
    _check_on_host,
    _check_resumable,
    _step_model,
    train,
    training_step,
)

# Reading a tensor's values on the host: on a GPU each waits for every queued kernel.
READS = {"item", "tolist", "nonzero", "numpy", "__bool__", "__int__", "__float__",
         "__index__"}  # fmt: skip


class CountReads(torch.overrides.TorchFunctionMode):
    "Counts the calls that read tensor values back to Python"

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            caller = sys._getframe(1).f_code.co_name  # the function that reads
            self.reads.append(f"{caller}: {func.__name__}")
        return func(*args, **(kwargs or {}))


def batch_of(n=4, start=0):
    return collate([DATA[i] for i in range(start, start + n)])


def forward(model, batch):
    return model(**{k: batch[k] for k in batch.keys() if k != "labels"})


def test_the_forward_reads_values_only_outside_inputs_checked():
    model, batch = toy_model(), batch_of()
    with CountReads() as plain:
        forward(model, batch)
    assert plain.reads  # the token-id range and the <image> count per row
    with CountReads() as checked, _InputsChecked():
        forward(model, batch)
    assert checked.reads == []
    assert not _InputsChecked.active  # the context ends with its block


def test_a_step_reads_back_only_its_loss_and_norm():
    model = toy_model()
    optimizer = make_optimizer(model, lr=1e-3)
    scheduler = make_scheduler(optimizer, 1, 10)
    with CountReads() as counted:
        training_step(model, [batch_of(2), batch_of(2, 2)], optimizer, scheduler)
    # AdamW keeps its step counters on the host (neither fused nor capturable)
    reads = collections.Counter(r for r in counted.reads if r != "_get_value: item")
    assert reads == {
        # two micro-batches checked on the host, before they move: min and max ids,
        # the rows with a wrong <image> count, the answer tokens
        "_check_token_ids: item": 4,
        "_check_image_tokens: nonzero": 2,
        "_check_image_tokens: tolist": 2,
        "count_targets: __int__": 2,
        # and the one wait a step needs on a GPU: its loss and gradient norm
        "training_step: item": 2,
    }


def test_the_host_checks_give_the_forwards_errors():
    model, batch = toy_model(), batch_of(2)
    vocab = model.config.text.vocab_size
    bad = copy.deepcopy(batch)
    bad.input_ids[0, -1] = vocab
    with pytest.raises(ValueError, match=f"to {vocab}, but the vocabulary has {vocab}"):
        _check_on_host(model, bad)
    bad = copy.deepcopy(batch)
    bad.input_ids[1, 0] = 0  # one <image> token fewer in row 1
    with pytest.raises(ValueError, match="row 1 of input_ids holds 3 <image>"):
        _check_on_host(model, bad)
    _check_on_host(model, batch)  # a good batch passes


def first_step(model, compiled: bool):
    "(loss, norm, gradients) of one step of `model` through the eager or compiled path"
    optimizer = make_optimizer(model, lr=1e-3)
    scheduler = make_scheduler(optimizer, 1, 10)
    grads = {}
    optimizer.register_step_pre_hook(
        lambda *_: grads.update(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        )
    )
    stepped = _step_model(model, TrainConfig(compile=compiled), 1)
    loss, norm = training_step(stepped, [batch_of(8)], optimizer, scheduler)
    return loss, norm, grads


def test_the_compiled_step_computes_the_eager_step():
    model = toy_model()
    eager = first_step(copy.deepcopy(model), compiled=False)
    compiled = first_step(model, compiled=True)  # fullgraph: one graph or an error
    # fp32 both sides (u = 2^-24); Inductor may reorder each reduction, of at most
    # 1,792 terms (the vocabulary's log-softmax), in each of 3 layers and the loss:
    # (3 + 1) x 1,792 x u relative
    rtol = 4 * 1792 * 2**-24
    assert compiled[0] == pytest.approx(eager[0], rel=rtol)
    assert compiled[1] == pytest.approx(eager[1], rel=rtol)
    # the same reorderings; an entry whose terms cancel keeps their rounding: rtol
    # of terms no larger than the largest gradient entry of the model
    atol = rtol * max(g.abs().max().item() for g in eager[2].values())
    for name, g in eager[2].items():
        torch.testing.assert_close(compiled[2][name], g, rtol=rtol, atol=atol)


def test_the_compiled_step_computes_the_eager_step_with_lora_and_token_rows():
    "the segment recipes' shape: LoRA on every linear layer and trained token rows"
    from paligemma_lib.lora import LoraConfig, add_lora
    from paligemma_lib.trainable_tokens import add_trainable_tokens

    model = toy_model()
    add_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    add_trainable_tokens(model, [3, 5, 7], torch.float32)
    for p in model.parameters():  # LoRA's B starts at 0: give it values to test
        if p.requires_grad:
            torch.nn.init.normal_(
                p, std=0.02, generator=torch.Generator().manual_seed(0)
            )
    eager = first_step(copy.deepcopy(model), compiled=False)
    compiled = first_step(model, compiled=True)
    rtol = 4 * 1792 * 2**-24  # as in the test above
    assert compiled[0] == pytest.approx(eager[0], rel=rtol)
    assert compiled[1] == pytest.approx(eager[1], rel=rtol)
    rows = "language_model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    assert rows in eager[2] and all("lora_" in n for n in eager[2] if n != rows)
    atol = rtol * max(g.abs().max().item() for g in eager[2].values())  # as above
    for name, g in eager[2].items():  # the trained ones only
        torch.testing.assert_close(compiled[2][name], g, rtol=rtol, atol=atol)


class Counted(torch.nn.Module):
    "What torch.compile returned, its forward calls counted"

    def __init__(self, compiled):
        super().__init__()
        self.compiled, self.calls = compiled, 0
        self.config = compiled.config  # the host's checks read it

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.compiled(*args, **kwargs)


def test_train_with_compile_trains_the_model_it_was_given(monkeypatch):
    config = TrainConfig(steps=2, batch_size=4, warmup_steps=1, lr=1e-3)
    eager = train(toy_model(), DATA, collate, config, progress=False)
    config.compile, model = True, toy_model()
    start = copy.deepcopy(model.state_dict())
    made, compile = [], torch.compile
    monkeypatch.setattr(
        torch,
        "compile",
        lambda m, **kw: made.append(Counted(compile(m, **kw))) or made[-1],
    )
    compiled = train(model, DATA, collate, config, progress=False)
    assert len(made) == 1 and made[0].calls == 2  # every step ran the compiled module
    # the first step's loss and norm come before any update: as in the test above
    rtol = 4 * 1792 * 2**-24
    for key in ("loss", "grad_norm"):
        assert compiled[key][0] == pytest.approx(eager[key][0], rel=rtol)
    assert compiled["step"] == [1, 2]
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, start[k])]
    assert len(moved) == len(start)  # the compiled module's updates are the model's


def test_compile_is_refused_under_torchrun_and_may_change_on_resume():
    with pytest.raises(
        ValueError,
        match="one process without FSDP; this run has 2 process.*leave out --compile",
    ):
        _step_model(toy_model(), TrainConfig(compile=True), world_size=2)
    with pytest.raises(ValueError, match="without FSDP.*fsdp=True"):
        _step_model(toy_model(), TrainConfig(compile=True, fsdp=True), world_size=1)
    stored = {"config": vars(TrainConfig(compile=False)), "num_examples": 64}
    _check_resumable(stored, TrainConfig(compile=True), 64, "ckpt")  # no error
    with pytest.raises(ValueError, match="seed: 0 -> 1"):
        _check_resumable(stored, TrainConfig(seed=1), 64, "ckpt")


def test_the_compiled_step_under_the_t4_rehearsal(monkeypatch):
    "cpu:0 playing a T4: fp16 autocast and the loss scaler, compiled as on the GPU"
    from paligemma_lib.train import autocast_dtype, grad_scaler

    monkeypatch.setenv("PALIGEMMA_REHEARSE_GPU", "t4")
    device = torch.device("cpu", 0)
    assert autocast_dtype(device) == torch.float16 and grad_scaler(device).is_enabled()
    results = []
    for compiled in (False, True):
        model = toy_model()
        optimizer = make_optimizer(model, lr=1e-3)
        scheduler = make_scheduler(optimizer, 1, 10)
        stepped = _step_model(model, TrainConfig(compile=compiled), 1, device)
        results.append(
            training_step(
                stepped,
                [batch_of(8)],
                optimizer,
                scheduler,
                1.0,
                device,
                1,
                grad_scaler(device),
            )  # fmt: skip
        )
    (loss, norm), (compiled_loss, compiled_norm) = results
    # each layer's fp16 outputs may round differently in the two ways (one ulp,
    # 2^-11 relative), in 3 layers and the loss
    rtol = 4 * 2**-11
    assert compiled_loss == pytest.approx(loss, rel=rtol)
    assert compiled_norm == pytest.approx(norm, rel=rtol)
