"""Issue 24, section 4: images may travel as their 8-bit levels (a quarter of float32's
bytes) from a DataLoader's workers; the model normalises them on its device, to the
same bits as the processor's float32 pixels."""

import numpy as np
import pytest
import torch
from PIL import Image
from test_paligemma import tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from paligemma_lib.data import Collator, SyntheticDataset
from paligemma_lib.image_processing import (
    image_levels,
    normalize_levels,
    process_images,
)
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.processing import PaliGemmaProcessor
from paligemma_lib.tokenization import GemmaTokenizer, default_tokenizer_path


def images(size=28):
    "An RGB, a grayscale and an RGBA image, of `size` and of other sizes"
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    return [
        rgb,
        rgb.convert("L"),
        rgb.convert("RGBA"),
        rgb.resize((size + 9, size - 5)),  # resized on the way
    ]


@pytest.fixture(scope="module")
def processor():
    tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
    return PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)


@pytest.mark.parametrize("resample", ["bicubic", "bilinear"])
def test_levels_normalised_are_process_images_bit_for_bit(resample):
    levels = image_levels(images(), 28, resample)
    assert levels.dtype == torch.uint8 and levels.shape == (4, 3, 28, 28)
    assert levels.is_contiguous()
    assert torch.equal(
        normalize_levels(levels), process_images(images(), 28, resample=resample)
    )
    # the formula, on the exact values: (x / 255 - 0.5) / 0.5
    x = levels.double()
    exact = ((x / 255 - 0.5) / 0.5).float()
    # float32 rounds x / 255 and the subtraction (half an ulp of a value below 1 each,
    # at most 2**-25), the division by 0.5 doubles them: 2**-23, and the reference's own
    # rounding to float32 adds 2**-24; 2**-22 covers the sum. rtol=0: values near 0
    torch.testing.assert_close(
        normalize_levels(levels), exact, rtol=0, atol=2**-22
    )  # rtol=0, atol=2**-22: the roundings counted above


def test_normalize_levels_refuses_floats():
    with pytest.raises(ValueError, match="expected uint8"):
        normalize_levels(torch.zeros(1, 3, 4, 4))


def test_processor_and_collator_give_levels_on_request(processor):
    prompts, answers = ["caption en"] * 4, ["a", "b", "c", "d"]
    floats = processor(images(), prompts, answers)
    levels = processor(images(), prompts, answers, pixels="uint8")
    assert levels.pixel_values.dtype == torch.uint8
    assert torch.equal(normalize_levels(levels.pixel_values), floats.pixel_values)
    for key in ("input_ids", "attention_mask", "token_type_ids", "labels"):
        assert torch.equal(levels[key], floats[key])
    collated = Collator(processor, pixels="uint8")(
        list(zip(images(), prompts, answers))
    )
    assert torch.equal(collated.pixel_values, levels.pixel_values)
    # .to(dtype=...) casts float pixels only: levels stay levels
    assert collated.to(dtype=torch.bfloat16).pixel_values.dtype == torch.uint8
    assert floats.to(dtype=torch.bfloat16).pixel_values.dtype == torch.bfloat16


def test_levels_are_refused_where_the_model_would_normalise_differently(processor):
    with pytest.raises(ValueError, match="pixels='nope'"):
        processor(images()[:1], "caption en", pixels="nope")
    other = PaliGemmaProcessor(
        processor.tokenizer,
        image_size=28,
        num_image_tokens=4,
        image_mean=(0.48, 0.46, 0.41),
        image_std=(0.27, 0.26, 0.28),
    )
    with pytest.raises(ValueError, match="pixels='normalized'"):
        other(images()[:1], "caption en", pixels="uint8")
    with pytest.raises(ValueError, match="pixels='normalized'"):
        Collator(other, pixels="uint8")


def test_the_model_normalises_levels_to_the_same_logits():
    torch.manual_seed(0)
    config = tiny_config(image_size=28)
    model = PaliGemmaForConditionalGeneration(config).eval()
    ids = torch.tensor([[config.image_token_index] * config.num_image_tokens + [2, 7]])
    ids = ids.expand(4, -1)
    with torch.no_grad():
        a = model(ids, process_images(images(), 28)).logits
        b = model(ids, image_levels(images(), 28)).logits
    assert torch.equal(a, b)  # the same float32 pixels, so the same computation


def test_synthetic_batches_as_levels_are_the_float_batches():
    tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
    nano = PaliGemmaProcessor(tokenizer, image_size=224, num_image_tokens=196)
    examples = [SyntheticDataset({"shapes": 0.7, "ocr": 0.3})[i] for i in range(6)]
    floats = Collator(nano)(examples)
    levels = Collator(nano, pixels="uint8")(examples)
    assert levels.pixel_values.element_size() * 4 == floats.pixel_values.element_size()
    assert torch.equal(normalize_levels(levels.pixel_values), floats.pixel_values)


class OpsSeen(TorchDispatchMode):
    "Records (op name, its arguments) of every aten operation run inside it"

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func.overloadpacket.__name__, args))
        return func(*args, **(kwargs or {}))


def test_normalisation_divides_by_tensors_on_the_levels_device():
    """Issue 28: CUDA's division turns a Python-number divisor into a multiplication by
    its reciprocal, and x * float32(1/255) differs from x / 255 for 126 of the 256
    levels: a normalisation dividing by 255.0 was bit-exact on the CPU only. Every
    division `normalize_levels` runs takes a tensor on the levels' device (a true
    division on every device), and the constants are made once per device, not
    copied there at each call. Seen to catch: `pixels.div_(255.0)`."""
    x = torch.arange(256, dtype=torch.float32)
    emulated = x * torch.tensor(1 / 255, dtype=torch.float32)  # CUDA's scalar path
    assert int((emulated != x / 255).sum()) == 126
    levels = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).repeat(2, 3, 1, 1)
    normalize_levels(levels)  # the constants of this device are made here, once
    with OpsSeen() as seen:
        pixels = normalize_levels(levels)
    names = [name for name, _ in seen.ops]
    assert names == ["_to_copy", "div_", "sub_", "div_"], names  # nothing else made
    for name, args in seen.ops[1:]:
        assert all(isinstance(a, torch.Tensor) for a in args), (name, args)
        assert all(a.device == levels.device and a.dim() == 4 for a in args), name
    # the true quotient for every level, each channel: not the reciprocal's
    expected = (x / 255 - 0.5) / 0.5
    assert torch.equal(
        pixels[:, :, :, :].reshape(2, 3, 256), expected.expand(2, 3, 256)
    )
    assert not torch.equal(expected, (emulated - 0.5) / 0.5)
