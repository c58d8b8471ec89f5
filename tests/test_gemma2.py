"""PaliGemma 2: our model with a Gemma 2 decoder (text_config model_type "gemma2")
against transformers' PaliGemmaForConditionalGeneration, on small odd configs whose
sliding window is shorter than the sequence and whose soft caps change the numbers:
logits and loss (right and left padding), greedy generation past the window,
save_pretrained/load_pretrained both ways, and LoRA training read back by PEFT."""

import dataclasses
import warnings

import peft
import pytest
import torch
import transformers
from hf_reference import transformers_pair
from PIL import Image
from test_generation import prompts
from test_paligemma import IMAGE, batch

from paligemma_lib.__main__ import main
from paligemma_lib.adapters import save_adapter
from paligemma_lib.config import Gemma2TextConfig, PaliGemmaConfig, VisionConfig
from paligemma_lib.gemma import GemmaForCausalLM
from paligemma_lib.generation import answer, generate
from paligemma_lib.image_processing import load_image
from paligemma_lib.lora import LoraConfig, add_lora
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.processing import PaliGemmaProcessor
from paligemma_lib.tokenization import GemmaTokenizer, default_tokenizer_path
from paligemma_lib.weights import load_pretrained, save_pretrained

# float32 on both sides, the same operations in the same order except the kernels'
# reduction orders (matmul blocking, SigLIP's fused attention against transformers'
# eager one): dot products of width <= 96 round ~96 x 2^-24 ~ 6e-6 relative each, over
# <= 4 layers and two softmaxes; the logits are bounded by the final cap (<= 6), so the
# issue's 2e-4 (absolute and relative) leaves a margin of about ten.
TOL = 2e-4


def gemma2_config(
    layers=3,
    heads=4,
    kv_heads=2,
    head_dim=16,
    hidden=48,
    scalar=24,
    attn_cap=1.0,
    final_cap=5.0,
    window=5,
    layer_types=None,
    image_size=28,
):
    "A tiny PaliGemma 2: SigLIP with 2 layers, a Gemma 2 decoder with the given sizes"
    return PaliGemmaConfig(
        vision=VisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=image_size,
            patch_size=14,
        ),
        text=Gemma2TextConfig(
            vocab_size=300,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            query_pre_attn_scalar=scalar,
            attn_logit_softcapping=attn_cap,
            final_logit_softcapping=final_cap,
            sliding_window=window,
            layer_types=layer_types,
        ),
        image_token_index=IMAGE,
        projection_dim=hidden,
    )


CONFIGS = {
    # GQA 4:2, query_pre_attn_scalar 24 != head_dim 16, layers local/global/local
    "gqa": gemma2_config(),
    # 6 query heads on 2 key/value heads, 9 image tokens, an explicit layer pattern
    "gqa3_9_patches": gemma2_config(
        layers=4,
        heads=6,
        kv_heads=2,
        head_dim=10,
        hidden=42,
        scalar=30,
        attn_cap=1.0,
        final_cap=6.0,
        window=7,
        layer_types=[
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        image_size=42,
    ),
    # one key/value head, scalar = hidden / heads as in the 27B model, window 3
    "mqa_27b_scalar": gemma2_config(
        layers=2,
        heads=2,
        kv_heads=1,
        head_dim=24,
        hidden=36,
        scalar=18,
        attn_cap=0.75,
        final_cap=3.5,
        window=3,
    ),
}
# (prefix length, suffix length) per row: prefixes and suffixes longer than the windows
ROWS = [(6, 9), (2, 3), (9, 0)]


def pair(config, factor=4.0):
    """transformers' PaliGemma 2 and ours with its weights, matrices times `factor` and
    the embedding table times 8 (powers of two: exact in both): attention scores and
    logits large enough for the caps to bite"""
    ours, theirs = transformers_pair(config, factor=factor)
    with torch.no_grad():
        ours.language_model.model.embed_tokens.weight.mul_(8)
        theirs.model.language_model.embed_tokens.weight.mul_(8)
    return ours, theirs


def forward(model, side, config, labels=True):
    "Logits (and loss) of `model`, ours or transformers', on the ROWS batch"
    ids, mask, types, labels_ = batch(config.num_image_tokens, ROWS, side=side)
    size = config.vision.image_size
    pixels = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(
            input_ids=ids,
            pixel_values=pixels,
            attention_mask=mask,
            token_type_ids=types,
            labels=labels_ if labels else None,
        )
    return out, mask.bool()


def without(ours, **changes):
    "Our model with the same weights and some Gemma 2 settings changed"
    config = ours.config
    text = dataclasses.replace(config.text, **changes)
    other = PaliGemmaForConditionalGeneration(dataclasses.replace(config, text=text))
    other.load_state_dict(ours.state_dict())
    return other.eval()


def test_windows_are_shorter_than_the_sequences():
    for config in CONFIGS.values():
        ids = batch(config.num_image_tokens, ROWS)[0]
        assert config.text.sliding_window < ids.shape[1] // 2


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_and_loss_equal_transformers(name, side):
    config = CONFIGS[name]
    ours, theirs = pair(config)
    assert type(theirs.config.text_config).__name__ == "Gemma2Config"
    assert theirs.config.text_config.layer_types == config.text.layer_types
    a, mask = forward(ours, side, config)
    b, _ = forward(theirs, side, config)
    torch.testing.assert_close(a.logits[mask], b.logits[mask], rtol=TOL, atol=TOL)
    torch.testing.assert_close(a.loss, b.loss, rtol=TOL, atol=TOL)  # TOL: see above


@pytest.mark.parametrize(
    "change",
    [
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
        {"sliding_window": None},
        {"query_pre_attn_scalar": None},
    ],
    ids=str,
)
def test_each_gemma2_setting_is_active_in_the_parity_configs(change):
    "Turning one off moves the logits far beyond TOL: the parity tests test it"
    for config in CONFIGS.values():
        ours, _ = pair(config)
        a, mask = forward(ours, "right", config, labels=False)
        b, _ = forward(without(ours, **change), "right", config, labels=False)
        assert (a.logits - b.logits)[mask].abs().max() > 100 * TOL


def test_prefix_sees_itself_beyond_the_window_and_the_suffix_does_not():
    "transformers' rule: local layers block keys >= window behind, unless both prefix"
    config = CONFIGS["gqa"]
    ours, _ = pair(config)
    ids, mask, types, _ = batch(config.num_image_tokens, [(9, 8)])
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(3))
    prefix = int((types == 0).sum())

    def changed_by_first_token(model):
        "Which positions' logits move when the first text token's id changes"
        other = ids.clone()
        other[0, config.num_image_tokens + 1] += 1
        with torch.no_grad():
            x = model(ids, pixels, attention_mask=mask, token_type_ids=types).logits
            y = model(other, pixels, attention_mask=mask, token_type_ids=types).logits
        return ((x - y).abs().amax(-1) > 100 * TOL)[0]

    # local layers only, window 2: the first layer spreads the change over the whole
    # prefix (bidirectional, window or not); each later one moves it one position on
    local = without(ours, layer_types=["sliding_attention"] * 3, sliding_window=2)
    moved = changed_by_first_token(local)
    reach = prefix - 1 + 2  # the last position the 2 later layers reach
    assert reach < ids.shape[1] - 1
    assert moved[: reach + 1].all() and not moved[reach + 1 :].any()
    # and with every layer global, the whole suffix moves
    assert changed_by_first_token(without(ours, sliding_window=None)).all()


def their_greedy(theirs, inputs, new: int) -> torch.Tensor:
    "transformers' greedy new tokens [B, new] (eos 1, pad 0, as ours is called)"
    with torch.no_grad():
        out = theirs.generate(
            **inputs,
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=1,
            pad_token_id=0,
        )
    return out[:, inputs["input_ids"].shape[1] :]


@pytest.mark.parametrize("name", ["gqa", "mqa_27b_scalar"])
def test_greedy_generation_past_the_window_equals_transformers(name):
    config = CONFIGS[name]
    ours, theirs = transformers_pair(config)  # sharpened: clear maxima
    inputs = prompts(config, [9, 2, 5], seed=2)
    new = 16  # the prompts (7 to 15 tokens) and the answers outgrow the window
    assert inputs["input_ids"].shape[1] + new > 4 * config.text.sliding_window
    expected = their_greedy(theirs, inputs, new)
    assert expected.shape[1] > config.text.sliding_window
    for cache in ["static", "dynamic", "none"]:
        got = generate(ours, **inputs, max_new_tokens=new, cache=cache)
        assert torch.equal(got, expected), cache


def test_compiled_greedy_generation_past_the_window_equals_transformers():
    "compile=True (static cache, torch.compile'd decode_step) with local layers"
    config = CONFIGS["gqa"]
    ours, theirs = transformers_pair(config)  # sharpened: clear maxima
    inputs = prompts(config, [9, 2, 5], seed=2)
    new = 16
    expected = their_greedy(theirs, inputs, new)
    got = generate(ours, **inputs, max_new_tokens=new, compile=True)
    assert torch.equal(got, expected)


def logits_of(model, config):
    "The logits of the real (not padding) positions of the left-padded ROWS batch"
    out, mask = forward(model, "left", config, labels=False)
    return out.logits[mask]


def test_save_pretrained_is_what_transformers_loads_and_back(tmp_path):
    config = CONFIGS["gqa3_9_patches"]
    ours, theirs = pair(config)
    save_pretrained(ours, tmp_path / "ours")
    reloaded, info = transformers.PaliGemmaForConditionalGeneration.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys"))
    assert reloaded.config.text_config.model_type == "gemma2"
    assert reloaded.config.text_config.layer_types == config.text.layer_types
    torch.testing.assert_close(
        logits_of(reloaded.eval(), config),
        logits_of(ours, config),
        rtol=TOL,  # TOL: see above
        atol=TOL,
    )
    # transformers' own folder of a Gemma 2 PaliGemma loads into ours
    theirs.save_pretrained(tmp_path / "theirs")
    loaded = load_pretrained(tmp_path / "theirs")
    assert loaded.config == config
    # bit for bit: the same weights in the same model on the same kernels
    torch.testing.assert_close(
        logits_of(loaded, config), logits_of(ours, config), rtol=0, atol=0
    )


def test_config_json_round_trips():
    for config in CONFIGS.values():
        assert PaliGemmaConfig.from_hf(config.to_hf()) == config
        hf = transformers.PaliGemmaConfig(**config.to_hf())
        assert PaliGemmaConfig.from_hf(hf.to_dict()) == config


def test_lora_training_lowers_the_loss_and_peft_reads_the_adapter(tmp_path):
    config = CONFIGS["gqa"]
    ours, theirs = pair(config)
    add_lora(ours, LoraConfig(r=4, alpha=8))
    ids, mask, types, labels = batch(config.num_image_tokens, ROWS, side="right")
    pixels = torch.randn(3, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    trainable = [p for p in ours.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    ours.train()
    for _ in range(8):
        loss = ours(
            ids, pixels, attention_mask=mask, token_type_ids=types, labels=labels
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]  # the adapter learns the batch
    save_adapter(ours, tmp_path)
    theirs = peft.PeftModel.from_pretrained(theirs, tmp_path).eval()
    torch.testing.assert_close(
        logits_of(theirs, config),
        logits_of(ours.eval(), config),
        rtol=TOL,  # TOL: see above; the adapter adds one product of width r = 4
        atol=TOL,
    )


def test_text_only_decoder_equals_transformers_gemma2_for_causal_lm():
    "Without PaliGemma's masks the local layers block keys by position alone"
    text = CONFIGS["gqa"].text
    torch.manual_seed(0)
    theirs = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**text.to_hf())
    ).eval()
    ours = GemmaForCausalLM(text).eval()
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad():  # attention scores and logits large enough for the caps
        for model in (ours, theirs):
            for name, p in model.named_parameters():
                if p.ndim == 2:
                    p.mul_(8 if "embed_tokens" in name else 4)
    ids = torch.randint(3, 300, (2, 17), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        b = theirs(input_ids=ids, attention_mask=mask).logits
    # TOL: see above (one decoder, no vision tower)
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], rtol=TOL, atol=TOL)


def test_a_transformers_folder_answers_through_the_cli(tmp_path, capsys):
    "transformers' save_pretrained of a PaliGemma 2, plus a processor: the CLI answers"
    tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
    small = CONFIGS["mqa_27b_scalar"]
    config = dataclasses.replace(
        small,
        text=dataclasses.replace(small.text, vocab_size=len(tokenizer)),
        image_token_index=tokenizer.image_token_id,
    )
    _, theirs = pair(config)
    theirs.save_pretrained(tmp_path / "model")
    PaliGemmaProcessor(
        tokenizer, image_size=28, num_image_tokens=config.num_image_tokens
    ).save_pretrained(tmp_path / "model")
    Image.new("RGB", (64, 48), "teal").save(tmp_path / "image.png")
    folder, image_file = tmp_path / "model", tmp_path / "image.png"
    args = ["generate", "--model", folder, "--image", image_file]
    args += ["--prompt", "caption en", "--max-new-tokens", "12", "--dtype", "fp32"]
    assert main([str(a) for a in args]) == 0
    printed = capsys.readouterr().out
    model = load_pretrained(tmp_path / "model", dtype="fp32")
    assert model.config == config
    processor = PaliGemmaProcessor.from_pretrained(tmp_path / "model")
    image = load_image(tmp_path / "image.png")
    with warnings.catch_warnings():  # a random model's answer may be cut off
        warnings.simplefilter("ignore")
        expected = answer(model, processor, image, "caption en", max_new_tokens=12)
    assert printed.strip() and printed == expected + "\n"


def test_the_demos_attention_maps_follow_gemma2():
    """The demo's explicit attention (paligemma_lib.demo, chapter 13) reproduces each
    layer's attention output on PaliGemma 2: its query scale, its score cap, and the
    window of the local layers. Seen to catch: the maps without the cap or with the
    global mask on local layers (both differ from the layer's output by far more)."""
    from paligemma_lib.demo import attention_inputs, attention_probs
    from paligemma_lib.paligemma import make_prefix_lm_mask

    config = CONFIGS["gqa"]
    ours, _ = pair(config)
    ids, mask, types, _ = batch(config.num_image_tokens, [(9, 8)])
    size = config.vision.image_size
    pixels = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))
    inputs = {
        "input_ids": ids,
        "pixel_values": pixels,
        "attention_mask": mask,
        "token_type_ids": types,
    }
    full = make_prefix_lm_mask(mask, types)
    local = make_prefix_lm_mask(mask, types, sliding_window=config.text.sliding_window)
    assert not torch.equal(full, local)  # the window blocks something here
    layers = ours.language_model.model.layers
    assert {layer.is_sliding for layer in layers} == {True, False}
    for layer, store in zip(layers, attention_inputs(ours, inputs)):
        allowed = local if layer.is_sliding else full
        assert torch.equal(store["mask"] == 0, allowed[:, None])  # the model's mask
        probs, v = attention_probs(
            layer.self_attn, store["hidden"], store["cos_sin"], allowed
        )
        B, H, S, d_h = v.shape
        output = (probs @ v).transpose(1, 2).reshape(B, S, H * d_h)
        # float32 both sides, the same formula with reductions over S (< 40) keys and
        # d_h (16) in other orders: ~40 x 2^-24 relative; TOL (2e-4) is far above
        torch.testing.assert_close(output, store["output"], rtol=TOL, atol=TOL)


def with_tokenizer(config, tokenizer):
    "`config` with the vocabulary and image token of `tokenizer` (the shipped one)"
    return dataclasses.replace(
        config,
        text=dataclasses.replace(config.text, vocab_size=len(tokenizer)),
        image_token_index=tokenizer.image_token_id,
    )


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_training_loop_trains_a_paligemma2_and_its_checkpoint_loads(tmp_path, lora):
    """paligemma_lib.train's `train` (chapter 11b) on a tiny PaliGemma 2, on chapter
    11b's toy task: the loss falls, and the checkpoint it writes gives the trained
    model's logits: the full model through load_pretrained, the adapter through PEFT."""
    from test_train import DATA, PROCESSOR, SMALL, TOKENIZER, collate

    from paligemma_lib.resume import latest_checkpoint
    from paligemma_lib.train import train

    config = with_tokenizer(CONFIGS["gqa"], TOKENIZER)
    assert PROCESSOR.num_image_tokens == config.num_image_tokens
    ours, theirs = transformers_pair(config, factor=1.0)  # the same random weights
    if lora:
        torch.manual_seed(0)
        add_lora(ours, LoraConfig(r=4, alpha=8))
    run = SMALL  # chapter 11b's short run: 6 steps of 4 examples
    history = train(ours, DATA, collate, run, out_dir=tmp_path, progress=False)
    losses = history["loss"]
    assert len(losses) == run.steps
    # it learns the toy task: from ~log(vocab) = 7.5, the last two steps' mean lower by
    # 5% (the batches' own spread at the starting weights is ~2%); the adapter on a
    # random base falls slowest (to ~6.8 here)
    assert sum(losses[-2:]) / 2 < 0.95 * losses[0]
    inputs = collate([DATA[i] for i in range(4)])
    inputs = {k: inputs[k] for k in inputs.keys() if k != "labels"}
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        expected = ours.eval()(**inputs).logits[real]
    folder = latest_checkpoint(tmp_path)
    assert folder.name.endswith(str(run.steps))
    if lora:
        theirs = peft.PeftModel.from_pretrained(theirs, folder).eval()
        with torch.no_grad():
            got = theirs(**inputs).logits[real]
        # TOL: see above; the adapter adds one product of width r = 4
        torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)
    else:
        loaded = load_pretrained(folder)
        assert loaded.config == config
        with torch.no_grad():
            got = loaded(**inputs).logits[real]
        # bit for bit: the same weights in the same model on the same kernels
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def saved_with_processor(folder):
    """A tiny PaliGemma 2 (the "gqa" sizes, the shipped tokenizer's vocabulary) saved
    by transformers with our processor: a model folder as the demo serves one. Returns
    our model and processor loaded from it, as paligemma_lib.app.serve loads them."""
    tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
    config = with_tokenizer(CONFIGS["gqa"], tokenizer)
    _, theirs = pair(config)
    theirs.save_pretrained(folder)
    PaliGemmaProcessor(
        tokenizer, image_size=28, num_image_tokens=config.num_image_tokens
    ).save_pretrained(folder)
    model = load_pretrained(folder)
    assert model.config == config
    return model, PaliGemmaProcessor.from_pretrained(folder)


# typed by a user
DEMO_TEXT = {"question": "what colour is it?", "detect": "square", "segment": "square"}


def test_the_demo_answers_each_task_from_a_paligemma2_folder(tmp_path):
    """The demo's functions (chapter 13) on a PaliGemma 2 folder: each task's answer
    is `answer()`'s; the attention maps of every layer, local and global, are
    probabilities, and the local layers' window shows in them"""
    from paligemma_lib.demo import TASK_PROMPTS, answer_attention, run_task

    model, processor = saved_with_processor(tmp_path)
    config = model.config
    image = Image.new("RGB", (64, 48), "teal")
    typed = DEMO_TEXT
    n = 8  # answers that outgrow the window (5): `hidden.any()` below
    for task in TASK_PROMPTS:
        result = run_task(model, processor, image, task, typed.get(task, ""), n)
        with warnings.catch_warnings():  # a random model's answer may be cut off
            warnings.simplefilter("ignore")
            expected = answer(model, processor, image, result.prompt, max_new_tokens=n)
        assert result.text == expected, task
        assert result.token_ids, task  # an answer to draw attention maps for
        maps = answer_attention(
            model, processor, image, result.prompt, result.token_ids
        )
        side = config.vision.image_size // config.vision.patch_size
        layers, heads = config.text.num_hidden_layers, config.text.num_attention_heads
        assert maps.shape == (len(result.token_ids), layers, heads, side, side)
        on_image = maps.sum((-1, -2))  # [T, L, H]: the share each head gives the image
        # float32 softmax: its probabilities sum to 1 within ~S (< 30) roundings of
        # 2^-24, so the image's share is <= 1 + 1e-5
        assert (on_image <= 1 + 1e-5).all(), task
        # answer token t is emitted at position S - 1 + t: the prompt's last token
        # (prefix: it sees the whole image) for t = 0, suffix tokens after it. A local
        # layer hides the image (positions 0 .. N - 1) from a suffix position q once
        # q - (N - 1) >= window; a global layer never does (and no allowed key's
        # probability underflows to 0: the cap 1.0 keeps every score in [-1, 1])
        S = len(processor([image], [result.prompt]).input_ids[0])
        N, window = config.num_image_tokens, config.text.sliding_window
        q = S - 1 + torch.arange(len(result.token_ids))
        hidden = (q > S - 1) & (q - (N - 1) >= window)  # [T]
        assert hidden.any(), task  # the window is seen at work
        for layer, kind in enumerate(config.text.layer_types):
            sees = on_image[:, layer] > 0  # [T, H]
            if kind == "sliding_attention":
                assert torch.equal(sees, ~hidden[:, None].expand_as(sees)), task
            else:
                assert sees.all(), task


def test_the_demo_page_runs_each_task_on_a_paligemma2_folder(tmp_path):
    "The page's Run handler (paligemma_lib.app.build_app), called as Gradio calls it"
    pytest.importorskip("gradio", reason="the demo extra: pip install '.[demo]'")
    from paligemma_lib.app import NO_ADAPTER, build_app
    from paligemma_lib.demo import TASK_PROMPTS, run_task

    model, processor = saved_with_processor(tmp_path)
    config = model.config
    run = {f.name: f for f in build_app(model, processor).fns.values()}["on_run"]
    image = Image.new("RGB", (64, 48), "teal")
    typed = DEMO_TEXT
    settings = ("greedy", 1.0, 0, 1.0, 0, 8)  # decode, temperature, k, p, seed, n
    for task in TASK_PROMPTS:
        values = run.fn(image, task, typed.get(task, ""), NO_ADAPTER, *settings)
        assert len(values) == len(run.outputs), task
        result = run_task(model, processor, image, task, typed.get(task, ""), 8)
        assert values[0] == result.text, task
        maps = values[5]  # [T, L, side, side]: the heads' mean per layer
        assert maps.shape[:2] == (len(result.token_ids), config.text.num_hidden_layers)
