"""Helpers shared by tests and benchmarks: transformers' PaliGemma as the reference.

Hand-written test tooling; the library never imports transformers (chapter 9 writes
the real loader)."""

import torch

from paligemma_lib.config import PaliGemmaConfig
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration

# transformers 5 spells the keys of a model in memory like this; ours follow the Hub
# checkpoints.
OURS_TO_TRANSFORMERS = {
    "vision_tower.vision_model.": "model.vision_tower.",
    "multi_modal_projector.": "model.multi_modal_projector.",
    "language_model.model.": "model.language_model.",
    "language_model.lm_head.": "lm_head.",
}
# ... and like this in the files its save_pretrained writes (without the tied lm_head).
OURS_TO_SAVED = {
    "vision_tower.vision_model.": "vision_tower.",
    "multi_modal_projector.": "multi_modal_projector.",
    "language_model.model.": "language_model.model.",
    "language_model.lm_head.": "language_model.lm_head.",
}


def transformers_name(name: str, spelling: dict = OURS_TO_TRANSFORMERS) -> str:
    "Our parameter name -> transformers 5's, in memory (default) or in a saved file"
    prefix = next(p for p in spelling if name.startswith(p))
    return spelling[prefix] + name[len(prefix) :]


def ours_from_transformers_state(
    config: PaliGemmaConfig, state: dict, dtype=torch.float32
):
    "Our model with the tensors of transformers: a model's state_dict() or a saved file"
    ours = PaliGemmaForConditionalGeneration(config).to(dtype).eval()
    saved = "model.language_model.embed_tokens.weight" not in state
    spelling = OURS_TO_SAVED if saved else OURS_TO_TRANSFORMERS
    names = {name: transformers_name(name, spelling) for name in ours.state_dict()}
    # tied to the embedding: absent from saved files
    head = names.pop("language_model.lm_head.weight")
    missing = sorted(n for n in names.values() if n not in state)
    assert not missing, f"the transformers state has no {missing[:3]}"
    left = sorted(set(state) - set(names.values()) - {head})
    assert not left, f"transformers has tensors we did not copy: {left[:3]}"
    ours.load_state_dict(
        {name: state[theirs] for name, theirs in names.items()}, strict=False
    )
    assert (
        ours.language_model.lm_head.weight
        is ours.language_model.model.embed_tokens.weight
    )
    return ours


def sharpen(model, factor: float = 6.0):
    """Scale every weight matrix but the embedding table by `factor`.

    The layers then outweigh the (tied) embedding, so random models do not just repeat
    their input token, and logits have clear maxima for exact comparisons."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed_tokens" not in name:
                p.mul_(factor)
    return model


def transformers_pair(config: PaliGemmaConfig, seed: int = 0, factor: float = 6.0):
    "A random (sharpened) transformers PaliGemma and ours with the same weights"
    import transformers

    torch.manual_seed(seed)
    theirs = transformers.PaliGemmaForConditionalGeneration(
        transformers.PaliGemmaConfig(**config.to_hf())
    ).eval()
    sharpen(theirs, factor)
    return ours_from_transformers_state(config, theirs.state_dict()), theirs
