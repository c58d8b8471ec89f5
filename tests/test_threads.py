"""Issue 24, section 5, and issue 28: by default `generate` keeps torch's thread count
(the same inputs give the same outputs whatever the load); with `threads="auto"`, on a
CPU, it chooses the decoding steps' count by timing its first steps with each candidate
count; the choice is remembered per model and batch size, the prefill keeps torch's
threads, and torch's setting is restored after."""

import threading

import pytest
import torch
from test_generation import model_for, prompts, tiny_config

from paligemma_lib import threads
from paligemma_lib.generation import generate
from paligemma_lib.threads import (
    THREAD_TIMINGS,
    fastest_threads,
    intra_op_threads,
    thread_candidates,
)


@pytest.fixture
def two_threads():
    "torch set to 2 intra-op threads for the test (a machine of 2 cores or more)"
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def threads_seen(model):
    """Attach a hook to the decoder's first layer that records torch's thread count at
    each call (the prefill's, then one per decoding step) -> (list, hook)"""
    seen = []
    hook = model.language_model.model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append(torch.get_num_threads())
    )
    return seen, hook


def test_candidates_halve_down_to_one():
    assert thread_candidates(1) == [1]
    assert thread_candidates(2) == [2, 1]
    assert thread_candidates(6) == [6, 3, 1]
    assert thread_candidates(8) == [8, 4, 2, 1]


def test_intra_op_threads_restores_after_an_error(two_threads):
    with pytest.raises(RuntimeError, match="inside"):
        with intra_op_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == two_threads


def test_first_steps_are_timed_in_turns_then_the_fastest_is_kept(two_threads):
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [5, 2, 7])
    seen, hook = threads_seen(model)
    try:
        tokens = generate(
            model, **inputs, max_new_tokens=8, eos_token_id=None, threads="auto"
        )
    finally:
        hook.remove()
    timings = threads._step_timings[model][(3, two_threads)]
    assert list(timings) == [2, 1]
    assert all(len(t) == THREAD_TIMINGS for t in timings.values())
    chosen = fastest_threads(timings)
    # prefill with torch's threads; steps timed 2, 1, 2, 1; then the fastest
    assert seen == [2, 2, 1, 2, 1] + [chosen] * 3
    assert torch.get_num_threads() == two_threads  # restored
    # the measured steps were real steps: the same calls as with the count given
    seen_given, hook = threads_seen(model)
    try:
        given = generate(
            model, **inputs, max_new_tokens=8, eos_token_id=None, threads=2
        )
    finally:
        hook.remove()
    assert len(seen_given) == len(seen) and seen_given == [2] * 8
    # these widths are below torch's grain for splitting work: any count, same bits
    assert torch.equal(given, tokens)


def test_the_choice_is_remembered_per_model_and_batch_size(two_threads):
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [5, 2])
    # as if measured: one thread was ten times faster
    threads._step_timings[model] = {(2, 2): {2: [1.0, 1.0], 1: [0.1, 0.1]}}
    seen, hook = threads_seen(model)
    try:
        generate(model, **inputs, max_new_tokens=4, eos_token_id=None, threads="auto")
        one_row = {k: v[:1] for k, v in inputs.items()}
        generate(model, **one_row, max_new_tokens=2, eos_token_id=None, threads="auto")
    finally:
        hook.remove()
    # batch 2: prefill on 2 threads, every step on the remembered 1; batch 1 is new:
    # its step is timed (with 2 threads first)
    assert seen == [2, 1, 1, 1] + [2, 2]
    assert threads._step_timings[model][(1, 2)] == {
        2: threads._step_timings[model][(1, 2)][2],
        1: [],
    }
    assert len(threads._step_timings[model][(1, 2)][2]) == 1


def test_measuring_goes_on_across_short_calls(two_threads):
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [3])
    for call in range(1, 2 * THREAD_TIMINGS + 1):  # one decoding step per call
        generate(model, **inputs, max_new_tokens=2, eos_token_id=None, threads="auto")
        timings = threads._step_timings[model][(1, 2)]
        assert sum(map(len, timings.values())) == call
    assert all(len(t) == THREAD_TIMINGS for t in timings.values())


@pytest.mark.parametrize("way", ["threads", "dynamic", "none", "one thread"])
def test_nothing_is_measured_when_the_count_is_given_or_steps_differ(two_threads, way):
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [5, 2])
    kw = {"threads": {"threads": 1}, "dynamic": {"cache": "dynamic"}}
    kw = (kw | {"none": {"cache": "none"}}).get(way, {})
    kw = {"threads": "auto", **kw}
    if way == "one thread":  # torch has one thread: nothing to choose
        torch.set_num_threads(1)
    seen, hook = threads_seen(model)
    try:
        generate(model, **inputs, max_new_tokens=5, eos_token_id=None, **kw)
    finally:
        hook.remove()
    assert model not in threads._step_timings
    # the prefill, then 4 steps (each a whole forward pass with cache="none")
    prefill = 1 if way == "one thread" else 2
    steps = 1 if way in ("threads", "one thread") else 2
    assert seen == [prefill] + [steps] * 4


def test_steps_use_the_given_count_and_torch_is_restored_after_an_error(two_threads):
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [4])
    calls = []

    def fail_on_third(module, args):
        calls.append(torch.get_num_threads())
        if len(calls) == 3:
            raise RuntimeError("a step failed")

    hook = model.language_model.model.layers[0].register_forward_pre_hook(fail_on_third)
    try:
        with pytest.raises(RuntimeError, match="a step failed"):
            generate(model, **inputs, max_new_tokens=6, eos_token_id=None, threads=1)
    finally:
        hook.remove()
    assert calls == [2, 1, 1]  # the prefill on torch's 2, the steps on 1
    assert torch.get_num_threads() == two_threads


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_a_bad_thread_count_is_refused(bad):
    config = tiny_config()
    model = model_for(config)
    with pytest.raises(ValueError, match="positive int"):
        generate(model, **prompts(config, [3]), max_new_tokens=2, threads=bad)


def test_nested_blocks_restore_the_enclosing_count(two_threads):
    with intra_op_threads(1):
        with intra_op_threads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1  # the enclosing block's count again
    assert torch.get_num_threads() == two_threads


def test_by_default_the_steps_keep_torchs_count_and_give_the_same_outputs(two_threads):
    """Issue 28: the default measures nothing and changes no thread count, so two calls
    on one machine give the same tokens and the same step logits, whatever the load
    (a count chosen by a clock is not reproducible: another split of a matrix
    product's sums can move float32 logits in their last bits). Seen to catch the
    old default (threads=None measured): the hook then sees 2, 1, 2, 1."""
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [5, 2, 7])
    runs = []
    for _ in range(2):
        seen, logits = [], []
        hooks = [
            model.language_model.model.layers[0].register_forward_pre_hook(
                lambda module, args, seen=seen: seen.append(torch.get_num_threads())
            ),
            model.language_model.lm_head.register_forward_hook(
                lambda module, args, out, logits=logits: logits.append(out.clone())
            ),
        ]
        try:
            tokens = generate(model, **inputs, max_new_tokens=8, eos_token_id=None)
        finally:
            for hook in hooks:
                hook.remove()
        assert seen == [two_threads] * 8 and model not in threads._step_timings
        runs.append((tokens, logits))
    (tokens, logits), (again, logits_again) = runs
    assert torch.equal(tokens, again) and len(logits) == len(logits_again) == 8
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_again))


def test_a_thread_started_during_decoding_keeps_torchs_count(two_threads):
    """Issue 28: a Python thread whose first torch work happens inside a decoding call
    (a served app's worker pool, say) starts with torch's count and keeps it after
    the call. Seen to catch the old default, which timed the second step on 1
    thread: torch.set_num_threads also sets the count a new thread starts with."""
    config = tiny_config()
    model = model_for(config)
    counts, started = {}, []

    def worker():
        torch.ones(64, 64).sum()  # this thread's first torch work
        counts["during"] = torch.get_num_threads()
        release.wait()
        counts["after"] = torch.get_num_threads()

    release = threading.Event()

    def start_at_third_call(module, args):
        if len(started) == 0 and getattr(module, "_calls", 0) == 2:
            started.append(threading.Thread(target=worker))
            started[0].start()
            while "during" not in counts:  # its first torch work, inside the step
                pass
        module._calls = getattr(module, "_calls", 0) + 1

    hook = model.language_model.model.layers[0].register_forward_pre_hook(
        start_at_third_call
    )
    try:
        generate(model, **prompts(config, [4]), max_new_tokens=6, eos_token_id=None)
    finally:
        hook.remove()
        release.set()
    started[0].join()
    assert counts == {"during": two_threads, "after": two_threads}


def test_concurrent_auto_calls_share_the_timings_safely(two_threads):
    "Two Python threads measuring one model at once: no error, the same tokens"
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [5, 2])
    expected = generate(model, **inputs, max_new_tokens=6, eos_token_id=None)
    results, errors = [], []

    def run():
        try:
            kw = dict(max_new_tokens=6, eos_token_id=None, threads="auto")
            results.append(generate(model, **inputs, **kw))
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    workers = [threading.Thread(target=run) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors and len(results) == 2
    assert all(torch.equal(r, expected) for r in results)
    timings = threads._step_timings[model][(2, two_threads)]
    assert all(timings.values())  # every count was timed
