"""Chapter 8: KV caches and generation; parity with recomputation, with rows alone, and
with transformers."""

import pytest
import torch
from hf_reference import sharpen, transformers_pair
from PIL import Image

from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig
from paligemma_lib.decoding_linear import DecodingLinear, decoding_linears
from paligemma_lib.generation import answer, generate
from paligemma_lib.kv_cache import DynamicKVCache, StaticKVCache
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.processing import PaliGemmaProcessor
from paligemma_lib.sampling import next_token, top_k_filter, top_p_filter
from paligemma_lib.tokenization import GemmaTokenizer, default_tokenizer_path

IMAGE = 299


def tiny_config(kv_heads=1, vocab=300, image_token=IMAGE):
    return PaliGemmaConfig(
        vision=VisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=28,
            patch_size=14,
        ),
        text=TextConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            head_dim=16,
        ),
        image_token_index=image_token,
        projection_dim=64,
    )


def prompts(config, lengths, seed=0):
    """Left-padded prompts: image tokens, <bos>, `n` random tokens, newline; with mask,
    types and images"""
    g = torch.Generator().manual_seed(seed)
    seqs = [
        [config.image_token_index] * config.num_image_tokens
        + [2]
        + torch.randint(3, IMAGE, (n,), generator=g).tolist()
        + [108]
        for n in lengths
    ]
    S = max(map(len, seqs))
    ids = torch.tensor([[0] * (S - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (S - len(s)) + [1] * len(s) for s in seqs])
    pixels = torch.randn(
        len(lengths), 3, config.vision.image_size, config.vision.image_size, generator=g
    )
    return dict(
        input_ids=ids,
        pixel_values=pixels,
        attention_mask=mask,
        token_type_ids=torch.zeros_like(ids),
    )


def model_for(config, seed=0):
    torch.manual_seed(seed)
    return sharpen(PaliGemmaForConditionalGeneration(config).eval())


def recompute(
    model, input_ids, pixel_values, attention_mask, token_type_ids, max_new_tokens
):
    "Greedy by a full forward pass per token, written independently of generate"
    ids, mask, types = input_ids, attention_mask, token_type_ids
    for _ in range(max_new_tokens):
        with torch.no_grad():
            token = (
                model(ids, pixel_values, attention_mask=mask, token_type_ids=types)
                .logits[:, -1]
                .argmax(-1)[:, None]
            )
        ids, mask, types = (
            torch.cat([ids, token], 1),
            torch.cat([mask, token * 0 + 1], 1),
            torch.cat([types, token * 0 + 1], 1),
        )
    return ids[:, input_ids.shape[1] :]


@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("cache", ["static", "dynamic", "none"])
def test_cached_tokens_equal_recomputation(cache, kv_heads):
    config = tiny_config(kv_heads)
    model = model_for(config)
    inputs = prompts(config, [5, 2, 8])
    expected = recompute(model, **inputs, max_new_tokens=10)
    assert torch.equal(
        generate(model, **inputs, max_new_tokens=10, eos_token_id=None, cache=cache),
        expected,
    )


def test_dynamic_cache_returns_all_keys_so_far():
    config = tiny_config(kv_heads=2).text
    cache = DynamicKVCache(config.num_hidden_layers)
    keys = [torch.randn(3, 2, n, 16) for n in (4, 1, 1)]
    for k in keys:
        for layer in range(2):
            got_k, got_v = cache.update(layer, k, -k)
        assert cache.get_seq_length() == got_k.shape[2]
    # bit for bit: a cache only copies values, it computes nothing
    torch.testing.assert_close(got_k, torch.cat(keys, 2), rtol=0, atol=0)
    # the same, for the values (negation is exact)
    torch.testing.assert_close(got_v, -torch.cat(keys, 2), rtol=0, atol=0)
    cache.select_rows(torch.tensor([2, 0]))
    kept = cache.update(0, keys[0][:2, :, :1], keys[0][:2, :, :1])[0][:, :, :6]
    # bit for bit: selecting rows copies values
    torch.testing.assert_close(kept, torch.cat(keys, 2)[[2, 0]], rtol=0, atol=0)


def test_static_cache_writes_in_place_at_seek_and_returns_whole_buffers():
    config = tiny_config(kv_heads=2).text
    cache = StaticKVCache(config, 3, 10)
    addresses = [t.data_ptr() for t in cache.keys + cache.values]
    prefill = DynamicKVCache(config.num_hidden_layers)
    first = torch.randn(3, 2, 4, 16)
    for layer in range(2):
        prefill.update(layer, first, -first)
    cache.fill(prefill)
    new = torch.randn(3, 2, 1, 16)
    cache.seek(7)  # any slot: the position is data
    for layer in range(2):
        got_k, got_v = cache.update(layer, new, -new)
    assert got_k.shape == (3, 2, 10, 16) and got_k.data_ptr() == addresses[1]
    expected = torch.zeros(3, 2, 10, 16)
    expected[:, :, :4], expected[:, :, 7:8] = first, new
    # bit for bit: the static cache writes values in place, it computes nothing
    torch.testing.assert_close(got_k, expected, rtol=0, atol=0)
    # the same, for the values
    torch.testing.assert_close(got_v, -expected, rtol=0, atol=0)
    assert [t.data_ptr() for t in cache.keys + cache.values] == addresses


def test_static_cache_overflow_and_seq_length_are_clear_errors():
    cache = StaticKVCache(tiny_config().text, 1, 3)
    cache.seek(0, 3)
    with pytest.raises(ValueError, match="max_length >= prompt length"):
        cache.seek(3)
    with pytest.raises(TypeError, match="prefill with a DynamicKVCache"):
        cache.get_seq_length()


def test_finished_rows_keep_their_slot_in_the_static_cache():
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [5, 1, 9], seed=1)
    free = generate(model, **inputs, max_new_tokens=8, eos_token_id=None)
    batch_sizes = []
    hook = model.language_model.model.layers[0].register_forward_pre_hook(
        lambda module, args: batch_sizes.append(args[0].shape[0])
    )
    generate(model, **inputs, max_new_tokens=8, eos_token_id=free[1, 1].item())
    hook.remove()
    assert batch_sizes == [3] * len(batch_sizes) and len(batch_sizes) > 2


def test_padded_batch_rows_equal_rows_alone_and_stop_at_eos():
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [5, 1, 9], seed=1)
    free = generate(model, **inputs, max_new_tokens=12, eos_token_id=None)
    eos = free[1, 3].item()  # row 1 emits it, so it finishes early
    batched = generate(model, **inputs, max_new_tokens=12, eos_token_id=eos)
    for row in range(3):
        real = inputs["attention_mask"][row].bool()
        alone = generate(
            model,
            inputs["input_ids"][row : row + 1, real],
            inputs["pixel_values"][row : row + 1],
            max_new_tokens=12,
            eos_token_id=eos,
        )
        assert torch.equal(batched[row, : alone.shape[1]], alone[0])
        assert (batched[row, alone.shape[1] :] == 0).all()
    first = (free[1] == eos).nonzero()[0, 0].item()
    assert batched[1, first] == eos and (batched[1, first + 1 :] == 0).all()
    assert torch.equal(batched[1, : first + 1], free[1, : first + 1])


def test_all_rows_finished_stops_early():
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [3])
    free = generate(model, **inputs, max_new_tokens=8, eos_token_id=None)
    out = generate(model, **inputs, max_new_tokens=8, eos_token_id=free[0, 2].item())
    first = (free[0] == free[0, 2]).nonzero()[0, 0].item()
    assert out.shape == (1, first + 1)


@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
def test_greedy_equals_transformers_generate(kv_heads):
    config = tiny_config(kv_heads)
    ours, theirs = transformers_pair(config)
    inputs = prompts(config, [6, 2, 4], seed=2)
    with torch.no_grad():
        their_out = theirs.generate(
            **inputs, max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=0
        )
    expected = their_out[:, inputs["input_ids"].shape[1] :]
    assert torch.equal(
        generate(ours, **inputs, max_new_tokens=12, decoding_linears=False), expected
    )
    assert type(ours.language_model.lm_head) is torch.nn.Linear
    assert torch.equal(
        generate(ours, **inputs, max_new_tokens=12, decoding_linears=True), expected
    )  # DecodingLinear within generate
    assert (
        type(ours.language_model.lm_head) is torch.nn.Linear
    )  # and the model is left as it was


def test_sampling_with_a_seed_repeats():
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [4, 2])

    def sample(seed):
        return generate(
            model,
            **inputs,
            max_new_tokens=10,
            do_sample=True,
            temperature=1.5,
            top_k=40,
            top_p=0.9,
            eos_token_id=None,
            generator=torch.Generator().manual_seed(seed),
        )

    assert torch.equal(sample(3), sample(3))
    assert not torch.equal(sample(3), sample(4))


def test_filters_keep_the_right_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    assert torch.isfinite(top_k_filter(logits, 2)).tolist() == [
        [False, True, False, True, False]
    ]
    probs = logits.softmax(-1)[0]
    p = (probs[1] + probs[3]).item()  # the two most likely tokens hold mass p
    assert torch.isfinite(top_p_filter(logits, p - 1e-3)).tolist() == [
        [False, True, False, True, False]
    ]
    assert torch.isfinite(top_p_filter(logits, p + 1e-3)).tolist() == [
        [False, True, True, True, False]
    ]
    assert torch.isfinite(top_p_filter(logits, 1e-9)).sum() == 1
    draws = next_token(
        logits.expand(5000, -1),
        do_sample=True,
        top_k=1,
        generator=torch.Generator().manual_seed(0),
    )
    assert (draws == 1).all()
    draws = next_token(
        logits.expand(20000, -1),
        do_sample=True,
        temperature=2.0,
        generator=torch.Generator().manual_seed(0),
    )
    frequencies = torch.bincount(draws, minlength=5) / 20000.0
    expected = (logits[0] / 2).softmax(-1)
    # sampling, not rounding: a frequency from 20,000 draws has a standard deviation
    # of at most sqrt(0.25 / 20000) = 0.0035; 0.015 is over 4 of them (seeded)
    torch.testing.assert_close(frequencies, expected, atol=0.015, rtol=0)


def test_top_p_one_keeps_every_token_of_a_large_vocabulary():
    """float32's cumsum reaches 1.0 long before the end of a peaked 257k-token
    distribution; top_p=1.0 must keep all"""
    logits = torch.cat([torch.tensor([[30.0]]), torch.zeros(1, 257215)], 1)
    assert (
        logits.softmax(-1).cumsum(-1)[0, 1].item() == 1.0
    )  # the reason for the special case
    assert torch.isfinite(top_p_filter(logits, 1.0)).all()
    assert torch.isfinite(top_p_filter(logits, 0.5)).sum() == 1


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, top_k=0), "top_k"),
        (dict(do_sample=True, top_p=1.5), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(cache="paged"), "cache='paged'"),
        (dict(temperature=0.7), "pass do_sample=True to sample"),
        (dict(top_k=5), "pass do_sample=True to sample"),
        (dict(top_p=0.9), "pass do_sample=True to sample"),
    ],
)
def test_bad_arguments_are_clear_errors(kw, message):
    config = tiny_config()
    model = model_for(config)
    with pytest.raises(ValueError, match=message):
        generate(model, **prompts(config, [2]), **kw)


def test_right_padding_is_a_clear_error():
    config = tiny_config()
    inputs = prompts(config, [4, 1])
    inputs = {k: (v.flip(1) if k != "pixel_values" else v) for k, v in inputs.items()}
    with pytest.raises(ValueError, match="padded on the left"):
        generate(model_for(config), **inputs)


def test_answer_returns_strings():
    tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
    config = tiny_config(vocab=len(tokenizer), image_token=tokenizer.image_token_id)
    model = model_for(config)
    processor = PaliGemmaProcessor(
        tokenizer, image_size=28, num_image_tokens=config.num_image_tokens
    )
    images = [Image.new("RGB", (40, 30), "navy"), Image.new("RGB", (30, 40), "gold")]
    texts = answer(
        model, processor, images, ["caption en", "count the circles"], max_new_tokens=6
    )
    batch = processor(images, ["caption en", "count the circles"])
    tokens = generate(
        model,
        batch.input_ids,
        batch.pixel_values,
        batch.attention_mask,
        batch.token_type_ids,
        max_new_tokens=6,
    )
    assert isinstance(texts, list) and len(texts) == 2
    for text, row in zip(texts, tokens.tolist()):
        row = row[: row.index(1)] if 1 in row else row
        assert text == processor.decode(row)
    assert (
        answer(model, processor, images[0], "caption en", max_new_tokens=6) == texts[0]
    )


def test_answer_takes_eos_and_pad_from_the_tokenizer(monkeypatch):
    "answer passes the tokenizer's <eos> and <pad> ids to generate, unless given them"
    tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
    config = tiny_config(vocab=len(tokenizer), image_token=tokenizer.image_token_id)
    processor = PaliGemmaProcessor(
        tokenizer, image_size=28, num_image_tokens=config.num_image_tokens
    )
    seen = []
    import paligemma_lib.generation as generation

    monkeypatch.setattr(
        generation,
        "generate",
        lambda *a, **kw: seen.append(kw) or torch.tensor([[5, 6]]),
    )
    generation.answer(
        model_for(config), processor, Image.new("RGB", (30, 30)), "caption en"
    )
    generation.answer(
        model_for(config),
        processor,
        Image.new("RGB", (30, 30)),
        "caption en",
        eos_token_id=None,
    )
    assert (seen[0]["eos_token_id"], seen[0]["pad_token_id"]) == (
        tokenizer.eos_id,
        tokenizer.pad_id,
    )
    assert seen[1]["eos_token_id"] is None


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_decoding_linear_equals_linear(rows, bias):
    torch.manual_seed(0)
    plain = torch.nn.Linear(24, 40, bias=bias)
    fast = DecodingLinear(24, 40, bias=bias)
    fast.load_state_dict(plain.state_dict())
    x = torch.randn(rows, 2, 24)[
        :, 0
    ]  # not contiguous, as a sliced hidden state can be
    torch.testing.assert_close(fast(x), plain(x))
    torch.testing.assert_close(fast(x[None]), plain(x[None]))


def module_types(model):
    return {name: type(module) for name, module in model.named_modules()}


def test_decoding_linears_lends_the_same_parameters_and_puts_the_modules_back():
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [4, 1])
    types, modules = module_types(model), dict(model.named_modules())
    before = model.state_dict(keep_vars=True)
    with decoding_linears(model):
        inside = model.state_dict(keep_vars=True)
        assert list(inside) == list(before) and all(
            inside[k] is before[k] for k in before
        )
        assert (
            model.language_model.lm_head.weight
            is model.language_model.model.embed_tokens.weight
        )
        linears = [
            m for m in model.language_model.modules() if isinstance(m, torch.nn.Linear)
        ]
        assert len(linears) == 7 * config.text.num_hidden_layers + 1 and all(
            type(m) is DecodingLinear for m in linears
        )
    assert module_types(model) == types and all(
        m is modules[n] for n, m in model.named_modules()
    )
    expected = generate(
        model, **inputs, max_new_tokens=8, eos_token_id=None, decoding_linears=False
    )
    assert module_types(model) == types
    assert torch.equal(
        generate(
            model, **inputs, max_new_tokens=8, eos_token_id=None, decoding_linears=True
        ),
        expected,
    )
    assert module_types(model) == types and all(
        m is modules[n] for n, m in model.named_modules()
    )
    assert all(
        type(m) is torch.nn.Linear
        for m in model.language_model.modules()
        if isinstance(m, torch.nn.Linear)
    )
    assert (
        model.language_model.lm_head.weight
        is model.language_model.model.embed_tokens.weight
    )  # still tied
    assert model.state_dict(keep_vars=True).keys() == before.keys()


def test_decoding_linears_puts_the_modules_back_after_an_error():
    config = tiny_config()
    model = model_for(config)
    types = module_types(model)
    with pytest.raises(RuntimeError, match="inside the block"):
        with decoding_linears(model):
            assert type(model.language_model.lm_head) is DecodingLinear
            raise RuntimeError("inside the block")
    assert module_types(model) == types
    inputs = prompts(config, [3])
    with pytest.raises(
        ValueError, match="pass do_sample=True"
    ):  # an error raised by generate itself
        generate(model, **inputs, temperature=0.5)
    assert module_types(model) == types


@pytest.mark.parametrize("cache", ["static", "dynamic", "none"])
def test_the_vision_tower_runs_once_per_image(cache):
    """Prefill encodes each image once; with a cache, decoding steps never touch the
    vision tower again"""
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [5, 2, 8])
    calls = []
    hook = model.vision_tower.register_forward_hook(
        lambda module, args, output: calls.append(args[0].shape[0])
    )
    tokens = generate(model, **inputs, max_new_tokens=6, eos_token_id=None, cache=cache)
    hook.remove()
    assert tokens.shape == (3, 6)
    if (
        cache == "none"
    ):  # recomputation: the prefill and every later step encode the images again
        assert calls == [3] * 6
    else:
        assert calls == [3]


def test_decoding_linear_takes_the_usual_product_off_the_cpu(monkeypatch):
    """Only the CPU gets the transposed product; elsewhere (a meta tensor stands in for
    a GPU here) F.linear runs"""
    calls = []
    monkeypatch.setattr(
        torch.nn.functional,
        "linear",
        lambda *a: calls.append(a) or torch.empty(1, 40, device="meta"),
    )
    fast = DecodingLinear(24, 40, device="meta")
    fast(torch.empty(1, 24, device="meta"))
    assert len(calls) == 1


def test_compiled_decoding_compiles_once_and_equals_eager():
    """compile=True: one graph for every decoding step and for a second call, no graph
    break, the tokens of the eager path, and the cache buffers never move"""
    from torch._dynamo.utils import counters

    from paligemma_lib.generation import _compiled_caches

    torch._dynamo.reset()
    counters.clear()
    config = tiny_config()
    model = model_for(config)
    inputs = prompts(config, [5, 2, 8])
    eager = generate(model, **inputs, max_new_tokens=8, eos_token_id=None)
    compiled = generate(
        model, **inputs, max_new_tokens=8, eos_token_id=None, compile=True
    )
    graphs = counters["stats"]["unique_graphs"]
    kv_cache = _compiled_caches[model][1]  # kept for the next call
    addresses = [t.data_ptr() for t in kv_cache.keys + kv_cache.values]
    again = generate(model, **inputs, max_new_tokens=8, eos_token_id=None, compile=True)
    assert [t.data_ptr() for t in kv_cache.keys + kv_cache.values] == addresses
    assert graphs == 1 and counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    assert torch.equal(compiled, eager) and torch.equal(again, eager)
    eos = eager[1, 2].item()  # a row finishes early: still the same graph
    assert torch.equal(
        generate(model, **inputs, max_new_tokens=8, eos_token_id=eos, compile=True),
        generate(model, **inputs, max_new_tokens=8, eos_token_id=eos),
    )
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_needs_the_static_cache():
    config = tiny_config()
    model = model_for(config)
    with pytest.raises(ValueError, match="compile=True needs cache='static'"):
        generate(model, **prompts(config, [3]), cache="dynamic", compile=True)
