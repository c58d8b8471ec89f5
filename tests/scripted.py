"""A tiny PaliGemma whose LoRA adapter makes it write one known answer, for the tests
of what users do with an answer (`generate --draw`, the demo) where a random model
would answer anything.

How: every attention output projection is zero, so each position sees only its own
token. The tokens of the answer, and the prompt's last token "\n" before them, get
embeddings along their own axis (plus one shared axis); the adapter, a LoRA update of
the first layer's MLP output, maps the axis of each token to the axis of the next one,
so that the tied LM head reads off the next token: "\n" -> first answer token -> ...
-> <eos>. Without the adapter each token predicts itself, so the base model repeats
"\n" and holds no answer. The checkpoint is saved with save_pretrained (the layout of
the Hugging Face files, as for real PaliGemma), the adapter with save_adapter (PEFT's
layout)."""

from pathlib import Path

import numpy as np
import torch

from paligemma_lib.adapters import save_adapter
from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig
from paligemma_lib.lora import LoraConfig, add_lora, lora_modules
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.processing import PaliGemmaProcessor
from paligemma_lib.segmentation import MaskVAE, load_mask_vae
from paligemma_lib.tokenization import GemmaTokenizer, default_tokenizer_path
from paligemma_lib.weights import save_pretrained

WIDTH = 32  # hidden size, and the MLP's: one axis per token of the chain
# y0, x0, y1, x1 in bins (all different: each token has one successor), 16 codes
LOCS = (300, 100, 900, 700)
CODES = tuple(range(16))
ANSWER = (
    "".join(f"<loc{b:04d}>" for b in LOCS)
    + "".join(f"<seg{c:03d}>" for c in CODES)
    + " circle"
)


def _chain(tokenizer) -> list[int]:
    "The token ids: the prompt's last one, the answer's, <eos>"
    newline = tokenizer.encode("\n")[-1]
    pieces = [f"<loc{b:04d}>" for b in LOCS] + [f"<seg{c:03d}>" for c in CODES]
    ids = [tokenizer.piece_to_id(p) for p in pieces + ["▁circle"]]
    chain = [newline, *ids, tokenizer.eos_id]
    assert len(set(chain)) == len(chain) < WIDTH  # one axis each, one shared
    return chain


def scripted_checkpoint(folder) -> tuple[Path, Path]:
    """A tiny checkpoint in `folder`/model and its adapter in `folder`/adapter;
    with the adapter, the model answers ANSWER to any prompt"""
    folder = Path(folder)
    tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
    config = PaliGemmaConfig(
        vision=VisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            image_size=28,
            patch_size=14,
        ),
        text=TextConfig(
            vocab_size=len(tokenizer),
            hidden_size=WIDTH,
            intermediate_size=WIDTH,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
        ),
        image_token_index=tokenizer.image_token_id,
        projection_dim=32,
    )
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config)
    text = model.language_model.model
    chain = _chain(tokenizer)
    shared = WIDTH - 1  # the axis every token of the chain has
    with torch.no_grad():
        text.embed_tokens.weight.normal_(0, 0.02)
        for axis, token in enumerate(chain):
            row = text.embed_tokens.weight[token]
            row.zero_()
            row[axis] = row[shared] = 1.0
        for layer in text.layers:
            layer.self_attn.o_proj.weight.zero_()  # no position sees another
            layer.mlp.down_proj.weight.zero_()
        mlp = text.layers[0].mlp
        # after the norm a chain token is 4 on its axis and on the shared one:
        # every unit's gate reads the shared axis (GELU(4) ~ 4), up reads its
        # own axis, so unit k holds ~16 for token k of the chain, ~0 elsewhere
        mlp.gate_proj.weight.zero_()
        mlp.gate_proj.weight[:, shared] = 1.0
        mlp.up_proj.weight.copy_(torch.eye(WIDTH))
    save_pretrained(model, folder / "model")
    PaliGemmaProcessor(
        tokenizer, image_size=28, num_image_tokens=config.num_image_tokens
    ).save_pretrained(folder / "model")
    # the adapter: down_proj += B A with A = I and B sending unit k to axis k + 1
    add_lora(model, LoraConfig(r=WIDTH, alpha=WIDTH, target_modules=["down_proj"]))
    lora = lora_modules(model)["language_model.model.layers.0.mlp.down_proj"]
    with torch.no_grad():
        lora.lora_A.weight.copy_(torch.eye(WIDTH))
        lora.lora_B.weight.zero_()
        for axis in range(len(chain) - 1):
            lora.lora_B.weight[axis + 1, axis] = 10.0  # 160 vs a residual of 8
    save_adapter(model, folder / "adapter")
    return folder / "model", folder / "adapter"


def random_vae_file(path) -> Path:
    """A VAE file in vae-oid.npz's layout, random weights scaled as PyTorch's own
    initialisation, the last bias moved so that the mask of CODES is part inside,
    part outside (a random decoder tends to put every value on one side of 0)"""
    rng = np.random.default_rng(0)
    arrays = {}
    for key, tensor in MaskVAE().state_dict().items():
        shape = tuple(tensor.shape)
        fan_in = np.prod(shape[1:]) if len(shape) > 1 else shape[0]
        bound = 1 / np.sqrt(fan_in)
        arrays[key] = rng.uniform(-bound, bound, shape).astype(np.float32)
    arrays["_vq_vae._embedding"] = rng.normal(size=(128, 512)).astype(np.float32)
    np.savez(path, **arrays)
    with torch.no_grad():
        mask64 = load_mask_vae(path).decode(torch.tensor([CODES]))[0]
    arrays["decoder.12.bias"] -= mask64.median().numpy()
    np.savez(path, **arrays)
    return Path(path)
