"""paligemma_lib.resolution (chapter 11.4): the learned positions resampled as
big_vision resamples them (scipy.ndimage.zoom, order 1, in big_vision/models/vit.py's
resample_posemb), and a model at another resolution."""

import numpy as np
import pytest
import scipy.ndimage
import torch
from PIL import Image

from paligemma_lib import PaliGemmaProcessor, load_pretrained
from paligemma_lib.resolution import at_resolution, processor_at, resample_positions


@pytest.mark.parametrize("n,side", [(16, 32), (16, 64), (14, 28), (3, 7), (5, 4)])
def test_resampling_is_big_visions_zoom(n, side):
    "scipy.ndimage.zoom(grid, (side/n, side/n, 1), order=1): resample_posemb's call"
    table = torch.randn(
        n * n, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(n)
    )
    grid = table.reshape(n, n, -1).numpy()
    theirs = scipy.ndimage.zoom(grid, (side / n, side / n, 1), order=1)
    theirs = torch.from_numpy(theirs.reshape(side * side, -1))
    # float64: an interpolation weight computed in another order moves a blend by an
    # ulp of the coordinate (< n) times the gap between its sides, on each axis; the
    # blend rounds a few times more
    bound = (2 * 2 * n + 8) * 2**-53 * table.abs().max().item()
    ours = resample_positions(table, side)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=bound)  # why: at bound


def test_resampling_keeps_the_dtype_and_refuses_a_table_that_is_no_grid():
    table = torch.randn(196, 8, dtype=torch.bfloat16)
    assert resample_positions(table, 28).dtype == torch.bfloat16
    assert torch.equal(resample_positions(table, 14), table)  # the same grid
    with pytest.raises(ValueError, match="not a square grid"):
        resample_positions(torch.zeros(195, 8), 28)


def test_a_model_at_its_own_resolution_is_the_same_model():
    nano = load_pretrained("nano")
    same = at_resolution(nano, nano.config.vision.image_size)
    processor = PaliGemmaProcessor.from_pretrained("nano")
    image = Image.fromarray(np.full((224, 224, 3), 200, np.uint8))
    batch = processor([image], ["caption en"])
    inputs = {
        k: getattr(batch, k)
        for k in ("input_ids", "pixel_values", "attention_mask", "token_type_ids")
    }
    with torch.no_grad():
        assert torch.equal(nano(**inputs).logits, same(**inputs).logits)


def test_at_448_the_tokens_and_the_room_for_text_follow():
    nano = load_pretrained("nano")
    bigger = at_resolution(nano, 448)
    old, new = nano.config, bigger.config
    assert new.num_image_tokens == 4 * old.num_image_tokens
    room = old.text.max_position_embeddings - old.num_image_tokens
    assert new.text.max_position_embeddings - new.num_image_tokens == room
    assert old.vision.image_size == 224  # the original is untouched
    processor = processor_at(PaliGemmaProcessor.from_pretrained("nano"), 448, 16)
    assert (processor.image_size, processor.num_image_tokens) == (448, 784)
    with pytest.raises(ValueError, match="not a multiple of the patch size"):
        at_resolution(nano, 450)


# --- the command line (issue 52 §5) ---


def generate(capsys, tmp_path, size, *flags):
    "generate's (stdout, stderr lines) for a plain picture of `size`"
    from paligemma_lib.cli.main import main

    picture = tmp_path / "picture.png"
    Image.new("RGB", size, (220, 220, 220)).save(picture)
    code = main(["generate", "--image", str(picture), "--prompt", "caption en", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err.splitlines()


def test_generate_at_another_resolution_answers_as_at_resolution(capsys, tmp_path):
    from paligemma_lib import answer

    out, notes = generate(capsys, tmp_path, (448, 448), "--resolution", "448")
    assert len(notes) == 1 and "resampled (chapter 11.4)" in notes[0], notes
    nano = load_pretrained("nano")
    processor = processor_at(PaliGemmaProcessor.from_pretrained("nano"), 448, 16)
    picture = Image.open(tmp_path / "picture.png")
    assert out.strip() == answer(
        at_resolution(nano, 448), processor, picture, "caption en"
    )


def test_a_resolution_that_is_no_multiple_of_the_patch_is_refused(capsys):
    from paligemma_lib.cli.main import main

    args = ["--image", "book/figures/nano_scene.png", "--prompt", "caption en"]
    assert main(["generate", *args, "--resolution", "450"]) == 1
    err = capsys.readouterr().err
    assert "--resolution 450: give a multiple of nano's patch of 16 pixels" in err


@pytest.mark.parametrize(
    "size,said",
    [((60, 40), "enlarged 3.7 times"), ((224, 224), None),
     ((1200, 1000), "5.4 times smaller")],
)  # fmt: skip
def test_generate_says_when_the_pictures_detail_and_the_models_view_differ(
    capsys, tmp_path, size, said
):
    _, notes = generate(capsys, tmp_path, size)
    assert notes == ([] if said is None else [notes[0]])
    if said is not None:
        assert notes[0].startswith("note: the picture is") and said in notes[0]
