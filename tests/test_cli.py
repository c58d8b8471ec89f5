"""Chapter 9: `python -m paligemma_lib generate` on a checkpoint folder; bad input gives
one line and exit status 1."""

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

import paligemma_lib
from paligemma_lib.__main__ import main
from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig
from paligemma_lib.generation import answer
from paligemma_lib.image_processing import load_image
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.processing import PaliGemmaProcessor
from paligemma_lib.stopping import NonFiniteLogitsError
from paligemma_lib.tokenization import GemmaTokenizer, default_tokenizer_path
from paligemma_lib.weights import (
    INDEX_FILE,
    load_pretrained,
    read_safetensors_header,
    save_pretrained,
)


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
    import paligemma_lib.cli.generate as cli_module

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


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_do_not_import_torch(flag):
    "Nothing slow before a command needs it: --help and --version load no torch"
    show = "import sys, runpy; runpy.run_module('paligemma_lib', run_name='__main__')"
    check = (
        "import atexit, sys; atexit.register(lambda: print("
        "'torch' in sys.modules, [m for m in ('gradio', 'PIL') if m in sys.modules]"
        ", file=sys.stderr)); sys.argv = ['paligemma_lib', '" + flag + "']; " + show
    )
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout, run.stderr
    assert run.stderr.strip() == "False []", run.stderr


def test_the_top_level_help_lines_are_the_commands_own():
    "--help builds stand-ins for the commands: their lines are the commands' own"
    from paligemma_lib.cli.main import COMMANDS, build_parser

    assert build_parser(None).format_help() == build_parser().format_help()
    for name in COMMANDS:  # and a command's own parser, with the others' stand-ins
        assert build_parser(name).format_help() == build_parser().format_help()


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


# The command run as `python -m paligemma_lib`, but saying on stderr when it starts
# answering, so that the test signals it mid-generation on any machine, however fast
ANNOUNCING = """
import runpy, sys
import paligemma_lib.generation as generation
real_answer = generation.answer
def answer(*args, **kwargs):
    print("answering", file=sys.stderr, flush=True)
    return real_answer(*args, **kwargs)
generation.answer = answer
sys.argv = ["paligemma_lib", *sys.argv[1:]]
runpy.run_module("paligemma_lib", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("phase", ["importing", "generating"])
def test_ctrl_c_exits_130_without_a_traceback(checkpoint, phase):
    """SIGINT while the command imports torch (0.4 s in; the imports take
    seconds), and later while it generates 3000 tokens (sent when it says it
    starts answering)"""
    args = ["generate", "--model", checkpoint / "model"]
    args += ["--image", checkpoint / "image.png", "--prompt", "caption en"]
    args += ["--max-new-tokens", "3000"]
    if phase == "importing":
        command = [sys.executable, "-m", "paligemma_lib", *args]
    else:
        command = [sys.executable, "-c", ANNOUNCING, *args]
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if phase == "importing":
        time.sleep(0.4)
    else:
        assert child.stderr.readline() == "answering\n"
    assert child.poll() is None, f"the command ended before Ctrl-C ({phase})"
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 130, (phase, child.returncode, err)
    assert "Traceback" not in err and err.strip() == "error: interrupted", err
    assert out == "", "an interrupted run prints no answer"


class Run(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def run_main(capsys, checkpoint, *extra, model=None, image=None, prompt="caption en"):
    """The command in this process (main(), as `python -m paligemma_lib` runs it):
    quicker than a child process, and an uncaught exception fails the test"""
    args = ["generate", "--model", model or checkpoint / "model"]
    args += ["--image", image or checkpoint / "image.png", "--prompt", prompt]
    code = main([str(a) for a in [*args, *extra]])
    out = capsys.readouterr()
    return Run(code, out.out, out.err)


def model_copy(checkpoint, tmp_path) -> Path:
    shutil.copytree(checkpoint / "model", tmp_path / "model")
    return tmp_path / "model"


def claim_size(png: bytes, width: int, height: int) -> bytes:
    "A PNG whose header claims another size (IHDR rewritten, CRC recomputed)"
    ihdr = png.index(b"IHDR")
    body = b"IHDR" + struct.pack(">II", width, height) + png[ihdr + 12 : ihdr + 17]
    return png[:ihdr] + body + struct.pack(">I", zlib.crc32(body)) + png[ihdr + 21 :]


def test_an_image_over_the_decompression_bomb_limit(checkpoint, tmp_path):
    huge = tmp_path / "huge.png"
    huge.write_bytes(claim_size((checkpoint / "image.png").read_bytes(), 15000, 15000))
    # the CLI refuses far below Pillow's limit; load_image alone stops at Pillow's
    limit = f"{2 * Image.MAX_IMAGE_PIXELS:,}"
    run = generate(checkpoint, image=huge)
    one_error_line(run, f"huge.png has more than {limit} pixels", "40 megapixels")
    with pytest.raises(
        ValueError, match=f"225,000,000 pixels, over Pillow's limit of {limit}"
    ):
        load_image(huge)


@pytest.mark.parametrize(
    "text, words",
    [
        ("[1, 2, 3]", "config.json holds a JSON list, not an object"),
        ('{"vision_config": {', "config.json is not valid JSON"),
        ("\x89PNG\r\n", "config.json is not"),
    ],
)
def test_a_config_json_that_is_no_json_object(
    checkpoint, tmp_path, capsys, text, words
):
    model = model_copy(checkpoint, tmp_path)
    (model / "config.json").write_text(text, encoding="latin-1")
    one_error_line(run_main(capsys, checkpoint, model=model), words)
    with pytest.raises(ValueError, match="config.json"):
        load_pretrained(model)


@pytest.mark.parametrize(
    "config, words",
    [
        ({"hidden_size": "big"}, "hidden_size='big' at the top level must be an "),
        ({"text_config": {"num_hidden_layers": 2.5}}, "num_hidden_layers=2.5 in "),
        ({"vision_config": {"layer_norm_eps": "1e-6"}}, "layer_norm_eps='1e-6' in "),
        ({"vision_config": [1]}, "vision_config must be a JSON object"),
    ],
)
def test_a_config_json_field_of_the_wrong_type_is_named(
    checkpoint, tmp_path, capsys, config, words
):
    "Issue 51 §11: the field named, before any tensor is compared with the sizes"
    model = model_copy(checkpoint, tmp_path)
    saved = json.loads((model / "config.json").read_text())
    for key, value in config.items():
        if isinstance(value, dict):
            saved[key].update(value)
        else:
            saved[key] = value
    (model / "config.json").write_text(json.dumps(saved))
    line = one_error_line(run_main(capsys, checkpoint, model=model), words)
    assert "no tensor" not in line
    with pytest.raises(ValueError, match=re.escape(words)):
        load_pretrained(model)


@pytest.mark.parametrize(
    "file,change,words",
    [
        ("config.json", {"image_size": None}, "give image_size and patch_size [None,"),
        ("config.json", {"image_size": "224"}, "image_size and patch_size ['224',"),
        ("preprocessor_config.json", {"image_mean": [0.5, 0.5]},
         "give image_mean [0.5, 0.5]: give three numbers"),
        ("preprocessor_config.json", {"image_mean": "x"}, "give image_mean ['x']"),
        ("preprocessor_config.json", {"image_std": [0, 0, 0]}, "each above 0"),
    ],
)  # fmt: skip
def test_bad_image_settings_are_named_not_a_traceback(
    checkpoint, tmp_path, capsys, file, change, words
):
    "The trial of issue 51: the processor's settings checked, the field named"
    model = model_copy(checkpoint, tmp_path)
    saved = json.loads((model / file).read_text())
    (saved["vision_config"] if file == "config.json" else saved).update(change)
    (model / file).write_text(json.dumps(saved))
    one_error_line(run_main(capsys, checkpoint, model=model), words)


def sharded(checkpoint, tmp_path) -> Path:
    "The checkpoint as an index and one shard, as the Hub's larger models are laid out"
    model = model_copy(checkpoint, tmp_path)
    names = list(read_safetensors_header(model / "model.safetensors"))
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    weight_map = {k: "model-00001-of-00001.safetensors" for k in names[1:]}
    (model / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return model


def test_a_sharded_checkpoint_loads(checkpoint, tmp_path, capsys):
    expected = run_main(capsys, checkpoint)
    assert run_main(capsys, checkpoint, model=sharded(checkpoint, tmp_path)) == expected


@pytest.mark.parametrize(
    "index, words",
    [
        ("Too Many Requests", "index.json is not valid JSON"),
        ('{"weight_map": ["model-1.safetensors"]}', '"weight_map" object'),
        ('{"weight_map": {"a": 1}}', '"weight_map" object'),
    ],
)
def test_a_damaged_index(checkpoint, tmp_path, capsys, index, words):
    model = sharded(checkpoint, tmp_path)
    (model / INDEX_FILE).write_text(index)
    line = one_error_line(run_main(capsys, checkpoint, model=model), words)
    assert str(model / INDEX_FILE) in line


def test_size_as_one_number_in_preprocessor_config(checkpoint, tmp_path, capsys):
    model = model_copy(checkpoint, tmp_path)
    settings = json.loads((model / "preprocessor_config.json").read_text())
    settings["size"] = 28
    (model / "preprocessor_config.json").write_text(json.dumps(settings))
    run = run_main(capsys, checkpoint, model=model)
    one_error_line(run, "preprocessor_config.json", '"size": {"height": 28')


def test_max_new_tokens_beyond_the_positions_is_refused_before_allocating(
    checkpoint, capsys, monkeypatch
):
    import paligemma_lib.generation as generation

    monkeypatch.setattr(
        generation, "_buffers", lambda *a: pytest.fail("buffers were allocated")
    )
    run = run_main(capsys, checkpoint, "--max-new-tokens", "1000000000")
    line = one_error_line(run, "over the model's 8192 positions")
    assert re.search(r"ask for at most max_new_tokens=81\d\d$", line), line


def test_a_prompt_longer_than_the_positions(checkpoint, capsys):
    run = run_main(capsys, checkpoint, prompt="caption en " * 7000)
    line = one_error_line(run, "for the model's 8192 positions")
    prompt = int(re.search(r"the prompt is (\d+) tokens", line)[1])
    assert prompt > 8192  # the real count, not a guess


def test_nan_weights_are_reported_with_the_step(checkpoint, tmp_path, capsys):
    model = model_copy(checkpoint, tmp_path)
    with safe_open(model / "model.safetensors", "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    state["language_model.model.norm.weight"][3] = float("nan")
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    run = run_main(capsys, checkpoint, model=model)
    one_error_line(run, "logits for new token 1 are NaN or infinite")
    assert run.stdout == ""  # no answer printed
    loaded = load_pretrained(model)
    processor = PaliGemmaProcessor.from_pretrained(model)
    with pytest.raises(NonFiniteLogitsError, match="new token 1"):
        answer(loaded, processor, checkpoint / "image.png", "caption en")


def test_a_checkpoint_with_the_unused_pooling_head(checkpoint, tmp_path, capsys):
    """transformers writes SigLIP's pooling head when vision_use_head is true: the
    tensors are skipped with one note, and the answer is the one without them"""
    model = model_copy(checkpoint, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["vision_config"]["vision_use_head"] = True
    (model / "config.json").write_text(json.dumps(config))
    with safe_open(model / "model.safetensors", "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    width = config["vision_config"]["hidden_size"]
    for name, shape in [("probe", (1, 1, width)), ("layernorm.weight", (width,))]:
        state[f"vision_tower.vision_model.head.{name}"] = torch.ones(shape)
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    expected = run_main(capsys, checkpoint)
    run = run_main(capsys, checkpoint, model=model)
    assert run.returncode == 0 and run.stdout == expected.stdout
    notes = run.stderr.strip().splitlines()  # and the note of the cut answer
    assert len(notes) == 2 and notes[0].startswith("note: ignoring the 2 tensors")
    assert notes[1] == expected.stderr.strip()
    assert "vision_tower.vision_model.head.{layernorm.weight, probe}" in notes[0]


def test_save_with_the_processor_then_the_cli_answers_the_same(
    checkpoint, tmp_path, capsys
):
    model = load_pretrained(checkpoint / "model")
    processor = PaliGemmaProcessor.from_pretrained(checkpoint / "model")
    save_pretrained(model, tmp_path / "saved", processor=processor)
    run = run_main(capsys, checkpoint, model=tmp_path / "saved")
    assert run.returncode == 0, run.stderr
    from paligemma_lib.cli.options import DEFAULT_MAX_NEW_TOKENS

    expected = answer(
        model,
        processor,
        checkpoint / "image.png",
        "caption en",
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS,  # the command's default
    )
    assert run.stdout == expected + "\n" == run_main(capsys, checkpoint).stdout


def test_a_failing_save_leaves_the_folder_as_it_was(checkpoint, tmp_path, monkeypatch):
    import paligemma_lib.weights as weights

    folder = model_copy(checkpoint, tmp_path)
    (folder / "README.md").write_text("my notes")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    torch.manual_seed(1)
    other = PaliGemmaForConditionalGeneration(load_pretrained(folder).config)
    written = []

    def write_then_fail(self, text, *args, **kwargs):  # the second write: config.json
        written.append(self.name)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights.Path, "write_text", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(other, folder)
    monkeypatch.undo()
    assert written == ["config.json"]  # the weights were written before it
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no staging left
    save_pretrained(other, folder)  # and a save that succeeds replaces both
    reloaded = load_pretrained(folder)
    for (name, p), q in zip(other.named_parameters(), reloaded.parameters()):
        assert torch.equal(p, q), name
    assert (folder / "README.md").read_text() == "my notes"  # others' files stay


def test_one_prompt_for_a_list_of_images(checkpoint):
    model = load_pretrained(checkpoint / "model")
    processor = PaliGemmaProcessor.from_pretrained(checkpoint / "model")
    red, image = Image.new("RGB", (30, 20), "red"), checkpoint / "image.png"
    texts = answer(model, processor, [image, red], "caption en", max_new_tokens=4)
    alone = [
        answer(model, processor, x, "caption en", max_new_tokens=4)
        for x in [image, red]
    ]
    assert texts == alone
    with pytest.raises(ValueError, match="prompt"):
        answer(model, processor, [image, red], ["caption en"])


def test_the_top_level_api_and_its_help():
    import paligemma_lib.generation
    import paligemma_lib.weights
    from paligemma_lib import (  # noqa: F401
        PaliGemmaProcessor,
        __version__,
        answer,
        draw_boxes,
        generate,
        load_image,
        load_pretrained,
        save_pretrained,
    )

    assert draw_boxes.__module__ == "paligemma_lib.boxes"
    for module in (paligemma_lib.generation, paligemma_lib.weights):
        assert module.__doc__ and "chapter" in module.__doc__, module
    for argument in ("images", "prompts", "max_new_tokens", "do_sample", "Returns"):
        assert argument in answer.__doc__, argument
    for argument in ("images", "prompts", "suffixes", "padding_side", "max_length"):
        assert argument in PaliGemmaProcessor.__call__.__doc__, argument


# The shipped model (paligemma_lib/assets/nano): --model defaults to its name, "nano"


def run_default(capsys, checkpoint, *extra, prompt="caption en"):
    "run_main without --model: the command as a reader types it first"
    args = ["generate", "--image", checkpoint / "image.png", "--prompt", prompt]
    code = main([str(a) for a in [*args, *extra]])
    out = capsys.readouterr()
    return Run(code, out.out, out.err)


def test_generate_without_model_answers_with_the_shipped_nano(checkpoint):
    run = cli(
        "generate",
        "--image",
        checkpoint / "image.png",
        "--prompt",
        "caption en",
        "--max-new-tokens",
        "5",
        "--device",
        "cpu",
    )
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    model = load_pretrained("nano")
    assert isinstance(model, PaliGemmaForConditionalGeneration)
    expected = answer(
        model,
        PaliGemmaProcessor.from_pretrained("nano"),
        load_image(checkpoint / "image.png"),
        "caption en",
        max_new_tokens=5,
    )
    assert run.stdout == expected + "\n"


def test_evaluate_and_generate_default_to_nano():
    from paligemma_lib.cli.main import parse_args

    assert parse_args(["evaluate", "--world", "shapes"]).model == "nano"
    args = parse_args(["generate", "--image", "x.png", "--prompt", "caption en"])
    assert args.model == "nano"
    help_text = cli("generate", "--help").stdout
    assert "Default: nano" in " ".join(help_text.split())


def test_a_folder_named_nano_is_dot_nano(checkpoint, tmp_path, capsys, monkeypatch):
    """The name nano means the shipped model even where a folder here has that name
    (issue 51 §5); the folder is ./nano"""
    from paligemma_lib.model_files import resolve_model_path, shipped_model_path

    expected = run_main(capsys, checkpoint)  # the test checkpoint, given by its path
    monkeypatch.chdir(tmp_path)
    shutil.copytree(checkpoint / "model", tmp_path / "nano")
    assert resolve_model_path("nano") == shipped_model_path("nano")
    assert resolve_model_path("./nano") == resolve_model_path(Path("nano"))
    assert PaliGemmaProcessor.from_pretrained("./nano").image_size == 28
    assert PaliGemmaProcessor.from_pretrained("nano").image_size == 224
    assert run_main(capsys, checkpoint, model="./nano") == expected
    run = run_default(capsys, checkpoint, "--max-new-tokens", "3")
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith(
        "note: nano means the shipped model; the folder nano here is a model: give "
        "it as --model ./nano"
    )


def test_an_unknown_model_name_lists_the_shipped_ones(checkpoint, tmp_path, capsys):
    run = run_main(capsys, checkpoint, model=tmp_path / "pico")
    one_error_line(run, "no checkpoint folder at", "pico", "shipped model", "nano")
    with pytest.raises(FileNotFoundError, match="not the name of a shipped model"):
        load_pretrained("pico")
    with pytest.raises(FileNotFoundError, match=r"\(nano, nano-real\)"):
        PaliGemmaProcessor.from_pretrained("pico")


# Issue 22 §8: the command line as a new user meets it


def test_the_default_max_new_tokens_holds_every_shipped_task():
    """The commands' default holds the longest answer, <eos> included, of every task
    of the worlds the shipped models learned: on 300 test scenes a task, and a
    receipt built to be the longest (the longest store name, the widest total);
    generate()'s own default, 64, holds every task but three segmented shapes"""
    import inspect
    import json as json_module

    from paligemma_lib import segmentation  # noqa: F401  (adds the segments world)
    from paligemma_lib.cli.main import build_parser
    from paligemma_lib.cli.options import DEFAULT_MAX_NEW_TOKENS
    from paligemma_lib.data import SPLITS, STORES, TASKS, make_example
    from paligemma_lib.generation import generate

    library = inspect.signature(generate).parameters["max_new_tokens"].default
    limit = DEFAULT_MAX_NEW_TOKENS
    assert library == 64 and limit == 80
    assert "max_new_tokens (64)" in answer.__doc__
    for command in ("generate", "evaluate"):
        args = build_parser().parse_args(
            [command, "--image", "x", "--prompt", "p"]
            if command == "generate"
            else [command, "--world", "shapes"]
        )
        assert args.max_new_tokens == limit
    tokenizer = PaliGemmaProcessor.from_pretrained("nano").tokenizer

    def length(text):  # the answer's tokens and <eos>
        return len(tokenizer.encode(text, add_bos=False)) + 1

    longest = {}
    for world, tasks in TASKS.items():
        for task in tasks:
            longest[task] = max(
                length(make_example(world, seed, task).answer)
                for seed in SPLITS["test"][:300]
            )
    longest["receipt, built"] = max(
        length(json_module.dumps(
            {"store": store, "date": "2026-12-31", "total": "89.97"},
            separators=(",", ":"),
        ))
        for store in STORES
    )  # fmt: skip
    print(longest)
    assert max(longest.values()) <= limit, longest
    assert max(v for k, v in longest.items() if k != "segment") <= library


def test_an_answer_cut_at_max_new_tokens_says_so(checkpoint, capsys):
    "The random model never says <eos>: its answer stops at the limit, with a note"
    run = run_main(capsys, checkpoint, "--max-new-tokens", "2")
    assert run.returncode == 0 and run.stdout.strip(), run
    assert run.stderr == (
        "note: the answer stopped at --max-new-tokens 2 before its end (<eos>), so it "
        "may be cut short; raise --max-new-tokens\n"
    )
    from paligemma_lib.generation import TruncatedAnswerWarning

    model = load_pretrained(checkpoint / "model")
    processor = PaliGemmaProcessor.from_pretrained(checkpoint / "model")
    image = checkpoint / "image.png"
    with pytest.warns(TruncatedAnswerWarning, match="max_new_tokens=2"):
        answer(model, processor, image, "caption en", max_new_tokens=2)


def test_an_answer_that_ends_has_no_note(capsys, tmp_path):
    "nano on a scene of its world ends its caption with <eos>: no note"
    from paligemma_lib.data import make_example

    make_example("shapes", 1_000_010_000).image.save(tmp_path / "scene.png")
    code = main(["generate", "--image", str(tmp_path / "scene.png"), "--prompt",
                 "caption en"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0 and out.err == "" and out.out.startswith("a "), out


@pytest.mark.parametrize("prompt", ["", "   "])
def test_an_empty_prompt_is_refused(checkpoint, capsys, prompt):
    one_error_line(run_main(capsys, checkpoint, prompt=prompt), "--prompt is empty")


def test_an_image_url_is_refused_with_its_slashes(checkpoint, capsys):
    url = "https://example.com/photos/cat.png"
    run = run_main(capsys, checkpoint, image=url)
    one_error_line(run, f"--image {url}:", "only local files")


def test_an_image_over_the_pixel_limit_is_refused(checkpoint, tmp_path, capsys):
    "144 megapixels: refused at the demo's limit, without Pillow's bomb warning"
    from paligemma_lib.demo import MAX_IMAGE_PIXELS

    assert 40_000_000 == MAX_IMAGE_PIXELS < 144_000_000 < 2 * Image.MAX_IMAGE_PIXELS
    huge = tmp_path / "huge.png"
    huge.write_bytes(claim_size((checkpoint / "image.png").read_bytes(), 12000, 12000))
    line = one_error_line(run_main(capsys, checkpoint, image=huge), "12000 x 12000")
    assert "40 megapixels" in line and "note" not in line


def test_a_model_that_is_an_adapter_folder_hints_adapter(checkpoint, capsys):
    from paligemma_lib.demo import shipped_adapter

    folder = shipped_adapter("receipts")
    run = run_main(capsys, checkpoint, model=folder)
    one_error_line(run, "is a LoRA adapter", f"--adapter {folder}")


def test_every_option_has_help_and_shows_its_default():
    from paligemma_lib.cli.main import build_parser

    parser = build_parser()
    top = " ".join(parser.format_help().split())
    assert "train a model from scratch, or fine-tune one" in top
    commands = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, (name, action.option_strings)
        text = " ".join(sub.format_help().split())
        if name in ("generate", "evaluate"):
            assert "(default: 80)" in text, name  # DEFAULT_MAX_NEW_TOKENS
        if name == "train":
            for words in (
                "--min-lr-ratio MIN_LR_RATIO the cosine",
                "(default: 0.1)",
                "--lora-r LORA_R with --lora: the adapter's rank (default: 8)",
            ):
                assert words in text, words
        if name == "demo":
            assert "--port PORT port to listen on (default: 7860)" in text


@pytest.mark.parametrize(
    "flags",
    [
        ["--lora-r", "4"],
        ["--lora-alpha", "8"],
        ["--lora-targets", "all"],
        ["--lora-tokens", "seg"],
    ],
)
def test_lora_options_without_lora_are_refused(tmp_path, flags):
    run = cli("train", "--model", "nano", "--out", tmp_path / "run", "--steps", "1",
              *flags)  # fmt: skip
    one_error_line(run, flags[0], "add --lora")
    assert not (tmp_path / "run").exists()


def tiny_run(out, *extra):
    return cli("train", "--config", "tiny", "--out", out, "--batch-size", "2",
               "--eval-size", "1", "--no-progress", *extra)  # fmt: skip


def test_train_says_what_it_wrote_and_where_it_resumed(tmp_path):
    base = tmp_path / "base"
    run = tiny_run(base, "--steps", "2", "--save-every", "1")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith(f"model and training record written to {base}")
    # step 2 lost: --resume goes on from step 1, and says so
    shutil.rmtree(base / "checkpoints" / "step-0000002")
    run = tiny_run(base, "--steps", "2", "--save-every", "1", "--resume")
    assert run.returncode == 0, run.stderr
    step_1 = base / "checkpoints" / "step-0000001"
    assert f"resuming from {step_1}: step 1 of 2" in run.stdout
    adapter = tmp_path / "adapter"
    run = cli("train", "--model", base, "--lora", "--out", adapter, "--steps", "1",
              "--batch-size", "2", "--eval-size", "1", "--no-progress")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith(
        f"LoRA adapter and training record written to {adapter}"
    )


def test_train_rehearses_a_t4_on_the_cpu(tmp_path):
    """Issue 28: with PALIGEMMA_REHEARSE_GPU=t4, `--device auto` is cpu:0 standing in
    for a T4: fp16 autocast with the loss scaler, the GPU's default of data workers;
    the record says which arithmetic trained the model"""
    env = {**os.environ, "PALIGEMMA_REHEARSE_GPU": "t4"}
    out = tmp_path / "t4"
    run = subprocess.run(
        [sys.executable, "-m", "paligemma_lib", "train", "--config", "tiny",
         "--out", str(out), "--batch-size", "2", "--eval-size", "1", "--steps", "2",
         "--no-progress"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    record = json.loads((out / "training_record.json").read_text())
    assert record["autocast"] == "float16"
    assert all(math.isfinite(x) for x in record["history"]["loss"])
    plain = tmp_path / "plain"
    assert tiny_run(plain, "--steps", "1").returncode == 0
    assert json.loads((plain / "training_record.json").read_text())["autocast"] is None


def test_ctrl_c_during_training_names_the_checkpoint_and_resume(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "paligemma_lib", "train", "--config", "tiny",
               "--out", str(out), "--steps", "100000", "--save-every", "1",
               "--batch-size", "2", "--eval-size", "1"]  # fmt: skip
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while not list((out / "checkpoints").glob("step-*")):
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "no checkpoint in 300 s"
        time.sleep(0.2)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130, err
    last = err.strip().splitlines()[-1]
    found = re.search(r"the last checkpoint is (\S+) \(step (\d+)\)", last)
    assert found and Path(found[1]).is_dir(), last
    assert Path(found[1]).name == f"step-{int(found[2]):07d}"
    assert last.endswith(" ".join(["python -m paligemma_lib", *command[3:],
                                   "--resume"]))  # fmt: skip
    assert "Traceback" not in err


def test_evaluate_names_the_adapter(capsys):
    code = main(["evaluate", "--adapter", "receipts", "--world", "receipts",
                 "--limit", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert (
        out.splitlines()[0]
        == "nano with adapter receipts on receipts (validation, 1 examples)"
    )


def test_evaluate_segments_reports_mask_miou_and_baselines(capsys):
    "Chapter 12.1's metrics for the segments world, graded against the scenes' masks"
    from paligemma_lib import segmentation  # noqa: F401  (adds the segments world)
    from paligemma_lib.data import SyntheticDataset

    code = main(["evaluate", "--world", "segments", "--adapter", "segment",
                 "--limit", "3", "--batch-size", "3", "--no-progress"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert lines[0] == "nano with adapter segment on segments (validation, 3 examples)"
    rows = {tuple(line.split()[1:-1]): line.split()[-1] for line in lines[2:]}
    for name in ("mIoU", "filled box mIoU", "class mask mIoU"):
        for kind in ("", "circle", "square", "triangle"):
            value = rows[tuple(f"{name} {kind}".split())]
            assert value == "nan" or 0.0 <= float(value) <= 1.0
    data = SyntheticDataset("segments", split="validation", size=3)
    truth = sum(len(data.example(i).labels) for i in range(3))
    # every true object is graded, matched or not, and so is each predicted one
    assert int(rows["objects", "graded"]) >= truth


NANO_SCENE_SEED = 1_000_012_013  # a test seed: book/figures/make_nano_scene.py


def test_the_readme_picture_is_answered_right_on_every_prompt(capsys):
    """README's and A.1's picture: nano's commands answer every prompt of its world
    about it right (the caption, the count, each colour, each shape's box)"""
    from paligemma_lib.boxes import parse_loc_tokens
    from paligemma_lib.data import make_example
    from paligemma_lib.evaluation import box_iou

    picture = Path(__file__).resolve().parents[1] / "book/figures/nano_scene.png"
    scene = make_example("shapes", NANO_SCENE_SEED, "caption")
    assert np.array_equal(np.asarray(load_image(picture)), np.asarray(scene.image))
    kinds = [label.split()[1] for label in scene.labels]
    assert sorted(kinds) == ["circle", "square", "triangle"]  # every prompt applies
    truth = {"caption en": scene.answer, "answer en how many shapes are there?": "3"}
    for label in scene.labels:
        colour, kind = label.split()
        truth[f"answer en what color is the {kind}?"] = colour
    for prompt, want in truth.items():
        assert main(["generate", "--image", str(picture), "--prompt", prompt]) == 0
        assert capsys.readouterr().out == want + "\n", prompt
    for kind, box in zip(kinds, scene.boxes):
        prompt = f"detect {kind}"
        assert main(["generate", "--image", str(picture), "--prompt", prompt]) == 0
        text = capsys.readouterr().out.splitlines()[0]  # then the boxes, in words
        found = parse_loc_tokens(text, 224, 224)
        assert [label for _, label in found] == [kind], prompt
        assert box_iou(found[0][0], box) >= 0.5, (prompt, found, box)


def test_the_readme_segment_picture_says_the_base_model_never_saw_it(capsys):
    """A.1's segment scene (the README links there): its command, with the segment
    adapter, boxes both circles and masks them (segment_masks.png draws those
    masks); the text beside it says the base model is outside that world"""
    from paligemma_lib.boxes import parse_loc_tokens
    from paligemma_lib.data import SyntheticDataset
    from paligemma_lib.evaluation import box_iou
    from paligemma_lib.segment_eval import grade, matched_ious
    from paligemma_lib.segmentation import parse_segments  # adds the segments world

    root = Path(__file__).resolve().parents[1]
    picture = root / "book/figures/segment_scene.png"
    scene = SyntheticDataset("segments", "test", size=1002).example(1001)
    command = ["--prompt", "segment circle", "--adapter", "segment"]
    assert main(["generate", "--image", str(picture), *command]) == 0
    text = capsys.readouterr().out.splitlines()[0]
    found = parse_loc_tokens(text, 224, 224)
    assert [label for _, label in found] == scene.labels == ["circle", "circle"]
    for box in scene.boxes:
        assert max(box_iou(b, box) for b, _ in found) >= 0.5, (found, box)
    # the masks: 0.75 is chapter 12.1's goal for a mask. They measure 0.87 and
    # 0.94 (smaller circle, larger); a CPU that rounds the decoder's values near
    # 0 otherwise flips pixels on a mask's rim only, and a whole rim flipped (the
    # smaller mask's 120 edge pixels lost, or the 124 just outside it gained)
    # leaves 0.80 and 0.90 or more. And better than the filled boxes (a
    # circle's own box scores pi/4)
    ious, invalid = matched_ious(parse_segments(text, 224, 224), scene.masks)
    assert invalid == 0 and len(ious) == 2 and min(ious) >= 0.75, ious
    grades = grade(scene, text)
    assert sum(grades["model"]) > sum(grades["filled box"]), grades
    # beside the picture: the base model never saw this world
    readme = (root / "book/a1_using_the_library.md").read_text()
    after = readme.split("(figures/segment_masks.png)")[1].split("\n\n")[1]
    after = " ".join(after.split())
    assert "which the base `nano` never saw" in after
    assert "without `--adapter segment`" in after
    main(["generate", "--image", str(picture), "--prompt", "caption en"])
    assert "triangle" not in capsys.readouterr().out  # as the text says


def test_the_readme_first_command_and_what_nano_has_seen(capsys):
    "The README's picture is a test scene of the data module, captioned as it says"
    from paligemma_lib.data import COLOURS, SIDES, make_example

    root = Path(__file__).resolve().parents[1]
    readme = " ".join((root / "README.md").read_text().split())
    picture = root / "book" / "figures" / "nano_scene.png"
    scene = make_example("shapes", NANO_SCENE_SEED, "caption")
    assert np.array_equal(np.asarray(load_image(picture)), np.asarray(scene.image))
    command = 'generate --image book/figures/nano_scene.png --prompt "caption en"'
    assert f"python -m paligemma_lib {command}" in readme
    assert f"The first prints `{scene.answer}`" in readme
    code = main(["generate", "--image", str(picture), "--prompt", "caption en"])
    assert code == 0 and capsys.readouterr().out == scene.answer + "\n"
    assert (
        f"shapes (circle, square, triangle) of {SIDES[0]}-{SIDES[1]} pixels" in readme
    )
    assert f"four fixed colours ({', '.join(COLOURS)})" in readme
    assert "light-grey background (levels 210-250)" in readme
    # the corner pixel is background (shapes keep a margin): its levels, over scenes
    corners = {
        make_example("shapes", seed).image.getpixel((0, 0)) for seed in range(300)
    }
    assert all(r == g == b for r, g, b in corners)
    assert 210 <= min(corners)[0] and max(corners)[0] <= 250
    nano = load_pretrained("nano").config.text.max_position_embeddings
    assert f"8192 for PaliGemma, {nano} for `nano`" in readme


def test_the_readme_number_is_read_right_by_nano_real(capsys):
    """A.1's handwritten number (the README links there): a test example of chapter
    12.2's handwriting world (book/figures/make_real_number.py), which nano-real
    reads as it says"""
    from paligemma_lib.data import SyntheticDataset
    from paligemma_lib.real_images import mnist_5k  # noqa: F401  (adds the world)

    root = Path(__file__).resolve().parents[1]
    picture = root / "book/figures/real_number.png"
    ex = SyntheticDataset("handwriting", "test", size=401).example(400)
    assert np.array_equal(np.asarray(load_image(picture)), np.asarray(ex.image))
    command = "--model nano-real --image book/figures/real_number.png --prompt ocr"
    readme = (root / "book/a1_using_the_library.md").read_text()
    readme = " ".join(readme.replace("\\\n", " ").split())  # lines joined
    assert f"python -m paligemma_lib generate {command}" in readme
    assert f"It prints `{ex.answer}`" in readme
    assert main(["generate", *command.split()]) == 0
    assert capsys.readouterr().out == ex.answer + "\n"
    # the warning beside it: chapter 12.2's test record of the shipped nano-real
    from paligemma_lib.real_images import measures

    record = root / "paligemma_lib/assets/real/real-after-gpu-20261126-1339.json"
    graded = json.loads(record.read_text())
    shipped = root / "paligemma_lib/assets/nano-real/model.safetensors"
    assert graded["model_sha256"] == hashlib.sha256(shipped.read_bytes()).hexdigest()
    seen = measures(graded)
    three = f"reads {seen['3-digit numbers read']:.0%} of three-digit numbers whole"
    assert len(ex.answer) == 3 and three in readme
    assert f"counts {seen['items counted']:.0%} of clothing scenes right" in readme
    assert f"names only {seen['items named']:.0%} of the clothes" in readme
    classic = json.loads(
        (root / "paligemma_lib/assets/real/classic-2026-11-26.json").read_text()
    )
    cnn = classic["sources"]["clothing"]["runs"]["cnn"]["accuracy"]
    assert f"one item at a time names {cnn:.0%}" in readme
