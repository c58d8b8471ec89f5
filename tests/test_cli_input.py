# ruff: noqa: F811  (pytest fixtures are parameters named like the imported fixture)
"""The command line on bad input: one `error:` line, exit status 1, no traceback.

(Ctrl-C: exit status 130.) Cases from issue 16; the checkpoint fixture is
test_cli.py's."""

import signal
import subprocess
import sys
import time

import pytest
from test_cli import checkpoint, cli  # noqa: F401  (a fixture, used by name)

import paligemma_lib


def one_error_line(run, *words):
    "Exit status 1, a single `error:` line on stderr naming `words`, no traceback"
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def generate(checkpoint, *extra, image=None):
    image = image or checkpoint / "image.png"
    return cli(
        "generate",
        "--model",
        checkpoint / "model",
        "--image",
        image,
        "--prompt",
        "caption en",
        *extra,
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
    image = image or checkpoint / "image.png"
    return cli(
        "generate",
        "--model",
        checkpoint / "model",
        "--image",
        image,
        "--prompt",
        "detect cat",
        "--draw",
        draw,
    )


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


def test_ctrl_c_exits_130_without_a_traceback(checkpoint):
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
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)  # under way: importing, loading or generating
    assert child.poll() is None, "the command ended before Ctrl-C could be sent"
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130, (child.returncode, err)
    assert "Traceback" not in err and err.strip() == "error: interrupted", err
