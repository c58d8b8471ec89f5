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
