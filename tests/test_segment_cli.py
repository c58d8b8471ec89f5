"""Chapter 12.1 where users meet it: `generate --prompt "segment ..." --draw` draws
the masks of the answer, with the VAE of --seg-vae or $PALIGEMMA_SEG_VAE (real
PaliGemma's vae-oid.npz has that layout); draw_segments on its own."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from scripted import ANSWER, random_vae_file, scripted_checkpoint

from paligemma_lib.segmentation import (
    Segment,
    draw_segments,
    load_mask_vae,
    parse_segments,
    shipped_mask_vae_path,
)

SIZE = (96, 80)  # width, height: not square, so that x and y cannot be swapped


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    "The scripted checkpoint (real layout), its adapter, a random vae-oid.npz, an image"
    root = tmp_path_factory.mktemp("segment")
    model, adapter = scripted_checkpoint(root)
    vae = random_vae_file(root / "vae-oid.npz")
    Image.new("RGB", SIZE, "teal").save(root / "image.png")
    return {"model": model, "adapter": adapter, "vae": vae, "image": root / "image.png"}


def generate(files, *extra, env=None, prompt="segment circle"):
    return subprocess.run(
        [sys.executable, "-m", "paligemma_lib", "generate", "--model", files["model"],
         "--image", files["image"], "--prompt", prompt, "--device", "cpu", *extra],
        capture_output=True, text=True, env=env,
    )  # fmt: skip


def one_error_line(run, *words):
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_segment_draws_the_masks_with_the_given_vae(files, tmp_path):
    out = tmp_path / "masks.png"
    run = generate(
        files, "--adapter", files["adapter"], "--seg-vae", files["vae"], "--draw", out
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == ANSWER  # the adapter makes the model write the segment
    assert lines[-1] == f"1 masks drawn on {out}"
    image = Image.open(files["image"])
    (segment,) = parse_segments(ANSWER, *SIZE, load_mask_vae(files["vae"]))
    x0, y0, x1, y1 = segment.box
    assert lines[1] == (
        f"circle: x0={x0:.0f} y0={y0:.0f} x1={x1:.0f} y1={y1:.0f} "
        f"mask={int(segment.mask.sum())} pixels"
    )
    drawn = np.asarray(Image.open(out).convert("RGB"))
    assert np.array_equal(drawn, np.asarray(draw_segments(image, [segment])))
    # inside the mask, off the box's outline and label, the colour is blended in;
    # outside the mask, the image is what the box and label alone make of it
    no_mask = Segment("circle", segment.box, torch.zeros_like(segment.mask), "")
    boxes_only = np.asarray(draw_segments(image, [no_mask]))
    plain = np.asarray(image)
    mask = segment.mask.numpy()
    off_box = np.all(boxes_only == plain, axis=-1)
    assert 0 < (mask & off_box).sum() < mask.size
    assert (drawn[mask & off_box] != plain[mask & off_box]).any(-1).all()
    assert np.array_equal(drawn[~mask], boxes_only[~mask])


def test_the_vae_comes_from_the_environment_variable(files, tmp_path):
    "$PALIGEMMA_SEG_VAE, not the shipped VAE, decodes: the mask is the random VAE's"
    env = {**os.environ, "PALIGEMMA_SEG_VAE": str(files["vae"])}
    run = generate(files, "--adapter", files["adapter"], env=env)
    assert run.returncode == 0, run.stderr
    for vae, used in ((files["vae"], True), (shipped_mask_vae_path(), False)):
        (segment,) = parse_segments(ANSWER, *SIZE, load_mask_vae(vae))
        assert (f"mask={int(segment.mask.sum())} pixels" in run.stdout) == used


def test_without_the_adapter_there_is_no_mask(files, tmp_path):
    out = tmp_path / "none.png"
    run = generate(files, "--draw", out, "--max-new-tokens", "4")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == f"0 masks drawn on {out}"
    assert np.array_equal(
        np.asarray(Image.open(out).convert("RGB")),
        np.asarray(Image.open(files["image"]).convert("RGB")),
    )


def test_bad_vae_flags_fail_before_the_model(files, tmp_path):
    one_error_line(
        generate(files, "--seg-vae", tmp_path / "missing.npz"), "no mask VAE file"
    )
    np.savez(tmp_path / "other.npz", weights=np.zeros(3, np.float32))
    one_error_line(generate(files, "--seg-vae", tmp_path / "other.npz"), "vae-oid.npz")
    one_error_line(
        generate(files, "--seg-vae", files["vae"], prompt="caption en"),
        "--seg-vae",
        "segment",
    )
    one_error_line(
        generate(files, "--draw", tmp_path / "x.png", prompt="caption en"),
        "--draw",
        "segment",
    )


def segment(label, box, size=(40, 30)):
    "A Segment whose mask is its whole box, on an image of `size` (width, height)"
    mask = torch.zeros(size[1], size[0], dtype=torch.bool)
    x0, y0, x1, y1 = box
    mask[y0:y1, x0:x1] = True
    return Segment(label, box, mask, label)


def test_draw_segments_any_mode_and_its_errors():
    image = Image.new("RGBA", (40, 30), (200, 10, 10, 0))  # transparent: white
    found = [segment("a", (2, 2, 38, 28)), Segment("b", None, None, "b <loc")]
    drawn = np.asarray(draw_segments(image, found, alpha=1.0))
    assert drawn.shape == (30, 40, 3)
    # (25, 20): inside, away from the outline and the label's tab at the top left
    assert (drawn[20, 25] == (255, 0, 255)).all()  # magenta, the first, solid
    assert (drawn[29, 39] == 255).all()  # outside: the white of transparency
    gray = draw_segments(Image.new("L", (40, 30), 90), found, alpha=0.5)
    # 0.5 * 90 + 0.5 * 255 = 172.5, rounded half to even
    assert gray.mode == "RGB" and gray.getpixel((25, 20)) == (172, 45, 172)
    with pytest.raises(ValueError, match=r"parse the answer with this image"):
        draw_segments(Image.new("RGB", (41, 30)), found)
    with pytest.raises(ValueError, match=r"alpha 0 must be in \(0, 1\]"):
        draw_segments(image, found, alpha=0)


def test_demo_segment_adapter_that_is_no_folder(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "paligemma_lib", "demo", "--segment-adapter",
         str(tmp_path / "nope")],
        capture_output=True, text=True,
    )  # fmt: skip
    one_error_line(run, "--segment-adapter", "no adapter folder at")
