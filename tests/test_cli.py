"""Chapter 9: `python -m paligemma_lib generate` on a checkpoint folder; bad input gives one line and exit status 1."""
import re
import subprocess
import sys

import pytest
import torch
from PIL import Image

from paligemma_lib.__main__ import main
from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.processing import GemmaTokenizer, PaliGemmaProcessor, default_tokenizer_path
from paligemma_lib.weights import save_pretrained


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    "A complete random checkpoint folder (weights, config, tokenizer, image settings) and an image file"
    root = tmp_path_factory.mktemp("cli")
    tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
    config = PaliGemmaConfig(
        vision=VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            image_size=28, patch_size=14),
        text=TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=8),
        image_token_index=tokenizer.image_token_id, projection_dim=32)
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed_tokens" not in name:
                p.mul_(6.0)  # random but varied answers
    save_pretrained(model, root / "model")
    PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=config.num_image_tokens).save_pretrained(root / "model")
    Image.new("RGB", (64, 48), "teal").save(root / "image.png")
    (root / "not-an-image.png").write_text("hello")
    return root


def cli(*args):
    return subprocess.run([sys.executable, "-m", "paligemma_lib", *map(str, args)], capture_output=True, text=True)


def test_generate_prints_the_answer(checkpoint):
    run = cli("generate", "--model", checkpoint / "model", "--image", checkpoint / "image.png", "--prompt", "caption en",
              "--max-new-tokens", "5", "--dtype", "fp32", "--device", "cpu")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and "Traceback" not in run.stderr


def test_detect_draws_and_sampling_is_seeded(checkpoint, tmp_path, capsys):
    out = tmp_path / "boxes.png"
    args = ["generate", "--model", str(checkpoint / "model"), "--image", str(checkpoint / "image.png"),
            "--prompt", "detect cat", "--max-new-tokens", "6", "--draw", str(out)]
    assert main(args) == 0
    assert "boxes drawn on" in capsys.readouterr().out and Image.open(out).size == (64, 48)
    sampled = args[:5] + ["--prompt", "caption en", "--do-sample", "--temperature", "1.5", "--top-k", "50",
                          "--top-p", "0.9", "--seed", "3"]
    texts = []
    for _ in range(2):
        assert main(sampled) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]


@pytest.mark.parametrize("case, expected", [
    ("missing_image", "no image at .*missing.png"),
    ("unreadable_image", "not-an-image.png is not an image file"),
    ("not_a_checkpoint", "is not a PaliGemma checkpoint: it has no config.json"),
    ("missing_model", "no checkpoint folder at .*absent"),
    ("draw_without_detect", "--draw saves the boxes of a 'detect ...' prompt"),
])
def test_bad_input_is_one_line_and_a_nonzero_status(checkpoint, case, expected):
    model, image, extra = checkpoint / "model", checkpoint / "image.png", []
    if case == "missing_image":
        image = checkpoint / "missing.png"
    elif case == "unreadable_image":
        image = checkpoint / "not-an-image.png"
    elif case == "not_a_checkpoint":
        model = checkpoint
    elif case == "missing_model":
        model = checkpoint / "absent"
    else:
        extra = ["--draw", checkpoint / "out.png"]
    run = cli("generate", "--model", model, "--image", image, "--prompt", "caption en", *extra)
    assert run.returncode == 1 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in run.stderr
    assert re.search(expected, lines[0]), lines[0]
