"""Chapter 9: `python -m paligemma_lib generate` on a checkpoint folder; bad input gives
one line and exit status 1."""

import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image

import paligemma_lib
from paligemma_lib.__main__ import main
from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig
from paligemma_lib.generation import answer
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.processing import (
    GemmaTokenizer,
    PaliGemmaProcessor,
    default_tokenizer_path,
    load_image,
)
from paligemma_lib.weights import load_pretrained, save_pretrained


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A complete random checkpoint folder (weights, config, tokenizer, image settings)
    and an image file"""
    root = tmp_path_factory.mktemp("cli")
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
            hidden_size=32,
            intermediate_size=64,
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
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed_tokens" not in name:
                p.mul_(6.0)  # random but varied answers
    save_pretrained(model, root / "model")
    PaliGemmaProcessor(
        tokenizer, image_size=28, num_image_tokens=config.num_image_tokens
    ).save_pretrained(root / "model")
    Image.new("RGB", (64, 48), "teal").save(root / "image.png")
    (root / "not-an-image.png").write_text("hello")
    return root


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "paligemma_lib", *map(str, args)],
        capture_output=True,
        text=True,
    )


def test_generate_prints_the_answer(checkpoint):
    run = cli(
        "generate",
        "--model",
        checkpoint / "model",
        "--image",
        checkpoint / "image.png",
        "--prompt",
        "caption en",
        "--max-new-tokens",
        "5",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and "Traceback" not in run.stderr
    model = load_pretrained(checkpoint / "model", dtype="fp32", device="cpu")
    processor = PaliGemmaProcessor.from_pretrained(checkpoint / "model")
    expected = answer(
        model,
        processor,
        load_image(checkpoint / "image.png"),
        "caption en",
        max_new_tokens=5,
    )
    assert (
        run.stdout == expected + "\n"
    )  # the CLI prints what the library answers, and nothing else


def test_detect_draws_and_sampling_is_seeded(checkpoint, tmp_path, capsys):
    out = tmp_path / "boxes.png"
    args = [
        "generate",
        "--model",
        str(checkpoint / "model"),
        "--image",
        str(checkpoint / "image.png"),
        "--prompt",
        "detect cat",
        "--max-new-tokens",
        "6",
        "--draw",
        str(out),
    ]
    assert main(args) == 0
    assert "boxes drawn on" in capsys.readouterr().out
    with Image.open(out) as drawn:
        assert drawn.format == "PNG" and drawn.size == (64, 48)
        drawn.verify()  # a complete, valid PNG
    sampled = args[:5] + [
        "--prompt",
        "caption en",
        "--do-sample",
        "--temperature",
        "1.5",
        "--top-k",
        "50",
        "--top-p",
        "0.9",
        "--seed",
        "3",
    ]
    texts = []
    for _ in range(2):
        assert main(sampled) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing_image", "no image at .*missing.png"),
        ("unreadable_image", "not-an-image.png is not an image file"),
        ("not_a_checkpoint", "is not a PaliGemma checkpoint: it has no config.json"),
        ("missing_model", "no checkpoint folder at .*absent"),
        ("draw_without_detect", "--draw saves the boxes of a 'detect ...' prompt"),
        (
            "truncated",
            r"model\.safetensors is truncated: its header promises \d+ bytes, "
            r"the file has \d+; is the download",
        ),
        ("no_tokenizer", "has no tokenizer.model"),
        ("sampling_without_do_sample", "add --do-sample to sample"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_status(
    checkpoint, tmp_path, case, expected
):
    model, image, extra = checkpoint / "model", checkpoint / "image.png", []
    if case in ("truncated", "no_tokenizer"):
        model = tmp_path / "model"
        shutil.copytree(checkpoint / "model", model)
        if (
            case == "truncated"
        ):  # a download cut short: safetensors' own error would be a traceback
            data = (model / "model.safetensors").read_bytes()
            (model / "model.safetensors").write_bytes(data[: len(data) // 2])
        else:
            (model / "tokenizer.model").unlink()
    elif case == "sampling_without_do_sample":
        extra = ["--temperature", "0.5"]
    elif case == "missing_image":
        image = checkpoint / "missing.png"
    elif case == "unreadable_image":
        image = checkpoint / "not-an-image.png"
    elif case == "not_a_checkpoint":
        model = checkpoint
    elif case == "missing_model":
        model = checkpoint / "absent"
    else:
        extra = ["--draw", checkpoint / "out.png"]
    run = cli(
        "generate", "--model", model, "--image", image, "--prompt", "caption en", *extra
    )
    assert run.returncode == 1 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("error: ")
        and "Traceback" not in run.stderr
    )
    assert re.search(expected, lines[0]), lines[0]


def test_a_folder_without_tokenizer_fails_before_the_weights_load(
    checkpoint, tmp_path, monkeypatch, capsys
):
    import paligemma_lib.__main__ as cli_module

    monkeypatch.setattr(
        cli_module,
        "load_pretrained",
        lambda *a, **kw: pytest.fail("the weights were loaded first"),
    )
    shutil.copytree(checkpoint / "model", tmp_path / "model")
    (tmp_path / "model" / "tokenizer.model").unlink()
    args = [
        "generate",
        "--model",
        str(tmp_path / "model"),
        "--image",
        str(checkpoint / "image.png"),
        "--prompt",
        "caption en",
    ]
    assert main(args) == 1
    assert "has no tokenizer.model" in capsys.readouterr().err


# Bad input, flag by flag (issue 16): one `error:` line, exit status 1, no
# traceback; Ctrl-C: exit status 130.


def one_error_line(run, *words):
    "Exit status 1, a single `error:` line on stderr naming `words`, no traceback"
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def generate(checkpoint, *extra, image=None, prompt="caption en"):
    image = image or checkpoint / "image.png"
    model = checkpoint / "model"
    return cli(
        "generate", "--model", model, "--image", image, "--prompt", prompt, *extra
    )


def test_version():
    run = cli("--version")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"paligemma_lib {paligemma_lib.__version__}"
    assert paligemma_lib.__version__ != "0+unknown"  # read from the installed metadata


def test_seed_without_do_sample(checkpoint):
    one_error_line(generate(checkpoint, "--seed", "3"), "--seed", "--do-sample")


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_temperature_must_be_positive_and_finite(checkpoint, value):
    run = generate(checkpoint, "--do-sample", "--temperature", value)
    one_error_line(run, "--temperature")


def test_max_new_tokens_must_be_positive(checkpoint):
    one_error_line(generate(checkpoint, "--max-new-tokens", "0"), "--max-new-tokens")


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_devices_that_cannot_run_the_model(checkpoint, device):
    one_error_line(generate(checkpoint, "--device", device), f"--device {device}")


def detect(checkpoint, draw, image=None):
    return generate(checkpoint, "--draw", draw, image=image, prompt="detect cat")


def test_draw_to_a_folder_that_does_not_exist(checkpoint):
    out = checkpoint / "no-such-folder" / "boxes.png"
    one_error_line(detect(checkpoint, out), "cannot be written")


def test_draw_to_a_file_name_that_is_no_image_format(checkpoint, tmp_path):
    one_error_line(detect(checkpoint, tmp_path / "boxes.txt"), ".txt", ".png")


def test_draw_over_the_input_image_is_refused(checkpoint, tmp_path):
    image = tmp_path / "photo.png"
    image.write_bytes((checkpoint / "image.png").read_bytes())
    before = image.read_bytes()
    one_error_line(detect(checkpoint, image, image=image), "input image")
    assert image.read_bytes() == before


@pytest.mark.parametrize("phase, delay", [("importing", 0.4), ("generating", 4.0)])
def test_ctrl_c_exits_130_without_a_traceback(checkpoint, phase, delay):
    """SIGINT while the command imports torch, and later while it generates 3000 tokens
    (about 4 s of decoding after 3 s of start-up on two cores)"""
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paligemma_lib",
            "generate",
            "--model",
            checkpoint / "model",
            "--image",
            checkpoint / "image.png",
            "--prompt",
            "caption en",
            "--max-new-tokens",
            "3000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(delay)
    assert child.poll() is None, f"the command ended before Ctrl-C ({phase})"
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 130, (phase, child.returncode, err)
    assert "Traceback" not in err and err.strip() == "error: interrupted", err
    assert out == "", "an interrupted run prints no answer"
