"""The segments world's training batches with their codes written on the device
(chapter 12.1, "More examples a second"): the same batches as the world's own answers
make, the encoder run once a micro-batch in the loop and never in a worker, every other
batch untouched, and `train` finishing each step's micro-batches."""

from unittest import mock

import pytest
import torch

import paligemma_lib.segment_batches as segment_batches
import paligemma_lib.segmentation as seg
from paligemma_lib import PaliGemmaProcessor
from paligemma_lib.batching import StepBatches, step_batches, training_data
from paligemma_lib.data import Collator, SyntheticDataset
from paligemma_lib.processing import PaliGemmaBatch
from paligemma_lib.segment_batches import codes_at, near_ties, tie_gaps
from paligemma_lib.train import TrainConfig
from paligemma_lib.training_run import TrainingRun, run_training


@pytest.fixture(scope="module")
def processor():
    return PaliGemmaProcessor.from_pretrained("nano")


def both_ways(processor, worlds, n, start=0):
    "(the world's own batch, the pending one, its finished batch, the collate)"
    data = SyntheticDataset(worlds, "train", size=start + n)
    plain = Collator(processor, pixels="uint8")
    deferred, collate = training_data(data, plain)
    indices = range(start, start + n)
    written = plain([data[i] for i in indices])
    pending = collate([deferred[i] for i in indices])
    crops = pending.crops.clone()
    done = collate.finish([pending], "cpu")[0]
    return written, crops, done, collate


def test_finished_batches_are_the_worlds_own(processor):
    written, crops, done, collate = both_ways(
        processor, {"segments": 0.6, "shapes": 0.4}, 48
    )
    assert isinstance(done, PaliGemmaBatch)
    for key in ("attention_mask", "token_type_ids", "pixel_values"):
        assert torch.equal(done[key], written[key]), key
    places = torch.isin(written.input_ids, collate.seg_ids())
    assert torch.equal(places, torch.isin(done.input_ids, collate.seg_ids()))
    assert torch.equal(done.input_ids[~places], written.input_ids[~places])
    mine, theirs = codes_at(done, collate, places), codes_at(written, collate, places)
    assert len(mine) == len(crops) > 48 // 2
    assert near_ties(seg._answer_vae(), crops, mine, theirs)
    suffix = done.token_type_ids == 1
    assert torch.equal(done.labels, done.input_ids.masked_fill(~suffix, -100))


def test_near_ties_refuses_a_code_that_is_not_one(processor):
    "The check above can fail: one code moved to another, far from a tie"
    written, crops, done, collate = both_ways(processor, "segments", 8)
    places = torch.isin(written.input_ids, collate.seg_ids())
    mine = codes_at(done, collate, places)
    wrong = mine.clone()
    wrong[0, 0] = (wrong[0, 0] + 64) % 128
    assert not near_ties(seg._answer_vae(), crops, wrong, mine)


def test_the_encoder_runs_once_a_batch_and_never_in_a_worker(processor):
    data = SyntheticDataset("segments", "train", size=12)
    deferred, collate = training_data(data, Collator(processor, pixels="uint8"))
    encode = seg.MaskVAE.encode
    with mock.patch.object(
        seg.MaskVAE, "encode", autospec=True, side_effect=encode
    ) as calls:
        pending = [collate([deferred[i] for i in range(k, k + 6)]) for k in (0, 6)]
        assert calls.call_count == 0
        collate.finish(pending, "cpu")
    assert [len(c.args[1]) for c in calls.call_args_list] == [
        len(p.crops) for p in pending
    ]


def test_other_worlds_and_plain_batches_pass_untouched(processor):
    shapes = SyntheticDataset({"shapes": 0.5, "ocr": 0.5}, "train", size=6)
    plain = Collator(processor, pixels="uint8")
    assert training_data(shapes, plain) == (shapes, plain)
    # a validation set of the segments world, through the segments collate
    validation = SyntheticDataset("segments", "validation", size=4)
    _, collate = training_data(SyntheticDataset("segments", "train", size=4), plain)
    batch = collate([validation[i] for i in range(4)])
    expected = plain([validation[i] for i in range(4)])
    assert isinstance(batch, PaliGemmaBatch)
    assert all(torch.equal(batch[k], expected[k]) for k in expected.keys())
    assert collate.finish([batch], "cpu") == [batch]


def test_a_worker_process_sends_the_same_pending_batches(processor):
    data = SyntheticDataset("segments", "train", size=16)
    deferred, collate = training_data(data, Collator(processor, pixels="uint8"))
    config = TrainConfig(steps=2, batch_size=4, warmup_steps=0)
    batches = StepBatches(deferred, collate, config)
    here = [collate.finish(b, "cpu") for b in step_batches(batches, 0, 0)]
    ahead = [collate.finish(b, "cpu") for b in step_batches(batches, 0, 1)]
    for mine, theirs in zip(ahead, here, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a.keys())


def test_train_finishes_each_step_before_the_step(tmp_path):
    "run_training on the segments world: finish once a step, the step sees no pending"
    from paligemma_lib import train as train_module

    run = TrainingRun(
        out=tmp_path / "run",
        config=TrainConfig(steps=3, batch_size=2, warmup_steps=0),
        train_set=SyntheticDataset("segments", "train", size=100),
        size="tiny",
        progress=False,
    )
    finish, step = segment_batches.SegmentCollator.finish, train_module.training_step
    seen = []

    def spy(model, micro_batches, *args, **kwargs):
        seen.append([type(b) for b in micro_batches])
        return step(model, micro_batches, *args, **kwargs)

    with (
        mock.patch.object(
            segment_batches.SegmentCollator, "finish", autospec=True, side_effect=finish
        ) as f,
        mock.patch.object(train_module, "training_step", side_effect=spy),
    ):
        run_training(run)
    assert f.call_count == 3
    assert seen == [[PaliGemmaBatch]] * 3


def test_a_pending_batch_with_too_few_places_is_refused(processor):
    data = SyntheticDataset("segments", "train", size=2)
    deferred, collate = training_data(data, Collator(processor, pixels="uint8"))
    image, prompt, answer = deferred[0]
    extra = segment_batches.PendingAnswer(
        answer.text, torch.cat([answer.crops, answer.crops])
    )
    with pytest.raises(ValueError, match="masks need 16 each"):
        collate([(image, prompt, extra)])


def test_a_pending_batch_is_not_trained_on_unfinished(processor):
    data = SyntheticDataset("segments", "train", size=2)
    deferred, collate = training_data(data, Collator(processor, pixels="uint8"))
    pending = collate([deferred[i] for i in range(2)])
    with pytest.raises(TypeError, match="collate.finish"):
        pending.to("cpu")


def test_two_worlds_with_their_own_batches_are_refused(monkeypatch, processor):
    "training_data makes one world's batches, and refuses a mix of two such worlds"
    from paligemma_lib import batching

    monkeypatch.setitem(batching.TRAINING_BATCHES, "shapes", lambda d, c: (d, "own"))
    plain = Collator(processor, pixels="uint8")
    shapes = SyntheticDataset({"shapes": 0.5, "ocr": 0.5}, "train", size=4)
    assert training_data(shapes, plain) == (shapes, "own")
    both = SyntheticDataset({"shapes": 0.5, "segments": 0.5}, "train", size=4)
    with pytest.raises(ValueError, match="separate runs"):
        training_data(both, plain)


@pytest.mark.parametrize("api", ["legacy", "fp32_precision"])
def test_finish_encodes_in_float32_and_puts_the_settings_back(
    monkeypatch, processor, api
):
    """No autocast and IEEE float32 inside finish, whichever of PyTorch's two APIs
    turned TF32 on (mixing them raises in PyTorch's legacy getters); theirs after"""
    data = SyntheticDataset("segments", "train", size=2)
    deferred, collate = training_data(data, Collator(processor, pixels="uint8"))
    pending = collate([deferred[i] for i in range(2)])
    leaves = segment_batches._FP32_LEAVES
    inside, encode = [], seg.MaskVAE.encode

    def spy(vae, masks):
        inside.append((torch.is_autocast_enabled("cpu"),
                       {leaf.fp32_precision for leaf in leaves}))  # fmt: skip
        return encode(vae, masks)

    monkeypatch.setattr(seg.MaskVAE, "encode", spy)
    before = (
        torch.get_float32_matmul_precision(),
        [leaf.fp32_precision for leaf in leaves],
    )
    try:
        if api == "legacy":
            torch.set_float32_matmul_precision("high")
            torch.backends.cudnn.allow_tf32 = True
        else:
            for leaf in leaves:
                leaf.fp32_precision = "tf32"
        turned_on = [leaf.fp32_precision for leaf in leaves]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            collate.finish([pending], "cpu")
        assert [leaf.fp32_precision for leaf in leaves] == turned_on
        if api == "legacy":  # the legacy getters still answer, as before
            assert torch.get_float32_matmul_precision() == "high"
    finally:  # the process as it was, for the tests after this one
        torch.set_float32_matmul_precision(before[0])
        for leaf, value in zip(leaves, before[1]):
            leaf.fp32_precision = value
    assert inside == [(False, {"ieee"})]


def test_near_ties_refuses_nearly_every_second_nearest_code(processor):
    """The allowance discriminates: of every code replaced by the code next nearest
    the encoder's vector, under 5% pass as a tie (a worst-case bound, at the scale of
    sum |w||x|, would pass them all)"""
    vae = seg._answer_vae()
    _, crops, _, _ = both_ways(processor, "segments", 16)
    with torch.no_grad():
        z = vae.encoder(2 * crops[:, None] - 1).double()
    z = z.permute(0, 2, 3, 1).reshape(len(crops), 16, -1)
    e = vae._vq_vae._embedding.double()
    two = torch.cdist(z, e[None].expand(len(crops), -1, -1)).topk(2, largest=False)
    first, second = two.indices.unbind(-1)
    gap, slack = tie_gaps(vae, crops, first, second)
    assert len(gap) == first.numel() and (gap < 0).all()  # `first` is nearer
    assert (gap.abs() <= slack).double().mean() < 0.05
    assert near_ties(vae, crops, first, first)  # no code differs
    # the worst case: each layer's rounding at the scale of sum |w||x|, which the
    # encoder run on |weights| and |input| bounds (its ReLUs then pass everything)
    convs = [m for m in vae.encoder.modules() if isinstance(m, torch.nn.Conv2d)]
    roundings = sum(m.weight[0].numel() + 1 for m in convs) * 2.0**-24
    absolute = {n: p.detach().double().abs() for n, p in vae.encoder.named_parameters()}
    x = (2 * crops[:, None] - 1).double().abs()
    with torch.no_grad():
        scale = torch.func.functional_call(vae.encoder.double(), absolute, (x,))
    vae.encoder.float()
    scale = scale.permute(0, 2, 3, 1).reshape(len(crops), 16, -1)
    worst = 2 * roundings * (scale * (e[first] - e[second]).abs()).sum(-1)
    assert (gap.abs() <= worst.flatten()).all()


def test_the_data_rate_benchmark_builds_each_way_as_train_would(monkeypatch):
    "benchmarks/data_rate.py: the segment recipe both ways, the others as they are"
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import data_rate

    built = data_rate.ways(2)
    assert set(built) == {
        "segment, the world's answers",
        "segment, codes on the device",
        "real",
        "stage 2, at 448",
    }
    own, device = (
        built["segment, the world's answers"],
        built["segment, codes on the device"],
    )
    assert type(own.collate) is Collator and isinstance(
        device.collate, segment_batches.SegmentCollator
    )
    assert isinstance(device.dataset, segment_batches.DeferredSegments)
    assert device.dataset.data is own.dataset  # the same examples, the same steps
    assert built["stage 2, at 448"].collate.processor.image_size == 448
