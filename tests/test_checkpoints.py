"""PaliGemma 1 at 224, 448 and 896 pixels: our model has the checkpoints' names and
shapes, built on the `meta` device (no memory), for each resolution the README lists."""

import pytest
import torch
import transformers
from test_weights import hub_layout, our_name

from paligemma_lib.config import PaliGemmaConfig
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration


def hub_config(image_size: int) -> dict:
    """A transcription of config.json of google/paligemma-3b-pt-{image_size} on the
    Hugging Face Hub (the keys that matter here); only the image size and the image
    token counts differ between the three resolutions."""
    n = (image_size // 14) ** 2
    return {
        "model_type": "paligemma",
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "hidden_size": 2048,
        "image_token_index": 257152,
        "projection_dim": 2048,
        "text_config": {
            "model_type": "gemma",
            "hidden_size": 2048,
            "intermediate_size": 16384,
            "num_attention_heads": 8,
            "num_hidden_layers": 18,
            "num_image_tokens": n,
            "num_key_value_heads": 1,
            "vocab_size": 257216,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 1152,
            "image_size": image_size,
            "intermediate_size": 4304,
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "num_image_tokens": n,
            "patch_size": 14,
            "projection_dim": 2048,
            "projector_hidden_act": "gelu_fast",
            "vision_use_head": False,
        },
    }


PARAMETERS_224 = 2_923_466_480  # chapter 9 derives this count


@pytest.mark.parametrize("image_size", [224, 448, 896])
def test_paligemma_1_resolutions_on_meta(image_size):
    hf = hub_config(image_size)
    config = PaliGemmaConfig.from_hf(hf)
    n = (image_size // 14) ** 2  # 256, 1024, 4096 patches
    assert config.num_image_tokens == n
    assert config.vision.image_size == image_size
    with torch.device("meta"):
        ours = PaliGemmaForConditionalGeneration(config)
        theirs = transformers.PaliGemmaForConditionalGeneration(
            transformers.PaliGemmaConfig(**hf)
        )
    ours_shapes = {name: tuple(p.shape) for name, p in ours.named_parameters()}
    assert ours_shapes == hub_layout(config)
    translated = {our_name(k): tuple(v.shape) for k, v in theirs.state_dict().items()}
    translated.pop("language_model.lm_head.weight")  # tied: one tensor in ours
    assert translated == ours_shapes
    # Only the position table grows with the resolution: one 1152-wide row per patch
    position = "vision_tower.vision_model.embeddings.position_embedding.weight"
    assert ours_shapes[position] == (n, 1152)
    count = sum(p.numel() for p in ours.parameters())
    assert count == PARAMETERS_224 + (n - 256) * 1152
    assert count == sum(p.numel() for p in theirs.parameters())


# PaliGemma 2 (google/paligemma2-{3b,10b,28b}-{pt,mix}-{224,448,896}; the mix
# checkpoints share the pt configs): the Gemma 2 decoders' sizes are big_vision's
# (google-research/big_vision, big_vision/models/ppp/gemma.py, get_config "gemma2_2b",
# "gemma2_9b", "gemma2_27b"); its 27B scales queries by (width / heads) ** -0.5
# ("rsqrt_emb_per_head"), config.json's query_pre_attn_scalar 144; the others by
# head_dim ** -0.5 (256). Caps 50 and 30, window 4096: big_vision's caps and
# transformers' Gemma2Config defaults. The SigLIP tower is PaliGemma 1's.
GEMMA2_SIZES = {
    # name: (width, depth, mlp_dim, heads, kv_heads, head_dim, query_pre_attn_scalar)
    "3b": (2304, 26, 9216, 8, 4, 256, 256),
    "10b": (3584, 42, 14336, 16, 8, 256, 256),
    "28b": (4608, 46, 36864, 32, 16, 128, 144),
}


def hub_config_2(size: str, image_size: int) -> dict:
    "config.json of google/paligemma2-{size}-pt-{image_size}, the keys that matter here"
    D, L, F, H, K, d_h, scalar = GEMMA2_SIZES[size]
    hf = hub_config(image_size)
    hf["projection_dim"] = hf["vision_config"]["projection_dim"] = D
    hf["hidden_size"] = D
    hf["text_config"] = {
        **hf["text_config"],
        "model_type": "gemma2",
        "hidden_size": D,
        "num_hidden_layers": L,
        "intermediate_size": F,
        "num_attention_heads": H,
        "num_key_value_heads": K,
        "head_dim": d_h,
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    return hf


def gemma2_parameters(size: str) -> int:
    "The decoder's parameter count, by hand: embedding, final norm, L layers"
    D, L, F, H, K, d_h, _ = GEMMA2_SIZES[size]
    attention = D * H * d_h * 2 + D * K * d_h * 2  # q, o; k, v
    mlp = 3 * D * F  # gate, up, down
    norms = 4 * D  # Gemma 2: four RMSNorms per layer
    return 257216 * D + D + L * (attention + mlp + norms)


# PaliGemma 1's vision tower at 224: its total less its Gemma decoder and projector
SIGLIP_224 = (
    PARAMETERS_224
    - (
        257216 * 2048
        + 2048
        + 18 * (2048 * 8 * 256 * 2 + 2048 * 256 * 2 + 3 * 2048 * 16384)
    )
    - 18 * 2 * 2048
    - (1152 * 2048 + 2048)
)


@pytest.mark.parametrize("image_size", [224, 448, 896])
@pytest.mark.parametrize("size", GEMMA2_SIZES)
def test_paligemma_2_sizes_and_resolutions_on_meta(size, image_size):
    hf = hub_config_2(size, image_size)
    config = PaliGemmaConfig.from_hf(hf)
    D, L, F, H, K, d_h, scalar = GEMMA2_SIZES[size]
    n = (image_size // 14) ** 2
    assert config.num_image_tokens == n
    assert config.text.post_norms and config.text.attention_scale == scalar**-0.5
    assert [config.text.is_sliding(i) for i in range(L)] == [
        i % 2 == 0 for i in range(L)
    ]
    with torch.device("meta"):
        ours = PaliGemmaForConditionalGeneration(config)
        theirs = transformers.PaliGemmaForConditionalGeneration(
            transformers.PaliGemmaConfig(**hf)
        )
    ours_shapes = {name: tuple(p.shape) for name, p in ours.named_parameters()}
    expected = hub_layout(config)  # PaliGemma 1's names, Gemma 2's sizes
    for i in range(L):
        for norm in ["pre_feedforward_layernorm", "post_feedforward_layernorm"]:
            expected[f"language_model.model.layers.{i}.{norm}.weight"] = (D,)
    assert ours_shapes == expected
    translated = {our_name(k): tuple(v.shape) for k, v in theirs.state_dict().items()}
    translated.pop("language_model.lm_head.weight")  # tied: one tensor in ours
    assert translated == ours_shapes
    count = sum(p.numel() for p in ours.parameters())
    projector = 1152 * D + D
    assert count == SIGLIP_224 + (n - 256) * 1152 + projector + gemma2_parameters(size)
    assert count == sum(p.numel() for p in theirs.parameters())
    # the names' sizes: 3, 10 and 28 billion
    assert round(count / 1e9) == int(size[:-1])
