"""Chapter 11's synthetic worlds (paligemma_lib.data) against their specification."""

import hashlib
import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from datetime import date

import numpy as np
import pytest
import torch
from PIL import Image, ImageChops, ImageDraw

import paligemma_lib.real_images  # noqa: F401, E402  (adds clothing, handwriting)
import paligemma_lib.real_recipes  # noqa: F401, E402  (adds naming, pen)
import paligemma_lib.segment_recipes  # noqa: F401, E402  (adds boxes)
import paligemma_lib.segmentation  # noqa: F401, E402  (adds the segments world)
import paligemma_lib.small_detail  # noqa: F401, E402  (adds detail)
from paligemma_lib.boxes import parse_loc_tokens
from paligemma_lib.data import (
    COLOURS,
    GAP,
    IMAGE_SIZE,
    ITEMS,
    KINDS,
    MARGIN,
    MIX_OFFSET,
    OCR_ALPHABET,
    SEEDS_PER_WORLD,
    SIDES,
    SPLITS,
    STORES,
    TASKS,
    WORLD_OFFSETS,
    WORLDS,
    Collator,
    Example,
    SyntheticDataset,
    add_world,
    box_gap,
    layout_receipt,
    load_font,
    make_example,
    place_boxes,
    place_text,
)
from paligemma_lib.processing import PaliGemmaBatch, PaliGemmaProcessor
from paligemma_lib.tokenization import GemmaTokenizer, default_tokenizer_path

SEEDS = SPLITS["validation"][:300]
COLOUR = "(?:red|green|blue|yellow)"
KIND = "(?:circle|square|triangle)"
OBJECT = f"a {COLOUR} {KIND}"
LOC4 = "(?:<loc\\d{4}>){4}"
ANSWER = {
    "caption": re.compile(f"{OBJECT}(?:(?:, {OBJECT})? and {OBJECT})?"),
    "count": re.compile("[123]"),
    "colour": re.compile(COLOUR),
    "ocr": re.compile("[A-Z0-9]([A-Z0-9]*[. ]?[A-Z0-9]*)?[A-Z0-9]"),
    "extract": re.compile(
        '\\{"store":"(?:' + "|".join(STORES) + ')","date":"\\d{4}-\\d{2}-\\d{2}",'
        '"total":"[1-9]?\\d\\.\\d{2}"\\}'
    ),
}
PROMPT = {
    "caption": re.compile("caption en"),
    "count": re.compile("answer en how many shapes are there\\?"),
    "colour": re.compile(f"answer en what color is the ({KIND})\\?"),
    "detect": re.compile(f"detect ({KIND})"),
    "ocr": re.compile("ocr"),
    "extract": re.compile("extract json"),
}


@pytest.fixture(scope="module")
def shapes():
    return [make_example("shapes", s) for s in SEEDS]


@pytest.fixture(scope="module")
def ocr():
    return [make_example("ocr", s) for s in SEEDS]


@pytest.fixture(scope="module")
def receipts():
    return [make_example("receipts", s) for s in SEEDS[:150]]


def ink_box(image, level):
    "Box (x0, y0, x1, y1), pixel edges, around the pixels that differ from grey `level`"
    plain = Image.new("RGB", image.size, (level,) * 3)
    return ImageChops.difference(image, plain).getbbox()


def drawn(text, size, bold, background, ink):
    "`text` drawn alone with the library's font: the pixels of its ink box, an array"
    font = load_font(size, bold)
    left, top, right, bottom = font.getbbox(text)
    image = Image.new("L", (right - left + 8, bottom - top + 8), background)
    ImageDraw.Draw(image).text((4 - left, 4 - top), text, fill=ink, font=font)
    return np.asarray(image.crop(ink_box(image.convert("RGB"), background)))


def found_at(pixels, patch, x, rows):
    "The row y in `rows` where `patch` equals pixels[y:, x:] exactly, or None"
    h, w = patch.shape
    for y in rows:
        if x >= 0 and (pixels[y : y + h, x : x + w] == patch).all():
            return y
    return None


# seeds and splits


def test_splits_are_disjoint_and_inside_a_world():
    ranges = sorted(SPLITS.values(), key=lambda r: r.start)
    assert all(a.stop <= b.start for a, b in zip(ranges, ranges[1:]))
    assert ranges[-1].stop <= SEEDS_PER_WORLD
    assert set(SPLITS) == {"train", "validation", "test"}


def test_worlds_and_mixing_never_share_a_generator_seed():
    starts = sorted([*WORLD_OFFSETS.values(), MIX_OFFSET])
    # chapters 12.1, 12.2 and 11.4
    later = {"segments", "boxes", "clothing", "handwriting", "naming", "pen", "detail"}
    assert set(WORLD_OFFSETS) == {*WORLDS, *later}
    assert all(b - a >= SEEDS_PER_WORLD for a, b in zip(starts, starts[1:]))


def test_add_world_refuses_seeds_another_world_uses():
    def maker(rng, seed, task):
        return make_example("shapes", seed, task)

    for offset in (
        0,
        WORLD_OFFSETS["ocr"] + 5,
        MIX_OFFSET,
        WORLD_OFFSETS["segments"] - 1,
    ):
        with pytest.raises(ValueError, match="overlap"):
            add_world("stars", maker, ("caption",), offset)
    with pytest.raises(ValueError, match="unknown world.*segments world comes with"):
        SyntheticDataset("stars")
    with pytest.raises(ValueError, match="no worlds"):
        SyntheticDataset({})


def test_seed_outside_the_range_is_an_error():
    for seed in (-1, SEEDS_PER_WORLD, 1.5):
        with pytest.raises(ValueError, match="must be an int"):
            make_example("shapes", seed)
    with pytest.raises(ValueError, match="unknown world"):
        make_example("stars", 0)
    with pytest.raises(ValueError, match="has no task 'ocr'"):
        make_example("shapes", 0, task="ocr")
    assert make_example("ocr", np.int64(7)) == make_example("ocr", 7)  # numpy's ints


def fingerprint(seeds=range(4)):
    digest = hashlib.sha256()
    for world in WORLDS:
        for s in seeds:
            ex = make_example(world, s)
            digest.update(ex.image.tobytes() + f"{ex.prompt}\n{ex.answer}".encode())
    return digest.hexdigest()


def test_same_seed_same_example_whatever_the_global_generators():
    first = fingerprint()
    random.seed(1)
    torch.manual_seed(1)
    random.random()
    assert fingerprint() == first


def test_same_pixels_in_another_process():
    "A fresh interpreter with another string-hash salt draws the same pixels"
    code = "from tests.test_data import fingerprint; print(fingerprint())"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=root,
    )
    assert out.stdout.strip() == fingerprint()


# The SHA-256 of the raw pixels of three examples of each world, computed with
# Pillow 12.3.0 and FreeType 2.14.3 (Python 3.11). They pin the data: random.Random's
# randint/choice/sample/choices are stable in practice but not documented so, and text
# is anti-aliased by FreeType. A Pillow or FreeType upgrade can legitimately change
# these pixels (the text's edges, how Pillow rasterises an ellipse): then look at the
# images, and update the hashes knowing that the data, and so a model trained on it,
# changed.
PIXELS = {
    ("shapes", 0): "52d05abd7ddaba1275b3ecfdf8a7694af15ecf894bec4f8859370e48054d4ccd",
    ("shapes", 1): "aeb2a591200591104ee27a210e853d8ca3b186e2e277ebac5dcef3c7f62459f9",
    ("shapes", 10**9 + 10**4): (
        "f59965ad2131a6151bb5526deca8a18ee12a28a3bd52472d03bccb2b300134d9"
    ),
    ("ocr", 0): "50af80dd889bb2c6e966e546dce7c7aadb5fbcb077162f831045b5b3aebb9eef",
    ("ocr", 1): "4274e798a45890e9222355031bc8f4650ef2650ea118aac56ea9243c949b7b5b",
    ("ocr", 10**9 + 10**4): (
        "87eff4b789491637e977408f7edf994dca37f13716a59361b410598d7ed13f8e"
    ),
    ("receipts", 0): "0f2d13f0b438c9d888635560a3a2783f5e6cfa3ebc85b57f1a5dd5838d5c5aa5",
    ("receipts", 1): "2ae7b398efb015ebb7c064f347cc2d0b57591c972829d2762efc1ab31a237080",
    ("receipts", 10**9 + 10**4): (
        "6be631e7e2b47df78d79fd480de3b0251ef1c34c40ecaafba785af8eb64090e5"
    ),
}


def test_pixels_are_pinned():
    for (world, seed), expected in PIXELS.items():
        pixels = make_example(world, seed).image.tobytes()
        assert hashlib.sha256(pixels).hexdigest() == expected, (world, seed)


# hand-checked examples: the first test images, looked at in chapter 11's grid


def test_hand_checked_examples():
    test = SPLITS["test"]
    ex = make_example("shapes", test[2])
    assert (ex.task, ex.prompt, ex.answer) == (
        "count",
        "answer en how many shapes are there?",
        "2",
    )
    assert ex.labels == ["green circle", "red triangle"]
    assert ex.boxes == [(58, 107, 124, 173), (78, 14, 144, 80)]
    ex = make_example("shapes", test[3])
    assert (ex.prompt, ex.answer) == (
        "caption en",
        "a yellow circle and a yellow square",
    )
    ex = make_example("shapes", test[5])
    assert ex.prompt == "detect circle"
    assert ex.answer == (
        "<loc0603><loc0224><loc0950><loc0571> circle ; "
        "<loc0434><loc0685><loc0694><loc0945> circle"
    )
    assert ex.labels == ["yellow circle", "red circle", "green square"]
    ex = make_example("shapes", test[7])
    assert (ex.prompt, ex.answer) == ("answer en what color is the triangle?", "blue")
    assert [make_example("ocr", test[i]).answer for i in (0, 2)] == ["OBI7", "YFU23PK"]
    ex = make_example("receipts", test[0])
    assert ex.prompt == "extract json"
    assert ex.answer == '{"store":"DAILY DELI","date":"2024-12-05","total":"53.97"}'
    assert (
        ex.text
        == "DAILY DELI\n2024-12-05\nSOAP 19.21\nTEA 14.94\nAPPLES 19.82\nTOTAL 53.97"
    )


# the shapes world


def test_shapes_canvas_boxes_and_order(shapes):
    for ex in shapes:
        assert ex.image.size == (IMAGE_SIZE, IMAGE_SIZE) and ex.image.mode == "RGB"
        level = ex.image.getpixel((0, 0))[0]
        assert 210 <= level <= 250
        assert 1 <= len(ex.boxes) == len(ex.labels) == len(set(ex.labels)) <= 3
        for i, (x0, y0, x1, y1) in enumerate(ex.boxes):
            assert x1 - x0 == y1 - y0 and SIDES[0] <= x1 - x0 <= SIDES[1]
            assert min(x0, y0) >= MARGIN and max(x1, y1) <= IMAGE_SIZE - MARGIN
            for b in ex.boxes[:i]:
                assert box_gap(ex.boxes[i], b) >= GAP
        order = [((b[0] + b[2]) / 2, b[1]) for b in ex.boxes]
        assert order == sorted(order)  # by the centre's x, on a tie top to bottom


def test_order_ties_are_top_to_bottom():
    "Boxes with the same centre x (stacked) are listed top to bottom"
    ex = make_example("shapes", 577)  # a train seed: a red square above a triangle
    assert ex.boxes == [(53, 4, 133, 84), (66, 106, 120, 160)]  # centre x 93 both
    assert ex.answer == "a red square and a yellow triangle"
    ex = make_example("shapes", 733, task="detect")
    assert ex.boxes[:2] == [(85, 35, 154, 104), (80, 130, 159, 209)]  # centre x 119.5
    assert ex.labels == ["blue triangle", "blue square", "red triangle"]
    assert ex.answer == "<loc0594><loc0365><loc0954><loc0726> square"
    ex = make_example("shapes", 733, task="caption")
    assert ex.answer == "a blue triangle, a blue square and a red triangle"


def test_shapes_pixels_are_background_or_the_shapes_colour(shapes):
    for ex in shapes[:100]:
        level = ex.image.getpixel((0, 0))[0]
        outside = ex.image.copy()
        for (x0, y0, x1, y1), label in zip(ex.boxes, ex.labels):
            colour, kind = label.split()
            crop = ex.image.crop((x0, y0, x1, y1))
            colours = {COLOURS[colour]} | (
                {(level,) * 3} if kind != "square" else set()
            )
            assert {c for _, c in crop.getcolors()} == colours
            # the shape touches its box on every side
            assert ink_box(crop, level) == (0, 0, x1 - x0, y1 - y0)
            centre = ((x0 + x1) // 2, (y0 + y1) // 2)
            assert ex.image.getpixel(centre) == COLOURS[colour]
            corner_colour = ex.image.getpixel((x0, y0))
            assert (corner_colour == COLOURS[colour]) == (kind == "square")
            if kind == "triangle":  # apex: the top centre; base: the box's bottom row
                top = np.flatnonzero((np.asarray(crop)[0] == COLOURS[colour]).all(-1))
                assert len(top) and set(top + x0) <= {
                    (x0 + x1 - 1) // 2,
                    (x0 + x1) // 2,
                }
                bottom = crop.crop((0, y1 - y0 - 1, x1 - x0, y1 - y0))
                assert bottom.getcolors() == [(x1 - x0, COLOURS[colour])]
            outside.paste((level,) * 3, (x0, y0, x1, y1))
        assert outside.getcolors() == [(IMAGE_SIZE**2, (level,) * 3)]


def test_shapes_answers(shapes):
    for ex in shapes:
        assert ex.world == "shapes" and ex.task in TASKS["shapes"]
        match = PROMPT[ex.task].fullmatch(ex.prompt)
        assert match, ex.prompt
        kinds = [label.split()[1] for label in ex.labels]
        if ex.task == "caption":
            assert ANSWER["caption"].fullmatch(ex.answer)
            objects = [f"a {label}" for label in ex.labels]
            expected = {
                1: "{}",
                2: "{} and {}",
                3: "{}, {} and {}",
            }[len(objects)].format(*objects)
            assert ex.answer == expected
        elif ex.task == "count":
            assert ex.answer == str(len(ex.boxes))
        elif ex.task == "colour":
            kind = match.group(1)
            assert kinds.count(kind) == 1, "asked only when the kind is unique"
            assert ANSWER["colour"].fullmatch(ex.answer)
            assert f"{ex.answer} {kind}" in ex.labels
        else:
            kind = match.group(1)
            n = kinds.count(kind)
            assert n >= 1
            assert re.fullmatch(
                f"{LOC4} {kind}(?: ; {LOC4} {kind}){{{n - 1}}}", ex.answer
            )


def test_detect_boxes_parse_back_within_half_a_bin(shapes):
    half_bin = IMAGE_SIZE / 2046
    detections = [ex for ex in shapes if ex.task == "detect"]
    assert len(detections) > 50
    for ex in detections:
        kind = ex.prompt.split()[1]
        truth = [b for b, label in zip(ex.boxes, ex.labels) if label.endswith(kind)]
        parsed = parse_loc_tokens(ex.answer, IMAGE_SIZE, IMAGE_SIZE)
        assert [label for _, label in parsed] == [kind] * len(truth)
        for (box, _), true_box in zip(parsed, truth):
            assert max(abs(a - b) for a, b in zip(box, true_box)) <= half_bin + 1e-9


def test_colour_question_never_without_a_unique_kind():
    for s in range(2000):
        ex = make_example("shapes", s)
        kinds = [label.split()[1] for label in ex.labels]
        if not any(kinds.count(k) == 1 for k in KINDS):
            assert ex.task != "colour"
            forced = make_example("shapes", s, task="colour")  # the next scene
            kind = forced.prompt.split()[-1][:-1]
            assert [label.split()[1] for label in forced.labels].count(kind) == 1
            return
    raise AssertionError("no scene without a unique kind in 2000 seeds")


def test_task_chosen_uniformly_and_asking_for_it_changes_nothing(shapes):
    counts = Counter(ex.task for ex in shapes)
    assert set(counts) == set(TASKS["shapes"])
    assert all(50 <= c <= 100 for c in counts.values()), counts  # ~75 each of 300
    for ex in shapes[:40]:
        assert make_example("shapes", ex.seed, task=ex.task) == ex
    counts = Counter(len(ex.boxes) for ex in shapes)
    assert all(70 <= c <= 130 for c in counts.values()), counts


def test_place_boxes_gives_up_with_a_clear_error():
    rng = random.Random(0)
    for _ in range(100):
        try:
            place_boxes(rng, 3, tries=1)
        except RuntimeError as e:
            assert "no layout of 3 boxes" in str(e) and "1 tries" in str(e)
            return
    raise AssertionError("no 3-box layout failed in 100 single tries")


# the OCR world


def test_ocr_text_is_in_the_alphabet_and_fully_visible(ocr):
    separators = Counter()
    for ex in ocr:
        assert ex.task == "ocr" and ex.prompt == "ocr" and ex.answer == ex.text
        assert 2 <= len(ex.answer) <= 8 and ANSWER["ocr"].fullmatch(ex.answer)
        assert set(ex.answer) <= set(OCR_ALPHABET + ". ")
        inner = [c for c in ex.answer if c in ". "]
        assert len(inner) <= 1
        separators[inner[0] if inner else ""] += 1
        level = ex.image.getpixel((0, 0))[0]
        assert 225 <= level <= 255
        ink = ink_box(ex.image, level)
        assert ink is not None, "the text is drawn"
        (bx0, by0, bx1, by1) = ex.boxes[0]
        assert bx0 <= ink[0] and by0 <= ink[1] and ink[2] <= bx1 and ink[3] <= by1
        assert min(bx0, by0) >= MARGIN and max(bx1, by1) <= IMAGE_SIZE - MARGIN
        darkest = min(c[0] for _, c in ex.image.getcolors(IMAGE_SIZE**2))
        assert darkest <= 60
    assert separators[""] > separators["."] > 30 and separators[" "] > 30


def test_ocr_pixels_are_the_line_drawn_at_24_to_40_px(ocr):
    "The image is the background and the text drawn once, in grey ink, at one size"
    sizes = Counter()
    for ex in ocr[:100]:
        pixels = np.asarray(ex.image).astype(int)
        assert (pixels == pixels[..., :1]).all()  # grey: R = G = B everywhere
        pixels = pixels[..., 0]
        background, ink = int(pixels[0, 0]), int(pixels.min())
        assert 225 <= background <= 255 and 0 <= ink <= 60
        x0, y0, x1, y1 = ink_box(ex.image, background)
        inked = pixels[y0:y1, x0:x1]  # outside it, all background: uniform
        matches = [
            size
            for size in range(20, 45)  # wider than 24-40, to see a size outside
            if (patch := drawn(ex.text, size, False, background, ink)).shape
            == inked.shape
            and (patch == inked).all()
        ]
        assert len(matches) == 1 and 24 <= matches[0] <= 40, (ex.seed, matches)
        sizes[matches[0]] += 1
    assert min(sizes) <= 26 and max(sizes) >= 38  # the range is used


def test_text_too_wide_is_an_error_not_a_clip():
    with pytest.raises(ValueError, match="would be clipped"):
        place_text(random.Random(0), "W" * 12, load_font(40))


# the receipts world


def test_receipts_answer_is_exact_json(receipts):
    for ex in receipts:
        assert ex.task == "extract" and ex.prompt == "extract json"
        assert ANSWER["extract"].fullmatch(ex.answer), ex.answer
        fields = json.loads(ex.answer)
        assert list(fields) == ["store", "date", "total"] and fields == ex.fields
        assert ex.answer == json.dumps(fields, separators=(",", ":"))
        lines = ex.text.split("\n")
        assert lines[0] == fields["store"] in STORES
        assert lines[1] == fields["date"]
        year, month, day = map(int, fields["date"].split("-"))
        assert 2020 <= year <= 2026 and date(year, month, day)  # a real date
        items = [line.rsplit(" ", 1) for line in lines[2:-1]]
        assert 1 <= len(items) <= 3 and len({n for n, _ in items}) == len(items)
        assert all(n in ITEMS and 50 <= round(float(p) * 100) <= 2999 for n, p in items)
        cents = sum(int(p.replace(".", "")) for _, p in items)
        assert fields["total"] == f"{cents // 100}.{cents % 100:02d}"
        assert lines[-1] == f"TOTAL {fields['total']}"


def test_receipts_canvas_and_ink(receipts):
    for ex in receipts:
        level = ex.image.getpixel((0, 0))[0]
        assert 245 <= level <= 255
        x0, y0, x1, y1 = ink_box(ex.image, level)
        assert min(x0, y0) >= MARGIN and max(x1, y1) <= IMAGE_SIZE - MARGIN
        assert (0, 0, 0) in {c for _, c in ex.image.getcolors(IMAGE_SIZE**2)}


def test_receipts_lines_drawn_bold_or_regular_at_one_size_prices_aligned(receipts):
    """Each line is found in the image, drawn again with the library's font: the store
    and TOTAL in bold, the others regular, all at one size of 18-20 px; the prices'
    right ink edges align; and nothing else is drawn"""
    candidates = [(size, bold) for size in range(15, 24) for bold in (False, True)]
    sizes = Counter()
    for ex in receipts[:60]:
        pixels = np.asarray(ex.image)[..., 0].astype(int)
        background = int(pixels[0, 0])
        rows = (pixels != background).any(axis=1)  # a line: a band of rows with ink
        starts = np.flatnonzero(np.diff(rows.astype(int), prepend=0) == 1)
        ends = np.flatnonzero(np.diff(rows.astype(int), append=0) == -1) + 1
        lines = ex.text.split("\n")
        assert len(starts) == len(lines), ex.seed
        rest, found, rights = pixels.copy(), set(), []
        for i, (line, y0, y1) in enumerate(zip(lines, starts, ends)):
            texts = [line] if i < 2 else line.rsplit(" ", 1)  # (left, price)
            columns = np.flatnonzero((pixels[y0:y1] != background).any(axis=0))
            matches = []
            for size, bold in candidates:
                spots = []
                for j, text in enumerate(texts):
                    patch = drawn(text, size, bold, background, 0)
                    x = columns[0] if j == 0 else columns[-1] + 1 - patch.shape[1]
                    y = found_at(pixels, patch, x, range(y0, y1 - patch.shape[0] + 1))
                    spots.append(None if y is None else (x, y, patch.shape))
                if None not in spots:
                    matches.append((size, bold, spots))
            assert len(matches) == 1, (ex.seed, line, [m[:2] for m in matches])
            size, bold, spots = matches[0]
            assert bold == (i == 0 or i == len(lines) - 1), (ex.seed, line)
            found.add(size)
            for x, y, (h, w) in spots:
                rest[y : y + h, x : x + w] = background
            if i >= 2:
                rights.append(columns[-1] + 1)
        assert len(found) == 1 and 18 <= min(found) <= 20, (ex.seed, found)
        sizes[min(found)] += 1
        assert max(rights) - min(rights) <= 1, (ex.seed, rights)  # right-aligned
        assert (rest == background).all()  # nothing else drawn: a uniform background
    assert set(sizes) == {18, 19, 20}


def test_receipt_line_too_wide_is_redrawn_not_clipped():
    assert layout_receipt([("A VERY LONG STORE NAME", "", True)], 20, 8, 8) is None
    assert layout_receipt([("BREAD", "1.00", False)], 20, 8, 8) is not None
    tallest = [("GREEN GROCER", "", True), ("2020-12-31", "", False)]
    tallest += [("YOGURT", "29.99", False)] * 3 + [("TOTAL", "89.97", True)]
    for size in (18, 19, 20):  # the worst case fits at every size
        assert layout_receipt(tallest, size, 16, IMAGE_SIZE - 8 - 6 * (size + 6))


# tokens


def test_answers_and_prompts_need_no_unknown_piece():
    tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
    longest = Counter()
    for world in WORLDS:
        for s in SEEDS[:200]:
            ex = make_example(world, s)
            for what, text in (("prompt", ex.prompt), ("answer", ex.answer)):
                ids = tokenizer.encode(text, add_bos=False)
                assert tokenizer.unk_id not in ids and tokenizer.decode(ids) == text
                longest[world, what] = max(longest[world, what], len(ids))
    assert max(longest[w, "prompt"] for w in WORLDS) <= 14
    assert max(longest[w, "answer"] for w in WORLDS) <= 45


# Dataset and Collator


def test_dataset_items_and_mixing():
    mix = SyntheticDataset({"ocr": 0.3, "shapes": 0.7}, split="validation", size=400)
    assert len(mix) == 400 and mix.worlds == ["shapes", "ocr"]
    image, prompt, answer = mix[0]
    assert isinstance(image, Image.Image) and isinstance(prompt, str)
    assert isinstance(answer, str)
    worlds = Counter(mix.world(i) for i in range(len(mix)))
    assert 240 <= worlds["shapes"] <= 320 and worlds["shapes"] + worlds["ocr"] == 400
    for i in range(10):
        ex = mix.example(i)
        assert isinstance(ex, Example) and ex.seed == SPLITS["validation"][i]
        assert ex == make_example(mix.world(i), SPLITS["validation"][i])
    assert mix.example(-1) == mix.example(399)
    # same weights in another order: the same data set
    same = SyntheticDataset({"shapes": 0.7, "ocr": 0.3}, split="validation", size=400)
    assert [same.world(i) for i in range(50)] == [mix.world(i) for i in range(50)]


def test_dataset_task_and_errors():
    detect = SyntheticDataset("shapes", split="test", size=20, task="detect")
    assert all(detect.example(i).task == "detect" for i in range(20))
    assert len(SyntheticDataset("ocr", split="test")) == len(SPLITS["test"])
    with pytest.raises(IndexError):
        detect[20]
    with pytest.raises(ValueError, match="unknown world"):
        SyntheticDataset({"stars": 1.0})
    with pytest.raises(ValueError, match="positive"):
        SyntheticDataset({"shapes": 1.0, "ocr": 0.0})
    with pytest.raises(ValueError, match="unknown split"):
        SyntheticDataset("shapes", split="dev")
    with pytest.raises(ValueError, match="seeds"):
        SyntheticDataset("shapes", split="test", size=10**5)
    with pytest.raises(ValueError, match="single world"):
        SyntheticDataset({"shapes": 1, "ocr": 1}, task="ocr")


def test_collator_labels_only_on_the_answers():
    processor = PaliGemmaProcessor(GemmaTokenizer.from_file(default_tokenizer_path()))
    data = SyntheticDataset({"shapes": 0.5, "ocr": 0.5}, split="validation", size=6)
    loader = torch.utils.data.DataLoader(
        data, batch_size=6, collate_fn=Collator(processor)
    )
    batch = next(iter(loader))
    assert isinstance(batch, PaliGemmaBatch)
    B, S = batch.input_ids.shape
    assert B == 6 and batch.pixel_values.shape == (6, 3, 224, 224)
    for b in range(B):
        _, prompt, answer = data[b]
        prefix = processor.encode_prefix(prompt)
        suffix = processor.encode_suffix(answer)
        n = len(prefix) + len(suffix)
        assert batch.input_ids[b, :n].tolist() == prefix + suffix
        assert (batch.labels[b, : len(prefix)] == -100).all()
        assert batch.labels[b, len(prefix) : n].tolist() == suffix
        assert (batch.labels[b, n:] == -100).all()
        assert batch.attention_mask[b].tolist() == [1] * n + [0] * (S - n)  # right
        assert batch.token_type_ids[b].tolist() == (
            [0] * len(prefix) + [1] * len(suffix) + [0] * (S - n)
        )
    assert batch.attention_mask[:, -1].any()  # padded to the longest, no further
    with pytest.raises(ValueError, match="empty batch"):
        Collator(processor)([])
    with pytest.raises(ValueError):
        Collator(processor, max_length=processor.num_image_tokens + 3)([data[0]])


def test_a_data_set_may_start_past_the_splits_first_index():
    "start=k: example i is example k + i of the split, the same triple"
    from paligemma_lib.data import SPLITS, SyntheticDataset

    window = SyntheticDataset("ocr", "test", size=3, start=7)
    whole = SyntheticDataset("ocr", "test", size=10)
    for i in range(3):
        assert window.example(i).seed == SPLITS["test"][7 + i]
        assert window[i][1:] == whole[7 + i][1:]
    assert "start=7" in repr(window)
    with pytest.raises(ValueError, match="from index 9999"):
        SyntheticDataset("ocr", "validation", size=2, start=9999)
