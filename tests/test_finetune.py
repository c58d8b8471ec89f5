"""Chapter 12: the JSONL data format (paligemma_lib/finetune.py), every error it
reports, the CORD-v2 converter on hand-made rows, and a LoRA run through the training
loop on a JsonlDataset. Small images and a toy model: a few seconds, no network."""

import json
import math

import pytest
import torch
from PIL import Image

from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig
from paligemma_lib.data import Collator
from paligemma_lib.finetune import (
    DATA_FILE,
    MAX_REPORTED,
    JsonlDataset,
    JsonlError,
    cord_answer,
    cord_to_jsonl,
    find_jsonl,
    read_jsonl,
    write_jsonl,
)
from paligemma_lib.lora import LoraConfig, add_lora, lora_state_dict
from paligemma_lib.model_files import read_json, resolve_model_path
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.processing import PaliGemmaProcessor
from paligemma_lib.tokenization import GemmaTokenizer, default_tokenizer_path
from paligemma_lib.train import TrainConfig, train

TOKENIZER = GemmaTokenizer.from_file(default_tokenizer_path())
PROCESSOR = PaliGemmaProcessor(TOKENIZER, image_size=28, num_image_tokens=4)
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220)}


def triples(n=6):
    "(solid-colour image, prompt, colour name) for n examples"
    names = list(COLOURS)
    return [
        (Image.new("RGB", (28, 28), COLOURS[names[i % 3]]), "colour?", names[i % 3])
        for i in range(n)
    ]


@pytest.fixture
def folder(tmp_path):
    "A data folder of six examples, written by write_jsonl"
    write_jsonl(triples(), tmp_path / "data")
    return tmp_path / "data"


def write_lines(folder, lines):
    "Replace the folder's data.jsonl with these lines"
    (folder / DATA_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder / DATA_FILE


def line(image="images/000000.png", prefix="colour?", suffix="red", **extra):
    record = {"image": image, "prefix": prefix, "suffix": suffix, **extra}
    return json.dumps({k: v for k, v in record.items() if v is not None})


# --- the format ---


def test_write_then_read_gives_the_same_triples(folder):
    dataset = JsonlDataset(folder)
    assert len(dataset) == 6 and dataset.file == folder / DATA_FILE
    for (image, prompt, answer), (original, p, a) in zip(
        (dataset[i] for i in range(6)), triples()
    ):
        assert (prompt, answer) == (p, a) and image.mode == "RGB"
        assert image.tobytes() == original.tobytes()  # PNG: lossless
    assert JsonlDataset(folder / DATA_FILE).records == dataset.records
    assert dataset[-1][2] == dataset[5][2]
    with pytest.raises(IndexError, match="outside this data set of 6"):
        dataset[6]
    assert list(dataset)[0][1:] == ("colour?", "red")  # iteration stops cleanly


def test_paths_are_relative_to_the_jsonl_folder_or_absolute(folder):
    absolute = str(folder / "images" / "000001.png")
    write_lines(folder, [line(), line(image=absolute, suffix="green")])
    dataset = JsonlDataset(folder)
    assert [r[0] for r in dataset.records] == [
        folder / "images" / "000000.png",
        folder / "images" / "000001.png",
    ]


def test_blank_lines_extra_keys_and_a_byte_order_mark_are_fine(folder):
    text = "\n".join(["", line(note="kept aside"), "   ", line(suffix="a b")]) + "\n\n"
    (folder / DATA_FILE).write_bytes(b"\xef\xbb\xbf" + text.encode())
    dataset = JsonlDataset(folder)
    assert [dataset[i][2] for i in range(2)] == ["red", "a b"]


def test_images_of_any_mode_come_back_rgb(tmp_path):
    images = [
        Image.new("L", (20, 30), 128),
        Image.new("RGBA", (28, 28), (255, 0, 0, 0)),  # transparent: over white
        Image.new("P", (10, 10)),
    ]
    write_jsonl([(im, "p", "s") for im in images], tmp_path / "modes")
    dataset = JsonlDataset(tmp_path / "modes")
    assert [dataset[i][0].mode for i in range(3)] == ["RGB"] * 3
    assert dataset[0][0].size == (20, 30)
    assert dataset[1][0].getpixel((0, 0)) == (255, 255, 255)


def test_write_jsonl_copies_files_and_keeps_jpegs_as_jpegs(tmp_path):
    photo = tmp_path / "photo.jpeg"
    Image.new("RGB", (40, 30), (10, 200, 30)).save(photo, quality=80)
    decoded = Image.open(photo)
    write_jsonl([(photo, "a", "b"), (decoded, "c", "d")], tmp_path / "out")
    dataset = JsonlDataset(tmp_path / "out")
    first, second = (r[0] for r in dataset.records)
    assert first.name == "000000.jpeg" and first.read_bytes() == photo.read_bytes()
    assert second.name == "000001.jpg"
    assert dataset[1][0].tobytes() == dataset[0][0].tobytes()  # quality="keep"


def test_write_jsonl_refuses_bad_examples_and_a_used_folder(folder, tmp_path):
    with pytest.raises(JsonlError, match="already holds a .jsonl file"):
        write_jsonl(triples(1), folder)
    with pytest.raises(JsonlError, match=r'example 1: an empty "suffix"'):
        write_jsonl([*triples(1), (triples(1)[0][0], "p", "")], tmp_path / "empty")
    with pytest.raises(TypeError, match="example 0: the image is a int"):
        write_jsonl([(3, "p", "s")], tmp_path / "int")
    with pytest.raises(FileNotFoundError, match="no image at"):
        write_jsonl([(tmp_path / "missing.png", "p", "s")], tmp_path / "missing")


# --- every error names the file and the line, and says what to do ---


BAD_LINES = {
    "not json": ('{"image": "images/000000.png",', "not valid JSON", "one object"),
    "a list": ('["images/000000.png", "p", "s"]', "a JSON list, not an object", "one"),
    "a string": ('"images/000000.png"', "a JSON str, not an object", "such as"),
    "no image": (line(image=None), 'no "image" key', "needs"),
    "no prefix": (line(prefix=None), 'no "prefix" key', "needs"),
    "no suffix": (line(suffix=None), 'no "suffix" key', "needs"),
    "number": (line(suffix=12.4), '"suffix" is a float (12.4), not a string', "quotes"),
    "a list image": (line(image=["a.png"]), '"image" is a list', "quotes"),
    "empty": (line(suffix=""), 'an empty "suffix"', "remove the line"),
    "blank": (line(suffix=" \t"), 'an empty "suffix"', "write the answer"),
    "missing file": (line(image="images/gone.png"), "no image file", "relative to"),
    "a folder": (line(image="images"), "is a folder, not an image", "replace"),
    "not an image": (
        line(image="notes.png"),
        "not an image file Pillow can",
        "replace",
    ),
    "truncated": (line(image="cut.png"), "could not be decoded", "replace the image"),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_a_bad_line_is_reported_with_its_number(folder, case):
    (folder / "notes.png").write_text("not a picture")
    good = (folder / "images" / "000000.png").read_bytes()
    (folder / "cut.png").write_bytes(good[: len(good) // 2])
    bad, problem, remedy = BAD_LINES[case]
    file = write_lines(folder, [line(), line(suffix="green"), bad, line()])
    with pytest.raises(JsonlError) as caught:
        JsonlDataset(folder)
    message = str(caught.value)
    head, reported = message.splitlines()
    assert head == f"1 bad line(s) in {file}:"
    assert reported.startswith(f"{file}, line 3: ")
    assert problem in reported and remedy in reported


def test_all_bad_lines_are_listed_up_to_a_limit(folder):
    file = write_lines(folder, [line(suffix="")] * 3 + [line()] + ["{"] * 12)
    message = str(pytest.raises(JsonlError, JsonlDataset, folder).value)
    lines = message.splitlines()
    assert lines[0] == f"15 bad line(s) in {file}:"
    assert len(lines) == 1 + MAX_REPORTED + 1 and lines[-1] == "... and 5 more"
    assert [int(x.split(", line ")[1].split(":")[0]) for x in lines[1:-1]] == [
        1,
        2,
        3,
        *range(5, 12),
    ]


def test_the_folder_and_the_file_are_checked(folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="no data at .*nowhere"):
        JsonlDataset(tmp_path / "nowhere")
    with pytest.raises(JsonlError, match="it holds 0 .none."):
        find_jsonl(tmp_path / "data" / "images")
    (folder / "second.jsonl").write_text(line() + "\n")
    with pytest.raises(JsonlError, match=r"it holds 2 \(data.jsonl, second.jsonl\)"):
        JsonlDataset(folder)
    with pytest.raises(JsonlError, match="is not a .jsonl file"):
        JsonlDataset(folder / "images" / "000000.png")
    (folder / "empty.jsonl").write_text("\n\n")
    with pytest.raises(JsonlError, match="holds no examples"):
        read_jsonl(folder / "empty.jsonl")
    latin = line(suffix="cafe").replace("cafe", "caf\xe9").encode("latin-1")
    (folder / "latin.jsonl").write_bytes(latin)  # é is one byte, 0xe9: not UTF-8
    with pytest.raises(JsonlError, match="not UTF-8 text .* save it as UTF-8"):
        read_jsonl(folder / "latin.jsonl")


# --- lengths against the model's positions ---


def test_a_line_too_long_for_the_models_positions_is_refused(folder):
    file = write_lines(folder, [line(), line(suffix="red " * 100), line()])
    dataset = JsonlDataset(folder)  # no processor, no limit: not checked
    # the count checked is the length of the batch the collator makes
    long = Collator(PROCESSOR)([dataset[1]]).input_ids.shape[1]
    assert Collator(PROCESSOR)([dataset[0]]).input_ids.shape[1] < long
    # at the limit it fits; one position fewer and it is refused, by exactly one
    assert len(JsonlDataset(folder, PROCESSOR, long)) == 3
    with pytest.raises(JsonlError) as caught:
        JsonlDataset(folder, PROCESSOR, long - 1)
    head, reported = str(caught.value).splitlines()
    assert head == f"1 bad line(s) in {file}:"
    assert reported.startswith(f"{file}, line 2: {long} tokens, 1 over the model's")
    assert f"{long - 1} positions (max_position_embeddings)" in reported
    assert f"{PROCESSOR.num_image_tokens} image tokens" in reported
    assert "shorten the suffix or the prefix, or remove the line" in reported


def test_the_nano_model_refuses_a_2000_character_answer(folder):
    "The audit's case: 512 positions, 196 of them image tokens"
    processor = PaliGemmaProcessor.from_pretrained("nano")
    limit = read_json(resolve_model_path("nano") / "config.json")["text_config"][
        "max_position_embeddings"
    ]
    write_lines(folder, [line(), line(suffix="1.00 " * 400)])
    with pytest.raises(JsonlError, match=f"line 2: .* over the model's {limit} "):
        JsonlDataset(folder, processor, limit)


def test_the_length_check_needs_both_the_processor_and_the_limit(folder):
    for args in [(PROCESSOR, None), (None, 512)]:
        with pytest.raises(ValueError, match="give both processor and max_positions"):
            JsonlDataset(folder, *args)


# --- CORD-v2 ---


def cord_truth(total="60.000", menu=None, **total_extra) -> str:
    parse = {"menu": menu or [{"nm": "ICED TEA", "cnt": "2", "price": "30.000"}]}
    if total is not None:
        parse["total"] = {"total_price": total, **total_extra}
    return json.dumps({"gt_parse": parse, "meta": {}, "valid_line": []})


def test_cord_answer_is_the_total_as_printed():
    assert cord_answer(cord_truth()) == '{"total":"60.000"}'
    assert cord_answer(json.loads(cord_truth(" Rp 45,500 "))) == '{"total":"Rp 45,500"}'
    single = cord_truth(menu={"nm": "MIE", "cnt": "1", "price": "5.000"})
    assert cord_answer(single) == '{"total":"60.000"}'
    assert cord_answer(cord_truth(None)) is None
    assert cord_answer(cord_truth(["1.000", "2.000"])) is None  # labelled twice
    assert cord_answer(cord_truth("  ")) is None
    for wrong in ("{}", '{"gt_parse": []}', "[1]"):
        with pytest.raises(ValueError, match="is this a row of naver-clova-ix/cord"):
            cord_answer(wrong)


def test_cord_to_jsonl_writes_a_folder_the_dataset_reads(tmp_path):
    photo = tmp_path / "receipt.jpg"
    Image.new("RGB", (60, 90), (240, 236, 225)).save(photo)
    rows = [
        {"image": Image.open(photo), "ground_truth": cord_truth("12.000")},
        {"image": Image.open(photo), "ground_truth": cord_truth(None)},
        {"image": Image.new("RGB", (30, 30)), "ground_truth": cord_truth("7,5")},
    ]
    summary = cord_to_jsonl(rows, tmp_path / "cord")
    assert summary == {"written": 2, "skipped": [1]}
    dataset = JsonlDataset(tmp_path / "cord")
    assert [dataset[i][1:] for i in range(2)] == [
        ("extract json", '{"total":"12.000"}'),
        ("extract json", '{"total":"7,5"}'),
    ]
    assert [r[0].suffix for r in dataset.records] == [".jpg", ".png"]
    with pytest.raises(ValueError, match="CORD row 1 is not a dict with 'image'"):
        cord_to_jsonl([rows[0], {"image": None}], tmp_path / "cord2")
    with pytest.raises(ValueError, match="CORD row 0: ground_truth has no gt_parse"):
        cord_to_jsonl([{"image": None, "ground_truth": "{}"}], tmp_path / "cord3")


# --- training on it ---


def toy_model(seed=0):
    torch.manual_seed(seed)
    config = PaliGemmaConfig(
        vision=VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, image_size=28, patch_size=14),
        text=TextConfig(vocab_size=len(TOKENIZER), hidden_size=16,
                        intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8),
        image_token_index=TOKENIZER.image_token_id,
        projection_dim=16,
    )  # fmt: skip
    return PaliGemmaForConditionalGeneration(config)


def test_the_collator_batches_a_jsonl_dataset(folder):
    dataset = JsonlDataset(folder)
    batch = Collator(PROCESSOR)([dataset[i] for i in range(3)])
    assert batch.pixel_values.shape == (3, 3, 28, 28)
    answers = [
        PROCESSOR.decode(ids[labels != -100])
        for ids, labels in zip(batch.input_ids, batch.labels)
    ]
    assert answers == ["red", "green", "blue"]


def lora_run(folder, seed=0):
    model = toy_model(seed)
    add_lora(model, LoraConfig(r=4))
    base = {
        n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n
    }
    adapter = {n: t.clone() for n, t in lora_state_dict(model).items()}
    config = TrainConfig(steps=2, batch_size=2, lr=1e-2, warmup_steps=0)
    history = train(
        model, JsonlDataset(folder), Collator(PROCESSOR), config, progress=False
    )
    return model, base, adapter, history


def test_two_lora_steps_on_a_jsonl_dataset_move_only_the_adapter(folder):
    torch.set_num_threads(1)
    model, base, adapter, history = lora_run(folder)
    assert len(history["loss"]) == 2 and all(math.isfinite(x) for x in history["loss"])
    for name, p in model.named_parameters():
        if "lora_" not in name:
            # bit for bit: a frozen tensor is never written, so no rounding can enter
            assert torch.equal(p, base[name]), name
            assert not p.requires_grad
    after = lora_state_dict(model)
    assert after.keys() == adapter.keys() and adapter
    assert all(not torch.equal(after[n], adapter[n]) for n in adapter)
    # bit for bit, as determinism is the point: the same seed, data, kernels and thread
    # count (1, set above) in one process give the same sums in the same order
    again = lora_state_dict(lora_run(folder)[0])
    assert all(torch.equal(again[n], after[n]) for n in after)
