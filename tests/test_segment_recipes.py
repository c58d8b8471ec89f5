"""Issue 49 §3, chapter 12.1's "The boxes first": the boxes world (the segments world's
scenes asked `detect <kind>`, under seeds of its own) and the GPU segment part's recipe
`boxes` that mixes it in (parsed by the train command's own parser)."""

import argparse
import re
import sys
from pathlib import Path
from unittest import mock

import pytest

from paligemma_lib.data import (
    SPLITS,
    TASKS,
    WORLD_OFFSETS,
    SyntheticDataset,
    example_rng,
)
from paligemma_lib.segment_recipes import BOXES_OFFSET
from paligemma_lib.segmentation import (
    SCENE_OFFSET,
    MaskVAE,
    _draw_scene,
    load_mask_vae,
    segment_answer,
    shipped_mask_vae_path,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_run  # noqa: E402


def test_the_boxes_world_has_seeds_and_a_task_of_its_own():
    assert WORLD_OFFSETS["boxes"] == BOXES_OFFSET == 106 * 10**10
    assert TASKS["boxes"] == ("detect",)
    others = [o for w, o in WORLD_OFFSETS.items() if w != "boxes"]
    assert all(abs(o - BOXES_OFFSET) >= 10**10 for o in others)
    assert SCENE_OFFSET != BOXES_OFFSET  # the segments world's examples stay theirs


def test_a_boxes_answer_is_the_segment_answer_without_its_codes():
    drawn = SyntheticDataset("boxes", split="validation", size=12)
    never = AssertionError("the boxes world encoded a mask")
    with mock.patch.object(MaskVAE, "encode", side_effect=never):
        examples = [drawn.example(i) for i in range(len(drawn))]
    vae = load_mask_vae(shipped_mask_vae_path())
    for ex in examples:
        assert ex.seed == SPLITS["validation"][examples.index(ex)]
        scene = _draw_scene(example_rng("boxes", ex.seed), ex.seed)
        kind = ex.prompt.removeprefix("detect ")
        assert ex.task == "detect" and ex.labels == [kind] * len(ex.boxes)
        assert ex.boxes == [b for b, k in zip(scene.boxes, scene.labels) if k == kind]
        codes = re.findall(r"<seg\d{3}>", segment_answer(scene, kind, vae))
        assert len(codes) == 16 * len(ex.boxes)
        assert ex.answer == re.sub(r"<seg\d{3}>", "", segment_answer(scene, kind, vae))
    assert drawn[3] == examples[3].triple()  # the same example, drawn again


def test_the_boxes_recipe_trains_both_worlds_from_the_shipped_adapter():
    from paligemma_lib.cli.options import parse_worlds
    from paligemma_lib.cli.train import add_train_parser

    runs = gpu_run.segment_runs({"GPU_SEGMENT_RUNS": "low,boxes"})
    base = ["--model", "nano", "--worlds", "segments=1", "--out", "x", "--steps", "9"]
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", *base, *runs["boxes"]])
    assert parse_worlds(args.worlds) == {"segments": 0.75, "boxes": 0.25}
    assert args.from_adapter == "segment" and args.lora
    low = parser.parse_args(["train", *base, *runs["low"]])
    assert parse_worlds(low.worlds) == {"segments": 1.0}
    for name in ("lr", "lora_r", "lora_alpha", "lora_targets", "from_adapter"):
        assert getattr(args, name) == getattr(low, name)  # only the mix differs
    assert args.lr == 5e-4
    with pytest.raises(ValueError, match="unknown world 'box'"):
        parse_worlds("segments=0.75,box=0.25")
