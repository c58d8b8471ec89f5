"""Chapter 1: images to pixel values, patch embedding, position embedding."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from torch import nn

from paligemma_lib import image_processing
from paligemma_lib.config import VisionConfig
from paligemma_lib.image_processing import (
    load_image,
    process_images,
    resize_to_square,
    to_rgb,
)
from paligemma_lib.siglip import SiglipVisionEmbeddings


def scene(width=90, height=60, mode="RGB"):
    image = Image.new("RGB", (width, height), (135, 190, 235))
    draw = ImageDraw.Draw(image)
    draw.rectangle([10, 20, 50, 55], fill=(200, 90, 70))
    draw.ellipse([60, 5, 80, 25], fill=(250, 210, 50))
    return image.convert(mode)


def test_config_defaults_are_paligemma_3b_224():
    c = VisionConfig()
    assert (
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
    ) == (1152, 4304, 27, 16)
    assert (c.image_size, c.patch_size, c.num_image_tokens) == (224, 14, 256)


def test_config_from_hf_ignores_unknown_keys_and_fills_defaults():
    c = VisionConfig.from_hf(
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "model_type": "siglip_vision_model",
            "projector_hidden_act": "gelu_fast",
            "num_image_tokens": 256,
        }
    )
    assert c.hidden_size == 64 and c.image_size == 224
    assert VisionConfig.from_hf(c.to_hf()) == c


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(image_size=225), "not a multiple of patch_size"),
        (dict(hidden_size=100, num_attention_heads=16), "not divisible"),
        (dict(hidden_act="relu"), "gelu_pytorch_tanh"),
    ],
)
def test_config_rejects_inconsistent_sizes(kwargs, words):
    with pytest.raises(ValueError, match=words):
        VisionConfig(**kwargs)


@pytest.mark.parametrize(
    "image, rgb",
    [
        (Image.new("L", (3, 3), 128), (128, 128, 128)),
        (Image.new("LA", (3, 3), (0, 0)), (255, 255, 255)),
        (Image.new("RGBA", (3, 3), (0, 0, 0, 0)), (255, 255, 255)),
        (Image.new("RGBA", (3, 3), (10, 20, 30, 255)), (10, 20, 30)),
        (
            Image.new("RGB", (3, 3), (10, 200, 30)).convert(
                "P", palette=Image.Palette.ADAPTIVE
            ),
            (10, 200, 30),
        ),
        (Image.fromarray(np.full((3, 3), 65535, np.uint16)), (255, 255, 255)),
        (Image.fromarray(np.full((3, 3), 32896, np.uint16)), (128, 128, 128)),
        (Image.new("I", (3, 3), 257 * 100), (100, 100, 100)),
        (Image.new("1", (3, 3), 0), (0, 0, 0)),
        (Image.new("CMYK", (3, 3), (0, 0, 0, 0)), (255, 255, 255)),
    ],
)
def test_to_rgb_converts_every_mode(image, rgb):
    out = to_rgb(image)
    assert out.mode == "RGB" and out.getpixel((1, 1)) == rgb


def test_float_images_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="floating-point"):
        to_rgb(Image.new("F", (2, 2), 0.5))


def test_sixteen_bit_png_from_disk(tmp_path):
    ramp = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "ramp16.png")
    out = np.asarray(load_image(tmp_path / "ramp16.png"))
    np.testing.assert_array_equal(out[..., 0], np.round(ramp / 257).astype(np.uint8))


def test_load_image_errors(tmp_path):
    scene().save(tmp_path / "ok.png")
    data = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.png").write_text("hello")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(ValueError, match="is the file complete"):
        load_image(tmp_path / "cut.png")
    with pytest.raises(ValueError, match="not an image file"):
        load_image(tmp_path / "text.png")
    with pytest.raises(IsADirectoryError, match="folder"):
        load_image(tmp_path)
    with pytest.raises(ValueError, match="no pixels"):
        load_image(Image.new("RGB", (0, 4)))
    with pytest.raises(TypeError, match="PIL.Image.Image"):
        load_image(42)
    with pytest.raises(ValueError, match="no images"):
        process_images([])


def test_load_image_turns_a_file_upright_by_its_exif_orientation(tmp_path):
    from transformers.image_utils import load_image as reference_load_image

    sideways = Image.fromarray(np.arange(72, dtype=np.uint8).reshape(4, 6, 3) * 3)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to show
    sideways.save(tmp_path / "portrait.jpg", exif=exif, quality=95)
    upright = load_image(tmp_path / "portrait.jpg")
    assert upright.size == (4, 6)
    reference = reference_load_image(str(tmp_path / "portrait.jpg"))
    np.testing.assert_array_equal(np.asarray(upright), np.asarray(reference))
    # an image handed over in memory is taken as it is
    with Image.open(tmp_path / "portrait.jpg") as opened:
        assert load_image(opened).size == (6, 4)
    # a file with no tag is read as it is
    sideways.save(tmp_path / "plain.jpg", quality=95)
    assert load_image(tmp_path / "plain.jpg").size == (6, 4)


def test_process_images_shape_range_and_formula():
    image = scene()
    pixels = process_images(image, image_size=28)
    assert pixels.shape == (1, 3, 28, 28) and pixels.dtype == torch.float32
    resized = np.asarray(image.resize((28, 28), Image.Resampling.BICUBIC)).astype(
        np.float32
    )
    expected = torch.from_numpy(resized).permute(2, 0, 1) * 2 / 255 - 1
    torch.testing.assert_close(pixels[0], expected)
    assert pixels.min() >= -1 and pixels.max() <= 1


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P", "L", "LA"])
def test_process_images_equals_transformers(mode):
    from transformers import SiglipImageProcessorPil

    images = [scene(mode=mode), scene(45, 80, mode=mode)]
    # transparency reaches the reference composited onto white by to_rgb (tested
    # above): older transformers 5.x versions drop the alpha channel, newer ones
    # composite as we do, so this compares resizing and normalising on every version
    their_inputs = [to_rgb(im) if "A" in im.getbands() else im for im in images]
    # the Pillow implementation, named: the torchvision one differs by a level on some
    # pixels (chapter 1 measures it)
    reference = SiglipImageProcessorPil(size={"height": 56, "width": 56})
    theirs = torch.from_numpy(
        reference(images=their_inputs, return_tensors="np")["pixel_values"]
    )
    ours = process_images(images, image_size=56)
    # float32 both sides, values in [-1, 1], two or three roundings each (rescale,
    # then normalise): a few units of 2^-23, below 1e-6; one level is 2/255 = 7.8e-3
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_conv_patch_embedding_equals_unfold_and_linear():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 42, 42)
    linear = nn.Linear(3 * 14 * 14, 24)
    conv = nn.Conv2d(3, 24, kernel_size=14, stride=14)
    with torch.no_grad():
        conv.weight.copy_(linear.weight.view(24, 3, 14, 14))
        conv.bias.copy_(linear.bias)
    # [B, 3 * 14 * 14, N] -> [B, N, 588], N = 9 patches
    unfolded = nn.functional.unfold(x, kernel_size=14, stride=14).transpose(1, 2)
    from_conv = conv(x).flatten(2).transpose(1, 2)
    # float32, 588-term dot products summed in other orders by the conv and matmul
    # kernels: ~sqrt(588) 2^-24 of partial sums below 1, about 1e-6
    torch.testing.assert_close(from_conv, linear(unfolded), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "config",
    [
        VisionConfig(
            hidden_size=32, num_attention_heads=4, image_size=28, patch_size=14
        ),
        VisionConfig(
            hidden_size=40, num_attention_heads=4, image_size=42, patch_size=14
        ),
        VisionConfig(
            hidden_size=24,
            num_attention_heads=2,
            image_size=30,
            patch_size=6,
            num_channels=3,
        ),
    ],
)
def test_embeddings_equal_transformers(config):
    from transformers import SiglipVisionConfig
    from transformers.models.siglip.modeling_siglip import (
        SiglipVisionEmbeddings as Reference,
    )

    torch.manual_seed(0)
    ours = SiglipVisionEmbeddings(config).eval()
    theirs = Reference(SiglipVisionConfig(**config.to_hf())).eval()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"position_ids"}
    x = torch.randn(2, 3, config.image_size, config.image_size)
    out = ours(x)
    assert out.shape == (2, config.num_image_tokens, config.hidden_size)
    conv, p = ours.patch_embedding, config.patch_size
    sizes = nn.functional.conv2d(x.abs(), conv.weight.abs(), conv.bias.abs(), stride=p)
    n = config.num_channels * p * p
    # float32, u = 2^-24: kernels may sum each patch's n = C p^2 products and the bias
    # in other orders, each side within (n + 1) u of the exact sum, relative to the
    # sum of the terms' sizes (the conv of |x| with |weights|, + |bias|); adding the
    # position table (N(0, 1): outputs well above 1) rounds once more, u |out|
    atol = 2 * 2**-24 * ((n + 1) * sizes.max() + out.abs().max()).item()
    # rtol=0: the bound above is absolute, and whole
    torch.testing.assert_close(out, theirs(x), atol=atol, rtol=0)


def test_embeddings_add_the_position_of_each_patch():
    config = VisionConfig(
        hidden_size=8, num_attention_heads=2, image_size=28, patch_size=14
    )
    layer = SiglipVisionEmbeddings(config)
    x = torch.randn(1, 3, 28, 28)
    without = layer.patch_embedding(x).flatten(2).transpose(1, 2)
    torch.testing.assert_close(
        layer(x) - without, layer.position_embedding.weight.expand(1, -1, -1)
    )


@pytest.mark.parametrize(
    "shape", [(1, 3, 56, 56), (1, 1, 28, 28), (3, 28, 28), (1, 3, 28, 30)]
)
def test_embeddings_reject_wrong_shapes_naming_both(shape):
    config = VisionConfig(
        hidden_size=8, num_attention_heads=2, image_size=28, patch_size=14
    )
    with pytest.raises(ValueError) as e:
        SiglipVisionEmbeddings(config)(torch.zeros(shape))
    assert str(list(shape)) in str(e.value) and "[batch, 3, 28, 28]" in str(e.value)


def test_embeddings_in_bfloat16():
    config = VisionConfig(
        hidden_size=8, num_attention_heads=2, image_size=28, patch_size=14
    )
    layer = SiglipVisionEmbeddings(config).to(torch.bfloat16)
    # float32 pixels are cast to the layer's dtype
    out = layer(torch.randn(1, 3, 28, 28))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_full_size_parameter_count_on_meta():
    with torch.device("meta"):
        layer = SiglipVisionEmbeddings(VisionConfig())
    assert (
        sum(p.numel() for p in layer.parameters())
        == 1152 * 3 * 14 * 14 + 1152 + 256 * 1152
    )


def test_embeddings_reject_raw_integer_pixels():
    config = VisionConfig(
        hidden_size=8, num_attention_heads=2, image_size=28, patch_size=14
    )
    with pytest.raises(ValueError, match="torch.uint8.*process_images"):
        SiglipVisionEmbeddings(config)(torch.zeros(1, 3, 28, 28, dtype=torch.uint8))


def bilinear_half_pixel(image, out_h, out_w):
    "tf.image.resize's bilinear rule (half-pixel centres, no antialias), float64"

    def taps(n_in, n_out):
        x = (torch.arange(n_out, dtype=torch.float64) + 0.5) * n_in / n_out - 0.5
        lower = x.floor().clamp(min=0).long()
        upper = x.ceil().clamp(max=n_in - 1).long()
        return lower, upper, x - x.floor()

    (y0, y1, ly), (x0, x1, lx) = (
        taps(image.shape[1], out_h),
        taps(image.shape[2], out_w),
    )
    image = image.double()
    top, bottom = image[:, y0], image[:, y1]
    top = top[:, :, x0] + (top[:, :, x1] - top[:, :, x0]) * lx
    bottom = bottom[:, :, x0] + (bottom[:, :, x1] - bottom[:, :, x0]) * lx
    return top + (bottom - top) * ly[:, None]  # [C, out_h, out_w]


@pytest.mark.parametrize("size", [28, 56, 120])  # shrink, shrink, enlarge (90 x 60)
def test_bilinear_is_the_half_pixel_rule_truncated_to_uint8(size):
    image = scene()
    exact = bilinear_half_pixel(
        torch.from_numpy(np.asarray(image, dtype=np.float64)).permute(2, 0, 1),
        size,
        size,
    )
    pixels = process_images(image, image_size=size, resample="bilinear")[0]
    levels = (pixels.double() + 1) * 255 / 2
    # whole levels: float32 pixels (error ~2^-24) times 127.5 is ~1e-5 of a level
    torch.testing.assert_close(levels, levels.round(), atol=1e-4, rtol=0)
    levels, truncated = levels.round(), exact.floor()
    # float32 (u = 2^-24), as TensorFlow: a tap's position x < n_in takes 3 roundings
    # (3 n_in u), a weight that far off moves a lerp by 255 times it, two lerps deep;
    # the lerps round 7 values < 256 (255 u each). Away from whole levels by more, the
    # result is the exact value truncated; near one, a level either side
    near = (2 * 255 * 3 * max(image.size) + 7 * 255) * 2**-24
    away = (exact - exact.round()).abs() > near
    assert away.any() and torch.equal(levels[away], truncated[away])
    assert ((levels - truncated).abs() <= 1).all()
    assert pixels.min() >= -1 and pixels.max() <= 1


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["noise", "smooth", "small"])
def test_bilinear_equals_tensorflow_bit_for_bit(name):
    # tests/fixtures/tf_bilinear_resize.npz: uint8 images and what TensorFlow 2.21 made
    # of them, tf.cast(tf.image.resize(image, (s, s), "bilinear", antialias=False),
    # tf.uint8), big_vision's resize (noise 45 x 61 -> 28, smooth 30 x 50 -> 56, small
    # 16 x 19 -> 40); see tests/fixtures/README.md for the script that made it
    stored = np.load(FIXTURES / "tf_bilinear_resize.npz")
    image, expected = stored[f"{name}_image"], stored[f"{name}_resized"]
    size = expected.shape[0]
    levels = image_processing.image_levels(
        Image.fromarray(image), size, resample="bilinear"
    )[0].permute(1, 2, 0)  # [S, S, 3] uint8
    np.testing.assert_array_equal(levels.numpy(), expected)


def test_bilinear_does_not_antialias():
    board = Image.fromarray(((np.indices((60, 60)).sum(0) % 2) * 255).astype(np.uint8))
    bilinear = process_images(board, image_size=20, resample="bilinear")
    bicubic = process_images(board, image_size=20)
    assert set(bilinear.unique().tolist()) == {-1.0, 1.0}  # samples: aliased
    assert bicubic[..., 2:-2, 2:-2].abs().max() < 0.1  # Pillow filters to grey


def test_default_resample_is_bicubic_and_unchanged():
    images = [scene(), scene(45, 80)]
    default = process_images(images, image_size=28)
    bicubic = process_images(images, image_size=28, resample="bicubic")
    # bit for bit: the default is the same call
    torch.testing.assert_close(default, bicubic, rtol=0, atol=0)
    assert not torch.equal(
        default, process_images(images, image_size=28, resample="bilinear")
    )


def per_image(images, image_size, resample, mean, std):
    "The reference: each image resized on its own, then (x / 255 - mean) / std"
    mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    levels = [resize_to_square(load_image(im), image_size, resample) for im in images]
    return torch.stack([(x / 255.0 - mean) / std for x in levels])


MODES = ["RGB", "L", "RGBA", "LA", "P"]
CLIP = ((0.4815, 0.4578, 0.4082), (0.2686, 0.2613, 0.2758))  # one value per channel


@pytest.mark.parametrize("resample", ["bicubic", "bilinear"])
@pytest.mark.parametrize("mean_std", [((0.5,) * 3, (0.5,) * 3), CLIP])
def test_uint8_batch_is_the_per_image_path_bit_for_bit(resample, mean_std, monkeypatch):
    # bit for bit, not a tolerance: the two paths do the same float32 operations in
    # the same order, and transformers' processor is checked against this function
    images = [scene(56, 56, mode) for mode in MODES]
    images[2].putalpha(Image.linear_gradient("L").resize((56, 56)))  # see-through
    expected = per_image(images, 56, resample, *mean_std)

    def no_resize(*args):
        raise AssertionError("images of the target size were resized one by one")

    with monkeypatch.context() as m:  # the uint8 path is the one taken
        m.setattr(image_processing, "resize_to_square", no_resize)
        fast = process_images(images, 56, *mean_std, resample)
    assert torch.equal(fast, expected) and fast.is_contiguous()


@pytest.mark.parametrize("resample", ["bicubic", "bilinear"])
@pytest.mark.parametrize("mean_std", [((0.5,) * 3, (0.5,) * 3), CLIP])
def test_batches_needing_a_resize_are_the_per_image_path(resample, mean_std):
    # at the target size, shrunk, enlarged and not square, in several modes
    sizes = [(56, 56), (90, 60), (30, 41), (56, 57), (200, 200)]
    images = [scene(w, h, mode) for (w, h), mode in zip(sizes, MODES)]
    pixels = process_images(images, 56, *mean_std, resample)
    assert torch.equal(pixels, per_image(images, 56, resample, *mean_std))


@pytest.mark.parametrize("resample", ["nearest", "BICUBIC", "lanczos", None])
def test_unknown_resample_is_a_clear_error(resample):
    with pytest.raises(ValueError, match="'bicubic'.*'bilinear'"):
        process_images(scene(), resample=resample)


def test_sixteen_bit_is_the_reference_on_the_scaled_8_bit_image():
    from transformers import SiglipImageProcessorPil

    reference = SiglipImageProcessorPil(size={"height": 56, "width": 56})
    gray8 = np.asarray(scene(mode="L"))
    gray16 = Image.fromarray(gray8.astype(np.uint16) * 257)
    theirs = reference(images=[Image.fromarray(gray8)], return_tensors="np")
    ours, theirs = process_images(gray16, image_size=56), theirs["pixel_values"]
    # float32 both sides, a few roundings each of values in [-1, 1]: below 1e-6
    torch.testing.assert_close(ours, torch.from_numpy(theirs), atol=1e-6, rtol=0)


def test_sixteen_bit_differs_from_the_reference_exactly_where_it_clips():
    from transformers import SiglipImageProcessorPil

    reference = SiglipImageProcessorPil(size={"height": 28, "width": 28})
    samples = np.asarray(scene(28, 28, mode="L")).astype(np.uint16) * 257
    samples[:5, :5] = 0  # 0 needs no clipping: the two agree there
    theirs = reference(images=[Image.fromarray(samples)], return_tensors="np")
    theirs = torch.from_numpy(theirs["pixel_values"])[0, 0]
    ours = process_images(Image.fromarray(samples), image_size=28)[0, 0]
    clipped = torch.from_numpy(samples > 255)
    assert 0 < clipped.float().mean() < 1
    assert torch.equal((ours - theirs).abs() > 1e-6, clipped)
    assert (theirs[clipped] == 1).all()  # clipped to white


@pytest.mark.parametrize("size", [(1, 1), (10000, 10)])
def test_generate_notes_an_image_far_from_what_the_model_saw(size, tmp_path, capsys):
    "Issue 39: a 1 x 1 or 10000 x 10 picture answered nonsense without a word"
    from paligemma_lib.cli.main import main

    path = tmp_path / "odd.png"
    Image.new("RGB", size, (200, 30, 30)).save(path)
    code = main(["generate", "--image", str(path), "--prompt", "caption en"])
    err = capsys.readouterr().err
    assert code == 0
    assert f"note: the image is {size[0]} x {size[1]} pixels" in err
    assert "Crop it" in err


def test_a_picture_like_the_models_gives_no_note(tmp_path, capsys):
    from paligemma_lib.cli.main import main

    path = tmp_path / "scene.png"
    scene(320, 200).save(path)
    assert main(["generate", "--image", str(path), "--prompt", "caption en"]) == 0
    assert "note: the image" not in capsys.readouterr().err


def png16(levels: np.ndarray, color_type: int) -> bytes:
    "A 16-bit PNG written by hand (Pillow writes none in colour): [H, W, C] uint16"
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    height, width = levels.shape[:2]
    rows = b"".join(b"\x00" + levels[y].astype(">u2").tobytes() for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))  # fmt: skip


@pytest.mark.parametrize("color_type, channels", [(2, 3), (6, 4)])
def test_a_16_bit_colour_png_loads_as_its_8_bit_levels(tmp_path, color_type, channels):
    "Issue 39 item 9: 16-bit RGB and RGBA PNGs (opaque) load as v / 257, rounded"
    levels = np.zeros((4, 4, channels), np.uint16)
    levels[..., :3] = (65535, 32896, 2570)  # 255, 128, 10 times 257
    if channels == 4:
        levels[..., 3] = 65535
    path = tmp_path / "sixteen.png"
    path.write_bytes(png16(levels, color_type))
    assert load_image(path).getpixel((0, 0)) == (255, 128, 10)
