"Chapter 6: tokenizer, processor and location tokens, checked against transformers."

import json
import random

import numpy as np
import pytest
import torch
import transformers
from PIL import Image, ImageDraw
from sentencepiece import sentencepiece_model_pb2
from transformers import GemmaTokenizer as ReferenceTokenizer
from transformers import PaliGemmaProcessor as ReferenceProcessor
from transformers import SiglipImageProcessorPil

from paligemma_lib.boxes import (
    bin_to_coordinate,
    boxes_to_loc_string,
    coordinate_to_bin,
    draw_boxes,
    parse_loc_tokens,
)
from paligemma_lib.image_processing import to_rgb
from paligemma_lib.processing import PaliGemmaBatch, PaliGemmaProcessor
from paligemma_lib.tokenization import (
    IMAGE_TOKEN,
    LOC_TOKENS,
    SEG_TOKENS,
    GemmaTokenizer,
    default_tokenizer_path,
    tokenizer_corpus,
    train_tokenizer,
)

transformers.logging.set_verbosity_error()
# numpy 2 notices from inside transformers
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TEXTS = [
    "",
    " ",
    "caption en",
    "answer en How many stars are there?\n",
    "  two  spaces ",
    "tab\there",
    "<loc0001><loc1023> star ; <seg017>",
    "naïve 日本 🙂",
    "TOTAL 12.50\nthanks",
    "x" * 40,
]
PROMPTS = [
    "caption en",
    "detect circle ; square",
    "",
    "answer en What colour is the circle?",
]
SUFFIXES = [
    "A red circle.",
    "<loc0100><loc0010><loc0500><loc0400> circle ; "
    "<loc0300><loc0500><loc0900><loc0900> square",
    "shapes",
    "red",
]


def pieces_of(model_proto: bytes) -> list[tuple]:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto)
    return [(p.piece, p.score, p.type) for p in proto.pieces]


def remove_piece(model_proto: bytes, piece: str) -> bytes:
    "The model without `piece`: the layout of the real PaliGemma file (no <image>)"
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto)
    del proto.pieces[[p.piece for p in proto.pieces].index(piece)]
    symbols = [s for s in proto.trainer_spec.user_defined_symbols if s != piece]
    del proto.trainer_spec.user_defined_symbols[:]
    proto.trainer_spec.user_defined_symbols.extend(symbols)
    return proto.SerializeToString()


def make_images():
    "Images of different sizes and modes"
    base = Image.new("RGB", (96, 64), "white")
    draw = ImageDraw.Draw(base)
    draw.ellipse((10, 8, 40, 38), fill="red")
    draw.rectangle((52, 20, 86, 54), fill="blue")
    rgba = base.resize((120, 80)).convert("RGBA")
    rgba.putalpha(128)
    return [base, rgba, base.resize((40, 90)).convert("P"), base.convert("L")]


def reference_images():
    """make_images() as the reference gets them: transparency composited onto white by
    to_rgb (tested in test_images.py). Older transformers 5.x versions drop the alpha
    channel instead, newer ones composite as we do; this keeps the comparison about
    resizing and normalising on every version"""
    return [to_rgb(im) if im.mode == "RGBA" else im for im in make_images()]


@pytest.fixture(scope="module")
def tokenizer():
    return GemmaTokenizer.from_file(default_tokenizer_path())


@pytest.fixture(
    scope="module", params=["image token in the model", "image token appended"]
)
def layout(request, tokenizer, tmp_path_factory):
    "(our tokenizer, a folder holding its tokenizer.model) for both layouts of the file"
    ours = (
        tokenizer
        if request.param == "image token in the model"
        else GemmaTokenizer(remove_piece(tokenizer.model_proto, IMAGE_TOKEN))
    )
    folder = tmp_path_factory.mktemp("tokenizer")
    ours.save(folder / "tokenizer.model")
    return ours, folder


@pytest.fixture(scope="module")
def reference_tokenizers(layout):
    "transformers' GemmaTokenizer on the file, PaliGemma's settings, then add_eos_token"
    _, folder = layout
    return (
        ReferenceTokenizer.from_pretrained(
            folder, add_bos_token=True, add_eos_token=False
        ),
        ReferenceTokenizer.from_pretrained(
            folder, add_bos_token=True, add_eos_token=True
        ),
    )


def reference_processor(folder, image_size, num_image_tokens):
    image_processor = SiglipImageProcessorPil(
        size={"height": image_size, "width": image_size},
        image_seq_length=num_image_tokens,
    )
    return ReferenceProcessor(
        image_processor=image_processor,
        tokenizer=ReferenceTokenizer.from_pretrained(folder),
    )


def assert_same_batch(ours: PaliGemmaBatch, theirs, with_labels: bool):
    for key in ["input_ids", "attention_mask", "token_type_ids"] + [
        "labels"
    ] * with_labels:
        assert torch.equal(ours[key], theirs[key]), key
    ours_pixels, their_pixels = ours.pixel_values, theirs["pixel_values"]
    # float32 both sides, values in [-1, 1], two or three roundings each (rescale,
    # then normalise): a few units of 2^-23, below 1e-6; one level is 2/255 = 7.8e-3
    torch.testing.assert_close(ours_pixels, their_pixels, atol=1e-6, rtol=0)


# The tokenizer


def test_shipped_tokenizer_is_what_the_chapter_trains(tokenizer):
    assert pieces_of(train_tokenizer(tokenizer_corpus())) == pieces_of(
        tokenizer.model_proto
    )


def test_special_ids_come_from_the_model(tokenizer):
    assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id, tokenizer.unk_id) == (
        0,
        1,
        2,
        3,
    )
    assert (
        tokenizer.image_token_id == tokenizer.piece_to_id(IMAGE_TOKEN) == 5
        and len(tokenizer) == 1792
    )
    assert all(tokenizer.has_piece(t) for t in LOC_TOKENS + SEG_TOKENS)
    assert [len(tokenizer.pieces(t)) for t in LOC_TOKENS + SEG_TOKENS] == [1] * (
        1024 + 128
    )


def test_image_token_goes_after_the_last_piece_when_missing(tokenizer):
    real_layout = GemmaTokenizer(remove_piece(tokenizer.model_proto, IMAGE_TOKEN))
    assert not real_layout.has_piece(IMAGE_TOKEN)
    assert (
        real_layout.image_token_id == len(real_layout.sp) == 1791
        and len(real_layout) == 1792
    )
    assert (
        real_layout.piece_to_id(LOC_TOKENS[0])
        == tokenizer.piece_to_id(LOC_TOKENS[0]) - 1
    )
    assert real_layout.decode([real_layout.image_token_id, 2]) == "<image><bos>"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(layout, reference_tokenizers, text):
    ours, _ = layout
    reference, with_eos = reference_tokenizers
    assert ours.encode(text) == reference(text)["input_ids"]
    assert (
        ours.encode(text, add_bos=False)
        == reference(text, add_special_tokens=False)["input_ids"]
    )
    assert ours.encode(text, add_eos=True) == with_eos(text)["input_ids"]
    assert ours.decode(ours.encode(text, add_eos=True)) == reference.decode(
        with_eos(text)["input_ids"]
    )
    assert (
        ours.decode(ours.encode(text, add_eos=True), skip_special_tokens=True) == text
    )


def test_decode_skips_special_tokens_but_keeps_locations(tokenizer):
    ids = [
        tokenizer.image_token_id,
        tokenizer.bos_id,
        tokenizer.piece_to_id("<loc0042>"),
        *tokenizer.encode(" star", add_bos=False),
        tokenizer.eos_id,
        tokenizer.pad_id,
    ]
    assert tokenizer.decode(ids) == "<image><bos><loc0042> star<eos><pad>"
    assert (
        tokenizer.decode(torch.tensor(ids), skip_special_tokens=True)
        == "<loc0042> star"
    )


def test_bad_ids_and_pieces_are_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="outside this tokenizer's vocabulary"):
        tokenizer.decode([len(tokenizer)])
    with pytest.raises(KeyError, match="not a piece"):
        tokenizer.piece_to_id("<nothing>")
    with pytest.raises(TypeError, match="expected a str"):
        tokenizer.encode(None)
    with pytest.raises(FileNotFoundError, match="no SentencePiece model"):
        GemmaTokenizer.from_file(default_tokenizer_path().parent / "missing.model")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        GemmaTokenizer(b"these are not the bytes of a model")
    with pytest.raises(ValueError, match="-100 marks ignored labels"):
        tokenizer.decode([2, -100])
    with pytest.raises(ValueError, match="decode each row"):
        tokenizer.decode(torch.zeros(2, 3, dtype=torch.long))


def test_checkpoint_methods_are_defined_in_the_class():
    "help() shows from_pretrained and save_pretrained under their names, in the class"
    for name in ["from_pretrained", "save_pretrained", "__call__"]:
        assert name in vars(PaliGemmaProcessor), name
        method = getattr(PaliGemmaProcessor, name)
        assert method.__qualname__ == f"PaliGemmaProcessor.{name}"


def test_processor_needs_location_tokens(tokenizer):
    plain = GemmaTokenizer(remove_piece(tokenizer.model_proto, "<loc1023>"))
    with pytest.raises(ValueError, match="no <loc1023> piece"):
        PaliGemmaProcessor(plain)


# The processor against transformers


@pytest.mark.parametrize("image_size,num_image_tokens", [(224, 256), (28, 4)])
@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("with_suffix", [True, False])
def test_processor_matches_transformers(
    layout, image_size, num_image_tokens, padding_side, with_suffix
):
    ours, folder = layout
    processor = PaliGemmaProcessor(
        ours, image_size=image_size, num_image_tokens=num_image_tokens
    )
    theirs = reference_processor(folder, image_size, num_image_tokens)
    assert theirs.image_token_id == processor.image_token_id
    kwargs = {"suffix": SUFFIXES} if with_suffix else {}
    expected = theirs(
        images=reference_images(),
        text=PROMPTS,
        padding="longest",
        padding_side=padding_side,
        return_tensors="pt",
        **kwargs,
    )
    got = processor(
        make_images(),
        PROMPTS,
        SUFFIXES if with_suffix else None,
        padding_side=padding_side,
    )
    assert_same_batch(got, expected, with_labels=with_suffix)
    assert (got.labels is None) != with_suffix


def test_layout_labels_and_token_types(tokenizer):
    processor = PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)
    batch = processor(
        make_images()[:2],
        ["caption en", ""],
        ["A red circle next to a blue square.", "x"],
    )
    for row, (prompt, suffix) in enumerate(
        [("caption en", "A red circle next to a blue square."), ("", "x")]
    ):
        prefix = [tokenizer.image_token_id] * 4 + tokenizer.encode(prompt + "\n")
        answer = tokenizer.encode(suffix, add_bos=False) + [tokenizer.eos_id]
        pad = batch.input_ids.shape[1] - len(prefix) - len(answer)
        padding = [tokenizer.pad_id] * pad  # on the right
        assert batch.input_ids[row].tolist() == prefix + answer + padding
        assert (
            batch.attention_mask[row].tolist()
            == [1] * (len(prefix) + len(answer)) + [0] * pad
        )
        assert (
            batch.token_type_ids[row].tolist()
            == [0] * len(prefix) + [1] * len(answer) + [0] * pad
        )
        assert (
            batch.labels[row].tolist() == [-100] * len(prefix) + answer + [-100] * pad
        )
    assert (batch.labels[1, -3:] == -100).all()  # the shorter example's padding


def test_generation_batches_are_left_padded(tokenizer):
    processor = PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)
    batch = processor(
        make_images()[:2], ["caption en", "answer en How many stars are there?"]
    )
    assert batch.labels is None and "labels" not in batch.keys()
    short = processor.encode_prefix("caption en")
    pad = batch.input_ids.shape[1] - len(short)
    assert pad > 0 and batch.input_ids[0].tolist() == [tokenizer.pad_id] * pad + short
    assert batch.attention_mask[0].tolist() == [0] * pad + [1] * len(short)
    assert (batch.token_type_ids == 0).all()


def test_prompt_and_newline_are_tokenised_together(tokenizer):
    processor = PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)
    question = "answer en How many stars are there?"
    joint = tokenizer.encode(question + "\n")
    assert processor.encode_prefix(question)[4:] == joint
    separate = tokenizer.encode(question) + tokenizer.encode("\n", add_bos=False)
    assert joint != separate  # "?\n" is one piece


def test_images_as_paths_and_any_mode(tokenizer, tmp_path):
    processor = PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)
    images = make_images()
    images[0].save(tmp_path / "scene.png")
    from_path = processor(tmp_path / "scene.png", "caption en")
    from_pil = processor(images[0], "caption en")
    torch.testing.assert_close(from_path.pixel_values, from_pil.pixel_values)
    assert processor(images, [""] * 4).pixel_values.shape == (4, 3, 28, 28)


def test_a_uint8_array_is_one_image(tokenizer, layout):
    processor = PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)
    images = make_images()
    rgb = np.asarray(images[0])  # [H, W, 3] uint8
    assert rgb.dtype == np.uint8 and rgb.ndim == 3
    from_array = processor(rgb, "caption en")
    assert from_array.pixel_values.shape == (1, 3, 28, 28)
    torch.testing.assert_close(
        from_array.pixel_values, processor(images[0], "caption en").pixel_values
    )
    # grayscale [H, W] and RGBA [H, W, 4] take the usual conversion to RGB
    for image in [images[0].convert("L"), images[0].convert("RGBA")]:
        torch.testing.assert_close(
            processor(np.asarray(image), "").pixel_values,
            processor(image, "").pixel_values,
        )
    # a list of arrays, one per prompt
    assert processor([rgb, rgb], ["", "x"]).pixel_values.shape == (2, 3, 28, 28)
    # transformers' processor reads the same array to the same batch
    ours, folder = layout
    theirs = reference_processor(folder, 28, 4)
    expected = theirs(images=rgb, text="caption en", return_tensors="pt")
    got = PaliGemmaProcessor(ours, image_size=28, num_image_tokens=4)(rgb, "caption en")
    assert_same_batch(got, expected, with_labels=False)


@pytest.mark.parametrize(
    "bad, error",
    [
        (np.zeros((8, 8, 3), np.float32), ValueError),  # not 8-bit levels
        (np.zeros((2, 8, 8, 3), np.uint8), ValueError),  # a stack of images
        (np.zeros((3, 8, 8), np.uint8), ValueError),  # channels first
        (torch.zeros(3, 8, 8, dtype=torch.uint8), TypeError),
    ],
)
def test_other_arrays_are_refused_saying_what_is_accepted(tokenizer, bad, error):
    processor = PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)
    with pytest.raises(error) as e:
        processor(bad, "caption en")
    message = str(e.value)
    assert "uint8" in message and "[H, W, 3 or 4]" in message
    assert "list of images" in message and "number of images" not in message
    with pytest.raises(error):  # inside a list too
        processor([bad], ["caption en"])


def test_batch_is_a_mapping_and_moves(tokenizer):
    processor = PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)
    batch = processor(make_images()[:1], ["caption en"], ["red"])

    def forward(input_ids, attention_mask, token_type_ids, pixel_values, labels=None):
        return labels

    assert forward(**batch) is batch.labels
    half = batch.to("cpu", dtype=torch.bfloat16)
    assert (
        half.pixel_values.dtype == torch.bfloat16 and half.input_ids.dtype == torch.long
    )
    with pytest.raises(KeyError, match="labels"):
        processor(make_images()[:1], ["caption en"])["labels"]


# Bad inputs


def test_max_length_too_short_says_by_how_much(tokenizer):
    processor = PaliGemmaProcessor(tokenizer)  # 256 image tokens
    needed = 256 + len(tokenizer.encode("answer en What colour is the circle?\n"))
    with pytest.raises(ValueError) as e:
        processor(
            make_images()[:2],
            ["caption en", "answer en What colour is the circle?"],
            max_length=needed - 5,
        )
    assert (
        "prompt 1 needs" in str(e.value)
        and "5 too many" in str(e.value)
        and "prompt 0" not in str(e.value)
    )
    assert "never truncated" in str(e.value)
    assert (
        processor(
            make_images()[:1],
            ["answer en What colour is the circle?"],
            max_length=needed,
        ).input_ids.shape[1]
        == needed
    )


def test_suffix_that_does_not_fit_is_an_error_not_cut(tokenizer):
    processor = PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)
    prefix = len(processor.encode_prefix("caption en"))
    suffix = len(processor.encode_suffix("A red circle next to a blue square."))
    with pytest.raises(ValueError, match=f"{prefix + suffix - (prefix + 2)} too many"):
        processor(
            make_images()[:1],
            ["caption en"],
            ["A red circle next to a blue square."],
            max_length=prefix + 2,
        )
    batch = processor(
        make_images()[:1],
        ["caption en"],
        ["A red circle next to a blue square."],
        max_length=prefix + suffix,
    )
    assert (
        batch.input_ids.shape[1] == prefix + suffix
        and batch.labels[0, -1] == tokenizer.eos_id
    )


def test_empty_prompt_is_allowed(tokenizer):
    processor = PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)
    batch = processor(make_images()[0], "")
    assert batch.input_ids[0].tolist() == [
        tokenizer.image_token_id
    ] * 4 + tokenizer.encode("\n")


@pytest.mark.parametrize("num_images,num_prompts", [(3, 2), (1, 2), (2, 3)])
def test_image_and_prompt_counts_must_match(tokenizer, num_images, num_prompts):
    processor = PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)
    images = make_images()[:num_images]
    with pytest.raises(
        ValueError,
        match=rf"number of images \({num_images}\) differs from the number of "
        rf"prompts \({num_prompts}\)",
    ):
        processor(images if num_images > 1 else images[0], ["caption en"] * num_prompts)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (
            {"prompts": ["<image>caption en"]},
            ValueError,
            "adds the image tokens itself",
        ),
        ({"prompts": [3]}, TypeError, "must be strings"),
        ({"prompts": []}, ValueError, "no prompts given"),
        ({"prompts": ["a"], "suffixes": ["x", "y"]}, ValueError, "number of suffixes"),
        ({"prompts": ["a"], "padding_side": "middle"}, ValueError, "padding_side"),
        ({"prompts": ["a"], "return_tensors": "np"}, ValueError, "only 'pt'"),
    ],
)
def test_bad_inputs_are_clear_errors(tokenizer, kwargs, error, words):
    processor = PaliGemmaProcessor(tokenizer, image_size=28, num_image_tokens=4)
    with pytest.raises(error, match=words):
        processor(images=make_images()[:1], **kwargs)


# Saving and loading


def test_save_pretrained_is_loaded_by_transformers(tokenizer, tmp_path):
    processor = PaliGemmaProcessor(tokenizer, image_size=56, num_image_tokens=16)
    processor.save_pretrained(tmp_path)
    theirs = ReferenceProcessor.from_pretrained(tmp_path, local_files_only=True)
    assert theirs.image_seq_length == 16
    # transformers picks its torchvision image processor when torchvision is installed
    # and its Pillow one otherwise; ours equals the Pillow one (they differ by a level
    # on some pixels), so the comparison asks for it, read from the same saved file
    theirs.image_processor = SiglipImageProcessorPil.from_pretrained(tmp_path)
    assert theirs.image_processor.size["height"] == 56
    expected = theirs(
        images=reference_images(),
        text=PROMPTS,
        suffix=SUFFIXES,
        padding="longest",
        padding_side="right",
        return_tensors="pt",
    )
    assert_same_batch(
        processor(make_images(), PROMPTS, SUFFIXES), expected, with_labels=True
    )


def test_from_pretrained_round_trip(tokenizer, tmp_path):
    PaliGemmaProcessor(tokenizer, image_size=56, num_image_tokens=16).save_pretrained(
        tmp_path
    )
    loaded = PaliGemmaProcessor.from_pretrained(tmp_path)
    assert (
        loaded.image_size,
        loaded.num_image_tokens,
        loaded.image_mean,
        loaded.image_std,
    ) == (56, 16, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert loaded.tokenizer.model_proto == tokenizer.model_proto


def test_from_pretrained_reads_a_folder_saved_by_transformers(layout, tmp_path):
    ours, folder = layout
    reference_processor(folder, 224, 256).save_pretrained(tmp_path)
    assert (tmp_path / "processor_config.json").is_file()
    with pytest.raises(FileNotFoundError, match="no tokenizer.model"):
        PaliGemmaProcessor.from_pretrained(tmp_path)
    ours.save(tmp_path / "tokenizer.model")
    loaded = PaliGemmaProcessor.from_pretrained(tmp_path)
    assert (loaded.image_size, loaded.num_image_tokens, loaded.image_token_id) == (
        224,
        256,
        ours.image_token_id,
    )


@pytest.mark.parametrize("where", ["top", "vision_config", "text_config"])
def test_contradicting_entries_of_config_json_are_an_error(tokenizer, tmp_path, where):
    "num_image_tokens anywhere in config.json must be (image_size / patch_size)^2"
    tokenizer.save(tmp_path / "tokenizer.model")
    config = {"vision_config": {"image_size": 448, "patch_size": 14}, "text_config": {}}
    (config if where == "top" else config[where])["num_image_tokens"] = 256
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"disagree on num_image_tokens.*1024.*256"):
        PaliGemmaProcessor.from_pretrained(tmp_path)


def test_from_pretrained_reads_config_json_and_checks_agreement(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.model")
    with pytest.raises(ValueError, match="found no image_size or num_image_tokens"):
        PaliGemmaProcessor.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "vision_config": {"image_size": 448, "patch_size": 14},
                "text_config": {"num_image_tokens": 1024},
            }
        )
    )
    loaded = PaliGemmaProcessor.from_pretrained(tmp_path)
    assert (loaded.image_size, loaded.num_image_tokens) == (448, 1024)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"image_seq_length": 256})
    )
    with pytest.raises(ValueError, match="disagree on num_image_tokens"):
        PaliGemmaProcessor.from_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 448}})
    )
    with pytest.raises(ValueError, match="resizes to a square"):
        PaliGemmaProcessor.from_pretrained(tmp_path)


# Location tokens


@pytest.mark.parametrize("width,height", [(224, 224), (640, 480), (97, 1000)])
def test_loc_round_trip_is_within_half_a_bin(width, height):
    rng = random.Random(0)
    boxes, labels = [], []
    for i in range(50):
        x0, x1 = sorted(rng.uniform(0, width) for _ in range(2))
        y0, y1 = sorted(rng.uniform(0, height) for _ in range(2))
        boxes.append((x0, y0, x1, y1))
        labels.append(f"object {i}")
    parsed = parse_loc_tokens(
        boxes_to_loc_string(boxes, width, height, labels), width, height
    )
    assert [label for _, label in parsed] == labels
    for (box, _), original in zip(parsed, boxes):
        for decoded, value, size in zip(box, original, (width, height, width, height)):
            assert abs(decoded - value) <= size / 2046 + 1e-9


def test_loc_string_is_y_first_with_1023_scaling():
    text = boxes_to_loc_string([(10, 20, 30, 40)], 100, 200, ["star"])
    bins = [
        round(20 / 200 * 1023),
        round(10 / 100 * 1023),
        round(40 / 200 * 1023),
        round(30 / 100 * 1023),
    ]
    assert text == "".join(f"<loc{b:04d}>" for b in bins) + " star"
    two = boxes_to_loc_string(
        torch.tensor([[0.0, 0.0, 100.0, 200.0], [50.0, 50.0, 60.0, 60.0]]),
        100,
        200,
        ["a", "b"],
    )
    assert two.startswith("<loc0000><loc0000><loc1023><loc1023> a ; <loc")
    # clipped to the image
    assert coordinate_to_bin(-5, 100) == 0 and coordinate_to_bin(150, 100) == 1023
    assert bin_to_coordinate(1023, 640) == 640.0


def test_parse_tolerates_segmentation_tokens_and_missing_labels():
    text = (
        "<loc0000><loc0000><loc1023><loc1023><seg001><seg127> the whole image ; "
        "<loc0512><loc0512><loc1023><loc1023>"
    )
    assert parse_loc_tokens(text, 100, 50) == [
        ((0.0, 0.0, 100.0, 50.0), "the whole image"),
        ((512 / 1023 * 100, 512 / 1023 * 50, 100.0, 50.0), ""),
    ]
    assert parse_loc_tokens("no boxes here <loc0001>", 10, 10) == []


@pytest.mark.parametrize(
    "boxes,labels,words",
    [
        ([(40, 8, 10, 38)], ["circle"], "max is below its min"),
        ([(1, 2, 3)], ["circle"], "a box is"),
        ([(1, 2, 3, 4)], ["a", "b"], "1 boxes and 2 labels"),
        ([(1, 2, 3, 4)], ["a ; b"], "contains ';'"),
    ],
)
def test_bad_boxes_are_clear_errors(boxes, labels, words):
    with pytest.raises(ValueError, match=words):
        boxes_to_loc_string(boxes, 100, 100, labels)


def test_draw_boxes():
    image = Image.new("RGB", (200, 100), "white")
    objects = parse_loc_tokens("<loc0256><loc0256><loc0768><loc0768> cat", 200, 100)
    # a <loc> bin is 1/1024 of the side: 200 px / 1024 ~ 0.2 px, the most a bin's
    # centre or edge convention can move a coordinate
    assert objects[0][1] == "cat" and objects[0][0] == pytest.approx(
        (50, 25, 150, 75), abs=0.2
    )
    drawn = draw_boxes(image, objects)
    assert drawn.getpixel((51, 50)) != (255, 255, 255) and drawn.getpixel(
        (100, 60)
    ) == (255, 255, 255)
    assert image.getpixel((51, 50)) == (255, 255, 255)  # the input is not drawn on


def test_draw_boxes_with_corners_swapped():
    "A model may write <locYMAX><locXMAX><locYMIN><locXMIN>: drawn as the same box"
    image = Image.new("RGB", (200, 100), "white")
    swapped = parse_loc_tokens("<loc0768><loc0768><loc0256><loc0256> cat", 200, 100)
    upright = parse_loc_tokens("<loc0256><loc0256><loc0768><loc0768> cat", 200, 100)
    assert swapped[0][0][0] > swapped[0][0][2]  # x0 > x1 as parsed
    assert draw_boxes(image, swapped).tobytes() == draw_boxes(image, upright).tobytes()
