"""Issue 24, section 2: the operations an eager decoding step dispatches, ours against
transformers', counted on the CPU; no host synchronisation per step; the deferred
finiteness check still names the step."""

import collections

import pytest
import torch
from hf_reference import transformers_pair
from test_generation import model_for, prompts, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from paligemma_lib import generation
from paligemma_lib.generation import decode_step, generate
from paligemma_lib.kv_cache import StaticKVCache
from paligemma_lib.stopping import NonFiniteLogitsError

# the ops by which PyTorch reads a device value back to the host (a sync on a GPU)
SYNCS = {"_local_scalar_dense", "item", "is_nonzero"}
ROWS = [6, 2, 4, 3, 5, 1, 7, 2]  # prompt lengths, left-padded


def _is_view(func) -> bool:
    "An op that only makes a view (no kernel): its outputs alias inputs, unwritten"
    if func.overloadpacket is torch.ops.aten._unsafe_view:  # a view, unannotated
        return True
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach a kernel: composite ops are decomposed first (so
    `linear` counts as the `mm` it runs, whoever calls it), views are not counted"""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if torch._C._dispatch_has_kernel_for_dispatch_key(
            name, "CompositeImplicitAutograd"
        ):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if not _is_view(func):
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **kwargs)


def count_ops(fn) -> collections.Counter:
    with OpCounter() as counter:
        fn()
    return counter.counts


def per_step(run, short: int = 3, long: int = 7) -> dict:
    """Ops per decoding step, by name: run(n) generates n tokens; the difference
    between `long` and `short` tokens over long - short steps (the prefill cancels
    out). A mean: transformers' static cache pads its mask at some steps only. A call
    first, uncounted: what a model makes once (RoPE's frequencies) is not a step's"""
    run(short)
    difference = count_ops(lambda: run(long))
    difference.subtract(count_ops(lambda: run(short)))
    return {op: n / (long - short) for op, n in difference.items() if n}


@pytest.fixture(scope="module")
def pair():
    "Ours and transformers' tiny PaliGemma, the same weights, in bfloat16 (a GPU's)"
    ours, theirs = transformers_pair(tiny_config(kv_heads=1))
    theirs.generation_config.eos_token_id = None  # exactly the tokens asked for
    return ours.to(torch.bfloat16), theirs.to(torch.bfloat16)


def bf16_prompts(batch_size):
    inputs = prompts(tiny_config(kv_heads=1), ROWS[:batch_size], seed=2)
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    return inputs


def test_the_counter_sees_kernels_not_views_and_syncs():
    x = torch.randn(4, 3)
    counts = count_ops(lambda: bool((x.t().reshape(12) @ x.reshape(12)) > 0))
    # the transpose is a view (not counted), reshaping it copies (clone); then the
    # product, the comparison, and bool()'s read-back of the value to the host
    assert counts == {"clone": 1, "dot": 1, "gt": 1, "_local_scalar_dense": 1}
    linear = torch.nn.Linear(3, 5, bias=False)
    assert count_ops(lambda: linear(x)) == {"mm": 1}  # linear, decomposed


@pytest.mark.parametrize("batch_size", [1, 8])
def test_ours_dispatches_no_more_ops_per_step_than_transformers(pair, batch_size):
    ours, theirs = pair
    inputs = bf16_prompts(batch_size)

    def run_ours(n):
        return generate(ours, **inputs, max_new_tokens=n, eos_token_id=None)

    def run_theirs(n, **kw):
        with torch.inference_mode():
            theirs.generate(
                **inputs, max_new_tokens=n, do_sample=False, pad_token_id=0, **kw
            )

    ours_ops = per_step(run_ours)
    theirs_ops = per_step(run_theirs)  # their default: a growing cache
    their_static = per_step(lambda n: run_theirs(n, cache_implementation="static"))
    total = {
        k: sum(v.values()) for k, v in [("ours", ours_ops), ("theirs", theirs_ops)]
    }
    print(batch_size, total, "transformers static:", sum(their_static.values()))
    assert sum(ours_ops.values()) <= sum(theirs_ops.values())
    assert sum(ours_ops.values()) <= sum(their_static.values())
    # the same matrix products (one per linear layer, LM head included): the savings
    # are in the small ops around them
    assert ours_ops["mm"] == theirs_ops["mm"] == 7 * 2 + 1
    # no read-back per step, where transformers waits once a step for its stop flag
    assert not SYNCS & set(ours_ops)
    assert sum(theirs_ops.get(op, 0) for op in SYNCS) >= 1


def test_stopping_at_eos_needs_no_sync_per_step():
    # the static cache's loop, the default (cache="dynamic" and "none" run the model's
    # forward, whose range check of the token ids reads them back)
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [5, 2, 7], seed=1)
    free = generate(model, **inputs, max_new_tokens=7, eos_token_id=None)
    # an id no row emits in 7 steps: every step runs, the flags are read each time
    eos = next(i for i in range(3, config.text.vocab_size) if i not in free)

    def run(n):
        out = generate(model, **inputs, max_new_tokens=n, eos_token_id=eos)
        assert out.shape == (3, n)  # no row stopped

    assert not SYNCS & set(per_step(run))


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_later_non_finite_step_is_named_with_its_rows(bad, do_sample):
    """Sampling too: the flags are read after the token is drawn, so a NaN row must not
    reach torch.multinomial (seen: its RuntimeError, a device-side assert on CUDA,
    instead of NonFiniteLogitsError)"""
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [5, 2, 7], seed=1)
    calls = []

    def poison(module, args, logits):  # row 1, one logit, from the third new token on
        calls.append(1)
        if len(calls) >= 3:
            logits = logits.clone()
            logits[1, ..., 5] = bad
        return logits

    hook = model.language_model.lm_head.register_forward_hook(poison)
    try:
        with pytest.raises(NonFiniteLogitsError) as error:
            generate(
                model,
                **inputs,
                max_new_tokens=8,
                eos_token_id=None,
                do_sample=do_sample,
                generator=torch.Generator().manual_seed(0),
            )
    finally:
        hook.remove()
    message = str(error.value)
    assert "logits for new token 3 are NaN or infinite (batch rows [1])" in message


def test_decode_step_takes_the_additive_mask_as_the_2d_one():
    config = tiny_config(kv_heads=2)
    model = model_for(config)
    B, L = 2, 6
    token, positions = torch.tensor([5, 7]), torch.tensor([[3], [2]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0]])
    blocked = mask[:, None, None, :] == 0  # [B, 1, 1, L]
    additive = torch.zeros(B, 1, 1, L).masked_fill(blocked, torch.finfo().min)
    results = []
    for m in (mask, additive):
        cache = StaticKVCache(config.text, B, L)
        cache.seek(3)
        with torch.no_grad():
            results.append(decode_step(model, token, positions, m, cache))
    assert torch.equal(results[0], results[1])  # the same mask, the same arithmetic
    cache = StaticKVCache(config.text, B, L)
    with pytest.raises(ValueError, match=r"additive attention_mask .* \[B, 1, 1"):
        decode_step(model, token, positions, additive.double(), cache)


class _LateEvent:
    "A CUDA event that never reports done by itself: the flags arrive only on a wait"

    waits = 0

    def record(self):
        pass

    def query(self):
        return False

    def synchronize(self):
        _LateEvent.waits += 1


def test_flags_read_late_as_on_a_gpu_give_the_same_tokens_and_errors(monkeypatch):
    "The GPU path of the flags, on the CPU: each step's flags read `max_lag` steps late"
    config = tiny_config()
    model = model_for(config)
    # a row whose tokens differ (random rows tend to repeat one), left-padded
    inputs = {k: v[1:] for k, v in prompts(config, [5, 1, 9], seed=1).items()}
    free = generate(model, **inputs, max_new_tokens=16, eos_token_id=None).tolist()
    stop = free[1][0]  # row 1 stops at once; row 0 at step `last`
    assert stop in free[0][3:12], free  # (a property of this seed's model)
    last = free[0].index(stop)  # the loop then runs 2 (max_lag) steps more, dropped
    on_time = generate(model, **inputs, max_new_tokens=16, eos_token_id=stop)
    assert on_time.shape == (2, last + 1)

    class LateFlags(generation._StepFlags):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.cuda = True  # events, read when more than max_lag steps are pending

    monkeypatch.setattr(generation, "_StepFlags", LateFlags)
    monkeypatch.setattr(torch.cuda, "Event", _LateEvent)
    _LateEvent.waits = 0
    late = generate(model, **inputs, max_new_tokens=16, eos_token_id=stop)
    assert torch.equal(late, on_time)  # the steps computed past the stop are dropped
    # each step's flags waited for once, up to the stop (then returned at once)
    assert _LateEvent.waits == last + 1
    # a NaN at the third step is still named, when its flags arrive
    calls = []

    def poison(module, args, logits):
        calls.append(1)
        return logits * float("nan") if len(calls) == 3 else logits

    hook = model.language_model.lm_head.register_forward_hook(poison)
    try:
        with pytest.raises(NonFiniteLogitsError, match=r"token 3 .*rows \[0, 1\]"):
            generate(model, **inputs, max_new_tokens=12, eos_token_id=None)
    finally:
        hook.remove()
