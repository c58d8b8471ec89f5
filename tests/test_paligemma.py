"""Chapter 7: config, merging, mask, positions, loss; parity with transformers"""

import pytest
import torch
import transformers
from hf_reference import transformers_name, transformers_pair
from torch import nn
from transformers.models.paligemma import modeling_paligemma

from paligemma_lib.config import (
    Gemma2TextConfig,
    PaliGemmaConfig,
    TextConfig,
    VisionConfig,
)
from paligemma_lib.gemma import additive_mask
from paligemma_lib.paligemma import (
    PaliGemmaForConditionalGeneration,
    PaliGemmaMultiModalProjector,
    make_prefix_lm_mask,
    merge_image_features,
    next_token_loss,
    position_ids_from_mask,
)

IMAGE = 299


def tiny_config(kv_heads=1, head_dim=16, image_size=28, vision_width=32):
    return PaliGemmaConfig(
        vision=VisionConfig(
            hidden_size=vision_width,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=image_size,
            patch_size=14,
        ),
        text=TextConfig(
            vocab_size=300,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
        ),
        image_token_index=IMAGE,
        projection_dim=48,
    )


# float32 parity: ours and transformers' PaliGemma (or two of our runs) do the same
# arithmetic in other orders. Each rounding is off by at most u = 2^-24 relative. The
# roundings behind one logit of tiny_config(): the vision tower's (the patch
# embedding's 588 products; per layer two LayerNorms 4 x 32, q/k/v 32, scores 8,
# softmax and values 4 each, out_proj 32, fc1 32, fc2 64 and ~15 elementwise steps;
# two layers and the final norm: under 1,300), the projector's 32, the decoder's (per
# layer RMSNorms 2 x 48, q/k/v 48, scores 16, softmax and values <= 16 each, o_proj
# 64, gate and up 48, down 96, ~15 elementwise: under 450; two layers, the final norm
# and the head: under 1,000); and a position's angle, which at position p <= 1,012
# rounds by up to p u relative: N < 3,300. Added up (the worst case; random signs give
# ~sqrt(N)), N u = 2.0e-4 of the values' size: 2e-4 times the largest |logit|.
FP32_RELATIVE = 2e-4


def fp32_bound(values: torch.Tensor) -> float:
    "The largest float32 difference two orders of the same arithmetic allow"
    return FP32_RELATIVE * values.abs().max().item()


def pair(config):
    "A random transformers PaliGemma and ours with its weights (all copied, none left)"
    return transformers_pair(config, factor=1.0)


def batch(n_img, rows, side="right", vocab=280, seed=0):
    "Rows of (prefix_len, suffix_len) -> ids, attention_mask, token_type_ids, labels"
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for prefix_len, suffix_len in rows:
        prefix = (
            [IMAGE] * n_img
            + [2]
            + torch.randint(4, vocab, (prefix_len,), generator=g).tolist()
            + [108]
        )
        suffix = torch.randint(4, vocab, (suffix_len,), generator=g).tolist() + (
            [1] if suffix_len else []
        )
        seqs.append((prefix, suffix))
    S = max(len(p) + len(s) for p, s in seqs)
    ids, mask, types = [], [], []
    for prefix, suffix in seqs:
        real = prefix + suffix
        pad = [0] * (S - len(real))
        t = [0] * len(prefix) + [1] * len(suffix)
        m = [1] * len(real)
        if side == "right":
            ids.append(real + pad)
            mask.append(m + pad)
            types.append(t + pad)
        else:
            ids.append(pad + real)
            mask.append(pad + m)
            types.append(pad + t)
    ids, mask, types = torch.tensor(ids), torch.tensor(mask), torch.tensor(types)
    labels = ids.masked_fill((types == 0) | (mask == 0), -100)
    return ids, mask, types, labels


def test_config_from_hub_file_is_the_default():
    hub = {
        "image_token_index": 257152,
        "projection_dim": 2048,
        "hidden_size": 2048,
        "model_type": "paligemma",
        "text_config": {
            "hidden_size": 2048,
            "intermediate_size": 16384,
            "num_attention_heads": 8,
            "num_hidden_layers": 18,
            "num_key_value_heads": 1,
            "vocab_size": 257216,
            "model_type": "gemma",
        },
        "vision_config": {
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "projection_dim": 2048,
            "vision_use_head": False,
        },
    }
    assert PaliGemmaConfig.from_hf(hub) == PaliGemmaConfig()
    assert PaliGemmaConfig.from_hf({}) == PaliGemmaConfig(text=TextConfig())
    c = tiny_config()
    assert PaliGemmaConfig.from_hf(c.to_hf()) == c
    assert (
        PaliGemmaConfig.from_hf(
            {**c.to_hf(), "image_token_id": 7, "image_token_index": 7}
        ).image_token_index
        == 7
    )


def test_config_errors():
    with pytest.raises(ValueError, match="projection_dim"):
        PaliGemmaConfig(projection_dim=1024)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        PaliGemmaConfig(image_token_index=300000)


@pytest.mark.parametrize("where", ["top", "vision_config", "text_config"])
def test_config_num_image_tokens_must_follow_from_the_vision_sizes(where):
    # image_size 28, patch_size 14: 4 image tokens, stated in both sub-configs
    hf = tiny_config().to_hf()
    assert PaliGemmaConfig.from_hf({**hf, "num_image_tokens": 4}).num_image_tokens == 4
    if where == "top":
        hf["num_image_tokens"] = 9
    else:
        hf[where] = {**hf[where], "num_image_tokens": 9}
    with pytest.raises(
        ValueError,
        match=r"num_image_tokens 9 .*contradicts the vision settings.* 4 image tokens",
    ):
        PaliGemmaConfig.from_hf(hf)


def test_config_reads_gemma2_and_refuses_other_model_types():
    hf = tiny_config().to_hf()
    text = {**hf["text_config"], "model_type": "gemma2"}
    config = PaliGemmaConfig.from_hf({**hf, "text_config": text})
    # what config.json leaves out takes transformers' Gemma2Config defaults
    assert isinstance(config.text, Gemma2TextConfig) and config.text.post_norms
    assert config.text.query_pre_attn_scalar == 256
    assert config.text.attn_logit_softcapping == 50.0
    assert config.text.final_logit_softcapping == 30.0
    assert config.text.sliding_window == 4096
    assert config.text.layer_types == ["sliding_attention", "full_attention"]
    assert PaliGemmaConfig.from_hf(config.to_hf()) == config
    # an explicit null turns a cap off, as in transformers
    off = PaliGemmaConfig.from_hf(
        {**hf, "text_config": {**text, "attn_logit_softcapping": None}}
    )
    assert off.text.attn_logit_softcapping is None
    for other in ["gemma3_text", "llama"]:
        with pytest.raises(ValueError, match=f"model_type '{other}'"):
            PaliGemmaConfig.from_hf(
                {**hf, "text_config": {**hf["text_config"], "model_type": other}}
            )


def test_full_model_names_and_parameter_count_match_transformers_on_meta():
    config = PaliGemmaConfig()
    with torch.device("meta"):
        ours = PaliGemmaForConditionalGeneration(config)
        theirs = transformers.PaliGemmaForConditionalGeneration(
            transformers.PaliGemmaConfig(**config.to_hf())
        )
    n_ours = sum(p.numel() for p in ours.parameters())
    n_theirs = sum(p.numel() for p in theirs.parameters())
    assert n_ours == n_theirs
    assert 2_900_000_000 < n_ours < 3_000_000_000
    their_shapes = {
        name: tuple(p.shape)
        for name, p in theirs.named_parameters(remove_duplicate=False)
    }
    our_shapes = {
        transformers_name(name): tuple(p.shape)
        for name, p in ours.named_parameters(remove_duplicate=False)
    }
    # every name, through the shared map, and every shape
    assert our_shapes == their_shapes


def definition(mask, types):
    B, S = mask.shape
    out = torch.zeros(B, S, S, dtype=torch.bool)
    for b in range(B):
        for i in range(S):
            for j in range(S):
                out[b, i, j] = bool(
                    mask[b, i]
                    and mask[b, j]
                    and (j <= i or (types[b, i] == 0 and types[b, j] == 0))
                )
    return out


@pytest.mark.parametrize("side", ["left", "right"])
def test_prefix_lm_mask_equals_definition(side):
    _, mask, types, _ = batch(2, [(3, 4), (1, 0), (5, 2)], side=side)
    full = make_prefix_lm_mask(mask, types)
    assert torch.equal(full, definition(mask, types))
    for q in (1, 2, 5):
        assert torch.equal(
            make_prefix_lm_mask(mask, types, num_queries=q), full[:, -q:]
        )


def test_additive_mask_never_nan():
    _, mask, types, _ = batch(2, [(3, 4), (1, 0)])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        add = additive_mask(make_prefix_lm_mask(mask, types)[:, None], dtype)
        assert add.shape[1] == 1 and add.dtype == dtype and torch.isfinite(add).all()
        assert torch.isfinite(
            torch.softmax((torch.randn(add.shape).to(dtype) + add).float(), -1)
        ).all()


def test_position_ids_skip_padding_and_start_at_one():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[1, 1, 1, 2, 3], [1, 2, 3, 4, 1]]


def test_loss_is_mean_over_suffix_predictions():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[-100, -100, 3, 4, 5], [-100, 7, 8, -100, -100]])
    terms = [
        -torch.log_softmax(logits[b, t], -1)[labels[b, t + 1]]
        for b in range(2)
        for t in range(4)
        if labels[b, t + 1] != -100
    ]
    torch.testing.assert_close(
        next_token_loss(logits, labels), torch.stack(terms).mean()
    )


@pytest.mark.parametrize(
    "config",
    [
        tiny_config(),
        tiny_config(kv_heads=2),
        tiny_config(head_dim=24, image_size=42, vision_width=40),
    ],
    ids=["mqa", "gqa", "head_dim_and_9_patches"],
)
@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_and_loss_equal_transformers(config, side):
    ours, theirs = pair(config)
    n_img = config.num_image_tokens
    ids, mask, types, labels = batch(n_img, [(3, 4), (1, 2), (5, 0)], side=side)
    pixels = torch.randn(3, 3, config.vision.image_size, config.vision.image_size)
    with torch.no_grad():
        a = ours(ids, pixels, attention_mask=mask, token_type_ids=types, labels=labels)
        b = theirs(
            input_ids=ids,
            pixel_values=pixels,
            attention_mask=mask,
            token_type_ids=types,
            labels=labels,
        )
    # float32, the same arithmetic in other orders through both towers (fp32_bound)
    real = mask.bool()
    assert (a.logits - b.logits)[real].abs().max() <= fp32_bound(b.logits[real])
    # float32 cross-entropy over logits equal to ~1e-5, averaged over the answer tokens
    torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)


def test_without_token_type_ids_everything_is_prefix():
    config = tiny_config()
    ours, theirs = pair(config)
    ids, mask, _, _ = batch(config.num_image_tokens, [(4, 0), (2, 0)], side="left")
    pixels = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        a = ours(ids, pixels, attention_mask=mask).logits
        b = ours(
            ids, pixels, attention_mask=mask, token_type_ids=torch.zeros_like(ids)
        ).logits
        c = theirs(
            input_ids=ids,
            pixel_values=pixels,
            attention_mask=mask,
            token_type_ids=torch.zeros_like(ids),
        ).logits
    torch.testing.assert_close(a, b)
    # float32, the same arithmetic in other orders (fp32_bound)
    real = mask.bool()
    assert (a - c)[real].abs().max() <= fp32_bound(c[real])


def test_bfloat16_padded_batch_has_no_nan():
    config = tiny_config()
    model = PaliGemmaForConditionalGeneration(config).to(torch.bfloat16).eval()
    ids, mask, types, labels = batch(config.num_image_tokens, [(3, 4), (1, 1)])
    with torch.no_grad():
        out = model(
            ids,
            torch.randn(2, 3, 28, 28),
            attention_mask=mask,
            token_type_ids=types,
            labels=labels,
        )
    assert (
        out.logits.dtype == torch.bfloat16
        and torch.isfinite(out.logits).all()
        and torch.isfinite(out.loss)
    )


def test_wrong_number_of_image_tokens_is_a_clear_error():
    config = tiny_config()
    model = PaliGemmaForConditionalGeneration(config).eval()
    ids = torch.tensor([[IMAGE] * 3 + [2, 5, 108]])
    with pytest.raises(
        ValueError,
        match="row 0 of input_ids holds 3 <image> tokens but its image gives 4 "
        "features",
    ):
        model(ids, torch.randn(1, 3, 28, 28))


def test_input_ids_must_be_a_batch_tensor():
    """1-D, 3-D or list input_ids: the error names [batch, seq] and the fix, before
    any shape is unpacked; within _InputsChecked too (the shape reads no value)"""
    from paligemma_lib.input_checks import _InputsChecked

    model = PaliGemmaForConditionalGeneration(tiny_config()).eval()
    row = [IMAGE] * 4 + [2, 5, 108]
    fix = r"\[batch, seq\] LongTensor .*ids\[None\] or torch.tensor\(\[ids\]\)"
    for bad in (torch.tensor(row), torch.tensor([[row]]), [row]):
        with pytest.raises(ValueError, match=fix):
            model(bad, torch.randn(1, 3, 28, 28))
        with _InputsChecked(), pytest.raises(ValueError, match=fix):
            model(bad, torch.randn(1, 3, 28, 28))


def test_image_tokens_are_counted_row_by_row():
    "Five <image> tokens in one row and three in the other: the right total, an error"
    model = PaliGemmaForConditionalGeneration(tiny_config()).eval()
    ids = torch.tensor([[IMAGE] * 4 + [2, 5, 108], [IMAGE] * 4 + [2, 5, 108]])
    ids[1, 5] = IMAGE  # row 1: five
    ids[0, 0] = 2  # row 0: three
    assert (ids == IMAGE).sum() == 2 * 4
    with pytest.raises(
        ValueError,
        match=r"^row 0 of input_ids holds 3 <image> tokens .* \(2 such rows\)",
    ):
        model(ids, torch.randn(2, 3, 28, 28))
    with pytest.raises(ValueError, match="2 images for 1 prompts"):
        model(ids[:1], torch.randn(2, 3, 28, 28))


def test_image_tokens_without_pixel_values_are_an_error():
    model = PaliGemmaForConditionalGeneration(tiny_config()).eval()
    ids = torch.tensor([[IMAGE] * 4 + [2, 5, 108]])
    with pytest.raises(ValueError, match="<image> tokens but no pixel_values"):
        model(ids)
    with torch.no_grad():
        model(ids[:, 4:])  # text alone, with no <image> token, is fine


def test_mask_shapes_must_cover_the_sequence():
    model = PaliGemmaForConditionalGeneration(tiny_config()).eval()
    ids = torch.tensor([[IMAGE] * 4 + [2, 5, 108]])
    with pytest.raises(ValueError, match=r"must cover all tokens so far: \[1, 7\]"):
        model(
            ids,
            torch.randn(1, 3, 28, 28),
            attention_mask=torch.ones(1, 5, dtype=torch.long),
        )


def test_forward_is_defined_in_the_class():
    "help() and the module show forward as a method of the class, not an assignment"
    forward = PaliGemmaForConditionalGeneration.forward
    assert "forward" in vars(PaliGemmaForConditionalGeneration)
    assert forward.__qualname__ == "PaliGemmaForConditionalGeneration.forward"


def test_merge_image_features_writes_the_image_slots_only():
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[IMAGE, IMAGE, 2, 7], [2, IMAGE, IMAGE, 8]])
    embeds, features = (
        torch.randn(2, 4, 6, generator=g),
        torch.randn(2, 2, 6, generator=g),
    )
    merged = merge_image_features(embeds, ids, features, IMAGE)
    is_image = ids == IMAGE
    torch.testing.assert_close(merged[is_image], features.reshape(-1, 6))
    torch.testing.assert_close(merged[~is_image], embeds[~is_image])


def test_projector_is_one_linear_despite_projector_hidden_act():
    "projector_hidden_act in config.json is a legacy key: the projector is one Linear"
    config = tiny_config()
    hf = config.to_hf()
    hf["vision_config"]["projector_hidden_act"] = "gelu_fast"
    theirs = modeling_paligemma.PaliGemmaMultiModalProjector(
        transformers.PaliGemmaConfig(**hf)
    )
    assert [type(m) for m in theirs.modules()][1:] == [nn.Linear]
    ours = PaliGemmaMultiModalProjector(config)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 4, config.vision.hidden_size)
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours(x), x @ ours.linear.weight.T + ours.linear.bias)


def test_logits_depend_only_on_position_differences():
    "RoPE: positions from 0, from 1, from 1000 or counting left padding: same logits"
    config = tiny_config()
    ours, _ = transformers_pair(config)  # sharpened: attention depends on positions
    ids, mask, types, _ = batch(config.num_image_tokens, [(2, 0), (5, 0)], side="left")
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(0))

    def logits(position_ids):
        with torch.no_grad():
            return ours(
                ids,
                pixels,
                attention_mask=mask,
                token_type_ids=types,
                position_ids=position_ids,
            ).logits

    positions = position_ids_from_mask(mask)
    reference, real = logits(positions), mask.bool()
    B, S = ids.shape
    # fp32_bound counts a position's angle rounding, up to position 1,012
    bound = fp32_bound(reference[real])
    for shifted in [positions - 1, positions + 999, torch.arange(S).expand(B, S)]:
        assert (logits(shifted) - reference)[real].abs().max() <= bound
    # the check can fail: doubled positions (other differences) move past the bound
    assert (logits(2 * positions) - reference)[real].abs().max() > bound


def per_example_loss(logits, labels):
    "big_vision's reduction (trainers/proj/paligemma/train.py): per example, then mean"
    means = []
    for b in range(labels.shape[0]):
        terms = [
            -torch.log_softmax(logits[b, t], -1)[labels[b, t + 1]]
            for t in range(labels.shape[1] - 1)
            if labels[b, t + 1] != -100
        ]
        means.append(torch.stack(terms).mean())
    return torch.stack(means).mean()


def test_loss_is_the_token_mean_not_big_visions_example_mean():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    unequal = torch.tensor([[-100, 1, 2, 3, 4, 5], [-100, -100, -100, -100, 6, 7]])
    equal = torch.tensor(
        [[-100, -100, -100, -100, 4, 5], [-100, -100, -100, -100, 6, 7]]
    )
    token_mean = next_token_loss(logits, unequal)
    example_mean = per_example_loss(logits, unequal)
    # the two means differ by far more than float32 rounds a mean of 7 terms (~1e-6)
    assert (token_mean - example_mean).abs() > 1e-3
    torch.testing.assert_close(
        next_token_loss(logits, equal), per_example_loss(logits, equal)
    )
