"""The SigLIP vision tower (chapters 2 and 3) against transformers'
SiglipVisionModel and PyTorch's kernels."""

import pytest
import torch
import torch.nn.functional as F
from transformers import SiglipVisionConfig
from transformers import SiglipVisionModel as ReferenceSiglipVisionModel

from paligemma_lib.config import VisionConfig
from paligemma_lib.siglip import (
    SiglipAttention,
    SiglipVisionModel,
    SiglipVisionOutput,
    explicit_attention,
)

CONFIGS = {
    "48-wide-16-patches": VisionConfig(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=56,
        patch_size=14,
    ),
    "40-wide-9-patches": VisionConfig(
        hidden_size=40,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=42,
        patch_size=14,
    ),
    "72-wide-25-patches": VisionConfig(
        hidden_size=72,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=6,
        image_size=30,
        patch_size=6,
    ),
    "1-channel-3-heads": VisionConfig(
        hidden_size=48,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_channels=1,
        image_size=20,
        patch_size=4,
    ),
}


# float32 parity: ours and transformers' SiglipVisionModel (or our explicit and fused
# attention) do the same arithmetic in other orders. Each rounding is off by at most
# u = 2^-24 relative. The roundings behind one output of CONFIGS: the patch embedding's
# sum of C p^2 <= 588 products; per layer the reductions' terms (two LayerNorms' means
# and variances, 2 x 2 x 72; q/k/v 72; scores d_h <= 16; softmax and the values' sum,
# 25 each; out_proj 72; fc1 72; fc2 96) and ~15 elementwise steps (the tanh GELU, the
# scale, residual sums): under 750; three layers, then the final LayerNorm (2 x 72):
# N < 3,000. Adding them up (the worst case; random signs give ~sqrt(N)), N u = 1.8e-4
# of the values' size: 2e-4 times the largest |output| (the LayerNorms keep it ~4).
FP32_RELATIVE = 2e-4


def fp32_bound(values: torch.Tensor) -> float:
    "The largest float32 difference two orders of the same arithmetic allow"
    return FP32_RELATIVE * values.abs().max().item()


def reference_model(config, attn_implementation="sdpa"):
    hf_config = SiglipVisionConfig(
        **config.to_hf(), vision_use_head=False, attn_implementation=attn_implementation
    )
    return ReferenceSiglipVisionModel(hf_config).eval()


def with_prefix(state_dict, prefix="vision_model."):
    "Add the `vision_model.` level that checkpoints have and transformers 5 drops"
    return {k if k.startswith(prefix) else prefix + k: v for k, v in state_dict.items()}


def pair(config, seed=0, attn_implementation="sdpa"):
    "(ours, theirs) with the same random weights"
    torch.manual_seed(seed)
    theirs = reference_model(config, attn_implementation)
    ours = SiglipVisionModel(config).eval()
    ours.load_state_dict(with_prefix(theirs.state_dict()))  # strict
    return ours, theirs


def pixels(config, batch=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.rand(
            batch,
            config.num_channels,
            config.image_size,
            config.image_size,
            generator=g,
        )
        * 2
        - 1
    )


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_state_dict_keys_and_shapes_match_the_reference(config):
    ours = {
        k: tuple(v.shape) for k, v in SiglipVisionModel(config).state_dict().items()
    }
    theirs = {
        k: tuple(v.shape)
        for k, v in with_prefix(reference_model(config).state_dict()).items()
    }
    assert ours == theirs
    assert "vision_model.embeddings.patch_embedding.weight" in ours
    assert "vision_model.encoder.layers.0.self_attn.q_proj.weight" in ours
    assert "vision_model.post_layernorm.weight" in ours


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_last_hidden_state_equals_transformers_fp32(config):
    ours, theirs = pair(config)
    x = pixels(config)
    with torch.no_grad():
        out = ours(x)
        expected = theirs(x).last_hidden_state
    assert isinstance(out, SiglipVisionOutput) and out.attentions is None
    assert out.last_hidden_state.shape == (
        3,
        config.num_image_tokens,
        config.hidden_size,
    )
    # fp32_bound's derivation: the same float32 arithmetic in other orders
    assert (out.last_hidden_state - expected).abs().max().item() <= fp32_bound(expected)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_attention_weights_equal_transformers_eager_and_fused_path(config):
    ours, theirs = pair(config, attn_implementation="eager")
    x = pixels(config, batch=2)
    with torch.no_grad():
        explicit = ours(x, output_attentions=True)
        fused = ours(x).last_hidden_state
        expected = theirs(x, output_attentions=True)
    assert len(explicit.attentions) == config.num_hidden_layers
    N = config.num_image_tokens
    for weights, their_weights in zip(explicit.attentions, expected.attentions):
        assert weights.shape == (2, config.num_attention_heads, N, N)
        torch.testing.assert_close(
            weights.sum(-1), torch.ones(2, config.num_attention_heads, N)
        )
        torch.testing.assert_close(weights, their_weights)
    # explicit vs SDPA: the same float32 arithmetic in other orders (fp32_bound)
    bound = fp32_bound(fused)
    # an absolute bound (rtol=0), derived above
    torch.testing.assert_close(explicit.last_hidden_state, fused, atol=bound, rtol=0)
    ours_last, their_last = explicit.last_hidden_state, expected.last_hidden_state
    # the same float32 arithmetic, in transformers' kernels (fp32_bound)
    bound = fp32_bound(their_last)
    # an absolute bound (rtol=0), derived above
    torch.testing.assert_close(ours_last, their_last, atol=bound, rtol=0)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_bf16_runs_without_nan_and_stays_close(config):
    ours, _ = pair(config)
    x = pixels(config)
    with torch.no_grad():
        full = ours(x).last_hidden_state
        ours = ours.to(torch.bfloat16)
        low = ours(x).last_hidden_state  # float32 pixels: the embedding casts them
        low_explicit = ours(x, output_attentions=True)
    assert low.dtype == torch.bfloat16
    assert (
        torch.isfinite(low).all()
        and torch.isfinite(low_explicit.last_hidden_state).all()
    )
    assert all(
        torch.isfinite(w).all() and w.dtype == torch.bfloat16
        for w in low_explicit.attentions
    )
    # bfloat16 keeps 8 significant bits: each rounding is off by at most 2^-9
    # relative. Behind one output of CONFIGS: the pixels and the patch weights, the
    # embedding, positions and their sum; per layer 6 weight matrices and ~14
    # rounded activations (norm, q, k, v, scores, probabilities, attention output,
    # out_proj, residual, norm, fc1, GELU, fc2, residual): 20; three layers and the
    # final norm: N ~ 65. Added up (the worst case), N 2^-9 = 0.13 of the size.
    assert (low.float() - full).abs().max() < 0.13 * full.abs().max()


@pytest.mark.parametrize(
    "shape, words",
    [
        ((1, 3, 112, 112), "[1, 3, 112, 112]"),  # wrong spatial size
        ((2, 4, 56, 56), "[2, 4, 56, 56]"),  # wrong channel count
        ((3, 56, 56), "[3, 56, 56]"),  # no batch dimension
        ((1, 3, 56, 42), "[1, 3, 56, 42]"),  # not square
    ],
)
def test_wrong_pixel_shape_names_both_shapes(shape, words):
    model = SiglipVisionModel(CONFIGS["48-wide-16-patches"])
    with pytest.raises(ValueError) as info:
        model(torch.zeros(shape))
    assert words in str(info.value) and "[batch, 3, 56, 56]" in str(info.value)
    # and how to make the right one
    assert "process_images" in str(info.value) and "image_size=56" in str(info.value)


def test_full_config_shapes_and_parameter_count_on_meta():
    with torch.device("meta"):
        ours = SiglipVisionModel(VisionConfig())
        out = ours(torch.empty(2, 3, 224, 224))
        theirs = reference_model(VisionConfig())
    assert out.last_hidden_state.shape == (2, 256, 1152)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == 412_442_352
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in with_prefix(theirs.state_dict()).items()
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_explicit_attention_equals_sdpa(dtype, masked):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 3, 7, 10, generator=g).to(dtype)  # [B, H, N, d_h]
    mask = None
    if masked:
        # additive, finfo.min where not allowed; the last query row is fully masked
        allowed = torch.ones(7, 7, dtype=torch.bool).tril()
        allowed[-1] = False
        mask = torch.zeros(1, 1, 7, 7, dtype=dtype).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
    out, weights = explicit_attention(q, k, v, attn_mask=mask, scale=0.4)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.4)
    tol = {}  # float32: assert_close's default for float32
    if dtype == torch.bfloat16:
        q32, k32, v32 = q.float(), k.float(), v.float()
        s_max = ((q32 @ k32.transpose(-2, -1)) * 0.4).abs().max()  # without the mask
        u = 2.0**-8
        # u = 2^-8 (bf16 keeps 8 significant bits). Errors D_j in the scores move the
        # output by sum_j p_j (D_j - mean_p D) v_j: at most max|D| max|v|. We round the
        # scores twice (q k^T, times the scale), a fused kernel up to three times (q
        # and k scaled, their product): max|D| <= 5 u max|s|. Each side also rounds the
        # probabilities (u sum_j p_j |v_j| <= u max|v|) and the output (u max|v|).
        # rtol=0: that bound is absolute, and whole
        tol = dict(atol=(u * v32.abs().max() * (5 * s_max + 4)).item(), rtol=0)
        # the bound still catches a wrong scale (0.4^2, as 1/d for 1/sqrt(d))
        slip = explicit_attention(q, k, v, attn_mask=mask, scale=0.4**2)[0]
        assert (slip - expected).abs().max() > tol["atol"]
    torch.testing.assert_close(out, expected, **tol)
    assert (
        weights.shape == (2, 3, 7, 7)
        and weights.dtype == dtype
        and not weights.isnan().any()
    )


def test_explicit_attention_refuses_a_boolean_mask():
    # [B, H, N, d_h]
    q, k, v = torch.randn(3, 1, 2, 4, 8, generator=torch.Generator().manual_seed(0))
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()
    additive = torch.zeros(4, 4).masked_fill(~allowed, torch.finfo(torch.float32).min)
    # SDPA reads True as "may attend", which is the additive mask's meaning, not "+1"
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
        explicit_attention(q, k, v, attn_mask=additive)[0],
    )
    with pytest.raises(ValueError, match="additive"):
        explicit_attention(q, k, v, attn_mask=allowed)


def test_attention_module_paths_agree_and_dropout_only_in_training():
    config = VisionConfig(
        hidden_size=40, num_attention_heads=4, image_size=42, attention_dropout=0.5
    )
    torch.manual_seed(0)
    attention = SiglipAttention(config).eval()
    x = torch.randn(2, 9, 40)
    fused, none = attention(x)
    explicit, weights = attention(x, output_attentions=True)
    assert none is None and weights.shape == (2, 4, 9, 9)
    torch.testing.assert_close(fused, explicit)
    attention.train()
    # dropout on the weights while training
    assert not torch.allclose(attention(x)[0], fused)
