"""Chapters 4 and 5: Gemma's building blocks and decoder, against transformers' Gemma.

Notation as in the book: B batch, S sequence, D model width, H query heads, K key/value
heads, d_h head width, V vocabulary."""

import ast
import contextlib
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
import transformers.models.gemma.modeling_gemma as hf_gemma
from transformers import Gemma2Config, GemmaConfig, PaliGemmaConfig

from paligemma_lib.config import TextConfig
from paligemma_lib.gemma import (
    GemmaAttention,
    GemmaForCausalLM,
    GemmaMLP,
    GemmaRMSNorm,
    GemmaRotaryEmbedding,
    additive_mask,
    apply_rotary_pos_emb,
    make_causal_mask,
    repeat_kv,
    rope_inv_freq,
    rotate_half,
)


def tiny(**overrides) -> TextConfig:
    settings = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
    )
    return TextConfig(**{**settings, **overrides})


# float32 parity: ours and transformers' Gemma (or two of our runs) do the same
# arithmetic in other orders. Each rounding is off by at most u = 2^-24 relative. The
# roundings behind one logit of tiny(): per layer the terms of each reduction (RMSNorm
# 64, q/k/v 64, scores d_h <= 32, softmax and the values' sum S <= 9 each, o_proj
# <= 128, RMSNorm 64, gate and up 64, down 128) and ~15 elementwise steps (RoPE, the
# tanh GELU, the residual sums): under 600; two layers, then the final norm and the head
# (64 each): N < 1,400. Adding them up (the worst case; random signs give ~sqrt(N)),
# N u = 8.3e-5 of the values' size: 1e-4 times the largest |logit| (~10 here).
FP32_RELATIVE = 1e-4


def fp32_bound(logits: torch.Tensor) -> float:
    "The largest float32 difference two orders of the same arithmetic allow"
    return FP32_RELATIVE * logits.abs().max().item()


VARIANTS = {
    "1 KV head": dict(num_key_value_heads=1),
    "2 KV heads of 4": dict(num_key_value_heads=2),
    "4 KV heads of 4": dict(num_key_value_heads=4),
    "d_h 32 != D/H = 64/4": dict(num_key_value_heads=2, head_dim=32),
}


def reference_and_ours(config: TextConfig, seed: int = 0):
    """transformers' GemmaForCausalLM (eager attention) with random weights, norms
    included, and ours loaded from it"""
    torch.manual_seed(seed)
    reference = hf_gemma.GemmaForCausalLM(
        GemmaConfig(**config.to_hf(), attn_implementation="eager")
    ).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.3)
    ours = GemmaForCausalLM(config).eval()
    ours.load_state_dict(reference.state_dict())  # strict: every name and shape
    return reference, ours


class ConcatCache:
    "The two methods GemmaForCausalLM asks of a KV cache, by concatenation"

    def __init__(self):
        self.keys, self.values = {}, {}

    def get_seq_length(self):
        return self.keys[0].shape[-2] if self.keys else 0

    def update(self, layer_idx, key, value):
        if layer_idx in self.keys:
            key = torch.cat([self.keys[layer_idx], key], dim=-2)
            value = torch.cat([self.values[layer_idx], value], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value


# ---- parity of the whole model -------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers(variant):
    reference, ours = reference_and_ours(tiny(**VARIANTS[variant]))
    input_ids = torch.randint(
        0, 512, (2, 7), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        theirs = reference(input_ids=input_ids).logits
        diff = (ours(input_ids).logits - theirs).abs().max().item()
    assert diff <= fp32_bound(theirs), diff


@pytest.mark.parametrize(
    "variant", ["1 KV head", "2 KV heads of 4", "d_h 32 != D/H = 64/4"]
)
def test_right_padded_batch_equals_transformers(variant):
    reference, ours = reference_and_ours(tiny(**VARIANTS[variant]))
    input_ids = torch.randint(
        3, 512, (3, 8), generator=torch.Generator().manual_seed(2)
    )
    attention_mask = torch.ones(3, 8, dtype=torch.long)
    attention_mask[1, 5:] = 0
    attention_mask[2, 2:] = 0
    real = attention_mask.bool()
    with torch.no_grad():
        ours_logits = ours(input_ids, attention_mask=attention_mask).logits
        theirs = reference(input_ids=input_ids, attention_mask=attention_mask).logits
        alone = ours(input_ids[1:2, :5]).logits  # the padded sequence on its own
    assert (ours_logits - theirs)[real].abs().max().item() <= fp32_bound(theirs)
    # Padding changes nothing: the masked columns add exact zeros, and the reductions
    # run in other orders (fp32_bound's derivation)
    bound = fp32_bound(alone)
    # an absolute bound (rtol=0), derived above
    torch.testing.assert_close(ours_logits[1, :5], alone[0], atol=bound, rtol=0)


@pytest.mark.parametrize("variant", ["1 KV head", "2 KV heads of 4"])
def test_explicit_position_ids_equal_transformers(variant):
    reference, ours = reference_and_ours(tiny(**VARIANTS[variant]))
    input_ids = torch.randint(
        3, 512, (2, 7), generator=torch.Generator().manual_seed(7)
    )
    one_based = torch.arange(1, 8)[None]  # PaliGemma's positions start at 1
    with_a_gap = torch.tensor([[0, 1, 2, 10, 11, 12, 13]])
    left_padded = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    # [[0, 0, 0, 0, 1, 2, 3], [0, ..., 6]]
    from_mask = (left_padded.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        default = ours(input_ids).logits
        for positions in [one_based, with_a_gap, one_based.expand(2, 7)]:
            logits = ours(input_ids, position_ids=positions).logits
            theirs = reference(input_ids=input_ids, position_ids=positions).logits
            assert (logits - theirs).abs().max().item() <= fp32_bound(theirs)
            if positions is with_a_gap:
                # The positions are used: moved by O(1), far beyond fp32_bound
                assert (logits - default).abs().max() > 10 * fp32_bound(default)
            else:
                # ...and only their differences. fp32_bound's orders, plus the
                # angles m f (f <= 1) rounded at positions <= 13: <= 13 u/2 = 4e-7 rad,
                # a relative change of q.k far below N u
                bound = fp32_bound(default)
                # an absolute bound (rtol=0), derived above
                torch.testing.assert_close(logits, default, atol=bound, rtol=0)
        ours_left = ours(
            input_ids, attention_mask=left_padded, position_ids=from_mask
        ).logits
        theirs_left = reference(
            input_ids=input_ids, attention_mask=left_padded, position_ids=from_mask
        ).logits
        # The left-padded sequence without its padding.
        alone = ours(input_ids[:1, 3:]).logits
    real = left_padded.bool()
    assert (ours_left - theirs_left)[real].abs().max().item() <= fp32_bound(theirs_left)
    # Padding changes nothing (fp32_bound: the same arithmetic in other orders)
    bound = fp32_bound(alone)
    # an absolute bound (rtol=0), derived above
    torch.testing.assert_close(ours_left[0, 3:], alone[0], atol=bound, rtol=0)


def test_4d_mask_equals_2d_mask():
    _, ours = reference_and_ours(tiny(num_key_value_heads=2))
    input_ids = torch.randint(
        3, 512, (2, 6), generator=torch.Generator().manual_seed(3)
    )
    padding = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    mask_4d = make_causal_mask(padding, 6, torch.float32)
    with torch.no_grad():
        from_2d = ours(input_ids, attention_mask=padding).logits
        from_4d = ours(input_ids, attention_mask=mask_4d).logits
        # bit for bit: the 2D mask becomes this very 4D mask, then the same arithmetic
        torch.testing.assert_close(from_4d, from_2d, rtol=0, atol=0)
        # -inf is clamped to the finite minimum.
        with_inf = mask_4d.masked_fill(mask_4d < 0, float("-inf"))
        from_inf = ours(input_ids, attention_mask=with_inf).logits
        # bit for bit: after the clamp the mask is the same numbers
        torch.testing.assert_close(from_inf, from_2d, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_has_no_nan_with_a_fully_masked_row(dtype):
    _, ours = reference_and_ours(tiny())
    ours = ours.to(dtype)
    input_ids = torch.randint(
        3, 512, (2, 6), generator=torch.Generator().manual_seed(4)
    )
    left_padded = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    # Query 0 sees no key.
    assert (make_causal_mask(left_padded, 6, dtype)[0, 0, 0] < 0).all()
    # Its minimum is -inf in float16.
    float32_mask = make_causal_mask(left_padded, 6, torch.float32)
    with torch.no_grad():
        for mask in [left_padded, float32_mask]:
            logits = ours(input_ids, attention_mask=mask).logits
            assert logits.dtype == dtype and torch.isfinite(logits).all()


def test_bfloat16_stays_close_to_float32():
    _, ours = reference_and_ours(tiny(num_key_value_heads=2))
    input_ids = torch.randint(
        3, 512, (2, 6), generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        full = ours(input_ids).logits
        half = ours.to(torch.bfloat16)(input_ids).logits.float()
    # bfloat16 keeps 8 significant bits: each rounding is off by at most 2^-9
    # relative. Behind one logit of this model: per layer 7 weight matrices and ~17
    # rounded activations (norm, q, k, v, RoPE'd q and k, probabilities, attention
    # output, o_proj, residual, norm, gate, up, GELU, product, down, residual): 24;
    # two layers, the embedding, its scale, the final norm and the head: N ~ 52.
    # Added up (the worst case), N 2^-9 = 0.10 of the logits' size.
    assert (half - full).abs().max() < 0.10 * full.abs().max()


def test_cache_hooks_give_the_same_logits_as_one_pass():
    _, ours = reference_and_ours(tiny(num_key_value_heads=2))
    input_ids = torch.randint(
        3, 512, (2, 8), generator=torch.Generator().manual_seed(6)
    )
    mask = torch.ones(2, 8, dtype=torch.long)
    with torch.no_grad():
        full = ours(input_ids, attention_mask=mask).logits
        cache = ConcatCache()
        steps = [
            ours(input_ids[:, :5], attention_mask=mask[:, :5], kv_cache=cache).logits
        ]
        # Then one token at a time; positions continue from the cache's length.
        for t in range(5, 8):
            steps.append(
                ours(
                    input_ids[:, t : t + 1],
                    attention_mask=mask[:, : t + 1],
                    kv_cache=cache,
                ).logits
            )
    assert cache.get_seq_length() == 8
    # cached and full runs differ only in the order and length of the reductions
    bound = fp32_bound(full)
    # an absolute bound (rtol=0), derived above
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=bound, rtol=0)


# ---- the model's structure -----------------------------------------------------------


def test_state_dict_names_equal_transformers_and_head_is_tied():
    config = tiny(num_hidden_layers=3)
    ours = GemmaForCausalLM(config)
    theirs = hf_gemma.GemmaForCausalLM(GemmaConfig(**config.to_hf()))
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()
    }
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert (ours.model.embed_tokens.weight[config.pad_token_id] == 0).all()
    assert all((layer.input_layernorm.weight == 0).all() for layer in ours.model.layers)


def test_tie_weights_restores_the_tie_after_to_empty():
    with torch.device("meta"):
        model = GemmaForCausalLM(tiny())
    model = model.to_empty(device="cpu")
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_full_size_on_meta_has_transformers_parameter_count():
    with torch.device("meta"):
        ours = GemmaForCausalLM(TextConfig())
        theirs = hf_gemma.GemmaForCausalLM(GemmaConfig(**TextConfig().to_hf()))
    assert (
        sum(p.numel() for p in ours.parameters())
        == theirs.num_parameters()
        == 2_508_662_784
    )
    shapes = {k: v.shape for k, v in ours.state_dict().items()}
    assert shapes == {k: v.shape for k, v in theirs.state_dict().items()}
    assert shapes["model.layers.17.self_attn.k_proj.weight"] == (256, 2048)
    assert shapes["model.embed_tokens.weight"] == (257216, 2048)


def test_embedding_scale_in_bfloat16_equals_transformers():
    config = tiny(
        hidden_size=2048, num_attention_heads=8, head_dim=256, num_hidden_layers=0
    )
    ours = GemmaForCausalLM(config).to(torch.bfloat16)
    theirs = hf_gemma.GemmaModel(GemmaConfig(**config.to_hf())).to(torch.bfloat16)
    theirs.embed_tokens.load_state_dict(ours.model.embed_tokens.state_dict())
    ids = torch.arange(512)[None]
    assert torch.equal(ours.model.embed(ids), theirs.embed_tokens(ids))


def test_inputs_embeds_are_used_as_given():
    _, ours = reference_and_ours(tiny())
    ids = torch.tensor([[2, 5, 9, 400]])
    with torch.no_grad():
        torch.testing.assert_close(
            ours(inputs_embeds=ours.model.embed(ids)).logits, ours(ids).logits
        )
        unscaled = ours(inputs_embeds=ours.model.embed_tokens(ids)).logits
    # without the sqrt(hidden) scale the logits move by O(1), far beyond rounding
    assert not torch.allclose(unscaled, ours(ids).logits)


def test_clear_errors_for_bad_inputs():
    model = GemmaForCausalLM(tiny())
    ids = torch.tensor([[2, 5, 9]])
    with pytest.raises(ValueError, match="exactly one"):
        model(ids, inputs_embeds=model.model.embed(ids))
    with pytest.raises(ValueError, match="exactly one"):
        model()
    with pytest.raises(ValueError, match="0 to 511"):
        model(torch.tensor([[2, 512]]))
    with pytest.raises(ValueError, match=r"\[batch, 3\]"):
        model(ids, attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="additive_mask"):
        model(ids, attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="expected a 2-D padding mask"):
        model(ids, attention_mask=torch.zeros(1, 3, 3))
    with pytest.raises(ValueError, match="one column per key"):
        model(ids, attention_mask=torch.zeros(1, 1, 3, 5))


def test_input_ids_must_be_a_batch_tensor():
    """1-D, 3-D or list input_ids: an error naming the shape [batch, seq] and the
    fix, also within _InputsChecked (the shape reads no value)"""
    from paligemma_lib.input_checks import _InputsChecked

    model = GemmaForCausalLM(tiny())
    for bad, got in [
        (torch.tensor([2, 5, 9]), r"a tensor of shape \[3\]"),
        (torch.tensor([[[2, 5, 9]]]), r"a tensor of shape \[1, 1, 3\]"),
        ([[2, 5, 9]], "a list"),
    ]:
        message = (
            rf"^input_ids must be a \[batch, seq\] LongTensor of token ids, not {got};"
            r" for one sequence use ids\[None\] or torch.tensor\(\[ids\]\)$"
        )
        for checked in (False, True):
            with _InputsChecked() if checked else contextlib.nullcontext():
                for forward in (model, model.model):
                    with pytest.raises(ValueError, match=message):
                        forward(input_ids=bad)


def test_clear_errors_for_mismatched_batch_positions_and_dtypes():
    model = GemmaForCausalLM(tiny())
    ids = torch.tensor([[2, 5, 9], [4, 6, 8]])
    with pytest.raises(ValueError, match="2 rows but the input is a batch of 1"):
        model(ids[:1], attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="1 rows but the input is a batch of 2"):
        model(ids, attention_mask=torch.ones(1, 3))
    for bad in [
        torch.arange(4)[None],
        torch.arange(3),
        torch.zeros(3, 3, dtype=torch.long),
    ]:
        with pytest.raises(
            ValueError, match=r"position_ids has shape .*expected \[2, 3\] or \[1, 3\]"
        ):
            model(ids, position_ids=bad)
    with pytest.raises(ValueError, match="must be integers.*inputs_embeds"):
        model(ids.float())
    with pytest.raises(ValueError, match=r"inputs_embeds.to\(torch.float32\)"):
        model(inputs_embeds=model.model.embed(ids).bfloat16())
    with pytest.raises(ValueError, match=r"expected \[batch, seq, 64\]"):
        model(inputs_embeds=torch.zeros(2, 3, 32))
    # [1, S] and [B, S] are both fine.
    model(ids, position_ids=torch.arange(1, 4)[None])
    model(ids, position_ids=torch.arange(1, 4).expand(2, 3))


# ---- building blocks -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_equals_transformers(dtype):
    torch.manual_seed(0)
    ours = GemmaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_(0, 0.5)
    theirs = hf_gemma.GemmaRMSNorm(48, eps=1e-6)
    theirs.load_state_dict(ours.state_dict())
    x = (4 * torch.randn(3, 5, 48)).to(dtype)
    assert ours(x).dtype == dtype
    assert torch.equal(ours(x), theirs(x))


def test_rms_norm_is_not_layer_norm():
    x = torch.randn(4, 32) + 2.0
    layer_norm = torch.nn.LayerNorm(32, elementwise_affine=False, eps=1e-6)
    # inputs with mean 2: the two norms differ by O(1), far beyond 1e-2
    assert not torch.allclose(GemmaRMSNorm(32)(x), layer_norm(x), atol=1e-2)


def test_mlp_equals_transformers():
    torch.manual_seed(0)
    ours = GemmaMLP(32, 80)
    theirs = hf_gemma.GemmaMLP(GemmaConfig(hidden_size=32, intermediate_size=80))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 7, 32)
    # float32, the same matmuls and GELU, kernels may sum the 32/80 terms in other
    # orders: ~1e-7 on outputs < 1
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "head_dim, theta", [(16, 10000.0), (256, 10000.0), (32, 500.0)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_transformers(head_dim, theta, dtype):
    reference = hf_gemma.GemmaRotaryEmbedding(
        GemmaConfig(
            head_dim=head_dim,
            rope_parameters={"rope_type": "default", "rope_theta": theta},
        )
    )
    assert torch.equal(reference.inv_freq, rope_inv_freq(head_dim, theta))
    position_ids = torch.tensor([[0, 1, 2, 3], [100, 257, 4095, 8191]])
    ours = GemmaRotaryEmbedding(head_dim, theta)(position_ids, dtype)
    theirs = reference(torch.zeros(1, dtype=dtype), position_ids)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    q, k = (
        torch.randn(2, 4, 4, head_dim).to(dtype),
        torch.randn(2, 1, 4, head_dim).to(dtype),
    )
    for a, b in zip(
        apply_rotary_pos_emb(q, k, *ours), hf_gemma.apply_rotary_pos_emb(q, k, *theirs)
    ):
        assert torch.equal(a, b)


def test_rope_scores_depend_only_on_distance_and_norms_are_kept():
    rope = GemmaRotaryEmbedding(64)
    q, k = (
        torch.randn(1, 1, 1, 64, dtype=torch.float64),
        torch.randn(1, 1, 1, 64, dtype=torch.float64),
    )

    def score(m, n):
        cos_m, sin_m = (t.double() for t in rope(torch.tensor([[m]])))
        cos_n, sin_n = (t.double() for t in rope(torch.tensor([[n]])))
        q_m, _ = apply_rotary_pos_emb(q, q, cos_m, sin_m)
        k_n, _ = apply_rotary_pos_emb(k, k, cos_n, sin_n)
        torch.testing.assert_close(q_m.norm(), q.norm())
        return (q_m * k_n).sum()

    # float32 angles: at position ~100 the angle rounds by half an ulp of 100 (4e-6
    # rad), at ~1000 by 3e-5 rad, times the score's terms (~1): 1e-5 and 1e-4
    torch.testing.assert_close(score(3, 1), score(103, 101), atol=1e-5, rtol=1e-5)
    # the same, at ~1000
    torch.testing.assert_close(score(40, 7), score(1040, 1007), atol=1e-4, rtol=1e-5)
    # another distance: the score moves by O(0.1), far beyond rounding
    assert not torch.isclose(score(3, 1), score(3, 2))


def test_rotate_half_is_the_interleaved_rotation_after_a_permutation():
    d_h, m = 16, 7
    inv_freq = rope_inv_freq(d_h).double()
    x = torch.randn(d_h, dtype=torch.float64)
    interleaved = x.clone()  # pairs (2i, 2i + 1) rotated by m * inv_freq[i]
    c, s = torch.cos(m * inv_freq), torch.sin(m * inv_freq)
    interleaved[0::2], interleaved[1::2] = (
        x[0::2] * c - x[1::2] * s,
        x[1::2] * c + x[0::2] * s,
    )
    perm = torch.cat([torch.arange(0, d_h, 2), torch.arange(1, d_h, 2)])
    cos, sin = torch.cat([c, c]), torch.cat([s, s])
    torch.testing.assert_close(
        x[perm] * cos + rotate_half(x[perm]) * sin, interleaved[perm]
    )


def test_rope_needs_no_state_and_survives_meta_construction():
    with torch.device("meta"):
        rope = GemmaRotaryEmbedding(32)
    assert len(rope.state_dict()) == 0
    positions = torch.arange(5)[None]
    assert all(
        torch.equal(a, b)
        for a, b in zip(rope(positions), GemmaRotaryEmbedding(32)(positions))
    )
    with pytest.raises(ValueError, match="even"):
        GemmaRotaryEmbedding(15)


def test_repeat_kv_equals_repeat_interleave_and_broadcasting():
    k = torch.randn(2, 2, 5, 8)
    expected = k.repeat_interleave(3, dim=1)
    # bit for bit: repeat_kv only copies values
    torch.testing.assert_close(repeat_kv(k, 3), expected, rtol=0, atol=0)
    assert repeat_kv(k, 1) is k
    q, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 5, 8)
    torch.testing.assert_close(
        torch.nn.functional.scaled_dot_product_attention(
            q, repeat_kv(k, 3), repeat_kv(v, 3)
        ),
        torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    )


@pytest.mark.parametrize(
    "variant", ["1 KV head", "2 KV heads of 4", "d_h 32 != D/H = 64/4"]
)
def test_attention_equals_transformers(variant):
    config = tiny(**VARIANTS[variant])
    torch.manual_seed(0)
    ours = GemmaAttention(config, layer_idx=0).eval()
    theirs = hf_gemma.GemmaAttention(
        GemmaConfig(**config.to_hf(), attn_implementation="eager"), layer_idx=0
    ).eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, config.hidden_size)
    cos_sin = GemmaRotaryEmbedding(config.head_dim)(torch.arange(5)[None])
    mask = make_causal_mask(
        torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), 5, torch.float32
    )
    ours_out, their_out = ours(x, cos_sin, mask), theirs(x, cos_sin, mask)[0]
    # float32, reductions of a few tens of terms in other orders: ~1e-6 relative
    torch.testing.assert_close(ours_out, their_out, atol=1e-5, rtol=1e-5)


def test_masks():
    mask = make_causal_mask(torch.tensor([[1, 1, 1, 0]]), 4, torch.bfloat16)
    allowed = mask[0, 0] == 0
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]
    ).bool()
    assert mask.shape == (1, 1, 4, 4) and torch.equal(allowed, expected)
    assert mask.min() == torch.finfo(torch.bfloat16).min and not mask.isinf().any()
    after_cache = make_causal_mask(None, 1, torch.float32, past_length=3)
    assert after_cache.shape == (1, 1, 1, 4) and (after_cache == 0).all()
    assert torch.equal(
        additive_mask(torch.tensor([True, False]), torch.float16),
        torch.tensor([0, torch.finfo(torch.float16).min], dtype=torch.float16),
    )
    with pytest.raises(ValueError, match=r"\[batch, 5\]"):
        make_causal_mask(torch.ones(1, 4), 2, torch.float32, past_length=3)


# ---- configuration -------------------------------------------------------------------


def test_text_config_defaults_are_paligemma_3b():
    # A transcription, typed by hand, of the "text_config" section of config.json in the
    # Hub repository google/paligemma-3b-pt-224 (main branch); chapter 5 checks it
    # against the real file when one is present.
    hub_text_config = {
        "hidden_size": 2048,
        "intermediate_size": 16384,
        "model_type": "gemma",
        "num_attention_heads": 8,
        "num_hidden_layers": 18,
        "num_image_tokens": 256,
        "num_key_value_heads": 1,
        "torch_dtype": "float32",
        "vocab_size": 257216,
    }
    assert TextConfig.from_hf(GemmaConfig(**hub_text_config).to_dict()) == TextConfig()
    hf_defaults = TextConfig.from_hf(PaliGemmaConfig().text_config.to_dict())
    assert asdict(hf_defaults) == {**asdict(TextConfig()), "vocab_size": 257152}


def test_text_config_round_trips_through_transformers():
    config = tiny(num_key_value_heads=2, rope_theta=500.0, rms_norm_eps=1e-5)
    theirs = GemmaConfig(**config.to_hf())
    assert theirs.rope_parameters == {"rope_type": "default", "rope_theta": 500.0}
    for name, value in asdict(config).items():
        if name != "rope_theta":
            assert getattr(theirs, name) == value, name
    assert TextConfig.from_hf(config.to_hf()) == config
    assert TextConfig.from_hf(theirs.to_dict()) == config
    old_spelling = asdict(config)  # top-level rope_theta, no rope_parameters
    assert (
        TextConfig.from_hf(
            {**old_spelling, "hidden_act": "gelu", "hidden_activation": None}
        )
        == config
    )
    assert (
        TextConfig.from_hf({**old_spelling, "hidden_activation": "gelu_pytorch_tanh"})
        == config
    )
    # hidden_activation wins over hidden_act: when they disagree, only the override
    # can pass
    assert (
        TextConfig.from_hf(
            {
                **old_spelling,
                "hidden_act": "relu",
                "hidden_activation": "gelu_pytorch_tanh",
            }
        )
        == config
    )
    with pytest.raises(ValueError, match="relu"):
        TextConfig.from_hf(
            {
                **old_spelling,
                "hidden_act": "gelu_pytorch_tanh",
                "hidden_activation": "relu",
            }
        )


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(num_attention_heads=8, num_key_value_heads=3), "[1, 2, 4, 8]"),
        (dict(head_dim=15), "even"),
        (dict(hidden_act="relu"), "gelu_pytorch_tanh"),
        (dict(num_key_value_heads=0), "num_key_value_heads=0"),
        (dict(num_attention_heads=-8), "num_attention_heads=-8"),
        (dict(hidden_size=0), "hidden_size=0"),
        (dict(head_dim=0), "head_dim=0"),
        (dict(vocab_size=0), "vocab_size=0"),
        (dict(intermediate_size=-1), "intermediate_size=-1"),
        (dict(num_hidden_layers=-1), "num_hidden_layers=-1"),
    ],
)
def test_text_config_refuses_bad_settings(bad, words):
    with pytest.raises(ValueError) as error:
        TextConfig(**bad)
    assert words in str(error.value)


@pytest.mark.parametrize(
    "setting",
    [
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {
            "rope_parameters": {
                "rope_type": "linear",
                "rope_theta": 10000.0,
                "factor": 2.0,
            }
        },
        {"attention_bias": True},
        {"tie_word_embeddings": False},
    ],
)
def test_text_config_refuses_unsupported_variants(setting):
    with pytest.raises(ValueError):
        TextConfig.from_hf(setting)


def test_text_config_accepts_zero_layers():
    assert TextConfig(num_hidden_layers=0).num_hidden_layers == 0


@pytest.mark.parametrize(
    "text_config",
    [
        {**Gemma2Config().to_dict(), "model_type": "gemma3_text"},
        {"model_type": "gemma3_text"},
    ],
)
def test_text_config_refuses_other_model_types_naming_gemma_2(text_config):
    with pytest.raises(ValueError) as error:
        TextConfig.from_hf(text_config)
    for words in [
        "Gemma 2",
        "PaliGemma 2",
        "soft-capping",
        "query_pre_attn_scalar",
        "sliding-window",
    ]:
        assert words in str(error.value)
    assert (
        TextConfig.from_hf({"model_type": "gemma"})
        == TextConfig.from_hf({})
        == TextConfig()
    )


# ---- positions ----------------------------------------------------------------------


@pytest.mark.parametrize("shift", [1, 5, 100])
def test_positions_shifted_by_a_constant_give_the_same_logits(shift):
    "big_vision counts from 0, transformers from 1: RoPE sees only m - n"
    _, ours = reference_and_ours(tiny(num_key_value_heads=2))
    input_ids = torch.randint(
        3, 512, (2, 7), generator=torch.Generator().manual_seed(8)
    )
    positions = torch.arange(7)[None]
    with torch.no_grad():
        start = ours(input_ids, position_ids=positions).logits
        shifted = ours(input_ids, position_ids=positions + shift).logits
        uneven = positions.clone()
        uneven[0, 4:] += shift  # only some positions moved: a different model input
        moved = ours(input_ids, position_ids=uneven).logits
    # fp32_bound's orders, plus RoPE's angles m f (f <= 1) rounded at positions up to
    # 106: half an ulp of 64..128 rad is 2^-18 = 3.8e-6 rad, on q and on k, a relative
    # change of each score's terms of 2 x 2^-18
    bound = (FP32_RELATIVE + 2 * 2**-18) * start.abs().max().item()
    # an absolute bound (rtol=0), derived above
    torch.testing.assert_close(shifted, start, atol=bound, rtol=0)
    assert (moved - start).abs().max() > 10 * bound


def test_left_padding_counted_or_skipped_in_positions_gives_the_same_logits():
    _, ours = reference_and_ours(tiny())
    input_ids = torch.randint(
        3, 512, (2, 7), generator=torch.Generator().manual_seed(9)
    )
    left_padded = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    counting = torch.arange(7)[None].expand(2, 7)
    skipping = (left_padded.cumsum(-1) - 1).clamp(min=0)
    real = left_padded.bool()
    with torch.no_grad():
        a = ours(input_ids, attention_mask=left_padded, position_ids=counting).logits
        b = ours(input_ids, attention_mask=left_padded, position_ids=skipping).logits
    # RoPE depends only on m - n: the two differ by fp32_bound's orders, and by the
    # angles rounded at positions <= 6 (half an ulp of 4..8 rad: 2^-22 rad, far below)
    bound = fp32_bound(b[real])
    # an absolute bound (rtol=0), derived above
    torch.testing.assert_close(a[real], b[real], atol=bound, rtol=0)


def test_from_hf_and_to_hf_are_methods_of_text_config_not_module_exports():
    import paligemma_lib.config as config_module

    assert isinstance(TextConfig.__dict__["from_hf"], classmethod)
    assert TextConfig.from_hf(TextConfig().to_hf()) == TextConfig()
    assert "from_hf" not in config_module.__all__
    assert "to_hf" not in config_module.__all__


def test_rope_frequencies_are_made_once_per_device_and_survive_casts_and_autograd():
    "Kept in a plain dict, not a buffer: no checkpoint key, no bf16 rounding by .to()"
    rope = GemmaRotaryEmbedding(64)
    positions = torch.tensor([[0, 7, 4095]])
    with torch.inference_mode():  # as in generate: made there first
        first = rope(positions)
    made = rope.inv_freq[torch.device("cpu")]
    assert torch.equal(made, rope_inv_freq(64)) and made.dtype == torch.float32
    assert rope(positions)[0].data_ptr() != first[0].data_ptr()  # a new result ...
    assert rope.inv_freq[torch.device("cpu")] is made  # ... from the same frequencies
    assert not rope.state_dict() and not list(rope.buffers())
    rope.to(torch.bfloat16)  # casts buffers: there are none, the float32 dict stays
    assert rope.inv_freq[torch.device("cpu")].dtype == torch.float32
    # outside inference mode, a training step uses them in autograd
    q = torch.randn(1, 2, 3, 64, requires_grad=True)
    cos, sin = rope(positions)
    (q * cos + q * sin).sum().backward()
    assert q.grad is not None
    # a model built on the meta device keeps that device's apart
    meta = rope(positions.to("meta"))
    assert meta[0].device.type == "meta" and len(rope.inv_freq) == 2


def test_import_makes_the_first_cos_and_sin_on_one_thread():
    """The first cos and sin of a process come from importing the model (its
    `gemma` module), on a tensor under torch's grain size (32,768 elements: one
    thread), so that no later call is a first call split across threads
    (chapter 4: such a call, seen in CI under load, returned cos wrong)"""
    spy = (
        "import torch\n"
        "calls = []\n"
        "for name in ('cos', 'sin'):\n"
        "    def spy(self, _f=getattr(torch.Tensor, name), _n=name):\n"
        "        calls.append((_n, self.numel()))\n"
        "        return _f(self)\n"
        "    setattr(torch.Tensor, name, spy)\n"
        "import paligemma_lib.paligemma\n"
        "print(calls)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", spy], capture_output=True, text=True, check=True
    )
    calls = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert [name for name, _ in calls[:2]] == ["cos", "sin"], calls
    assert all(n < 32_768 for _, n in calls[:2]), calls
