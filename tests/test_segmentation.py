"""The mask VQ-VAE (chapter 12.1) against an independent float64 implementation of
its equations, the loader's checks on big_vision's `vae-oid.npz` layout, and
`segment` answers decoded to masks."""

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from paligemma_lib.boxes import bin_to_coordinate
from paligemma_lib.mask_vae_training import (
    VAE_TEST_SEEDS,
    VAE_TRAIN_SEEDS,
    code_usage,
    init_codebook,
    reconstruction_report,
    restart_dead_codes,
    train_mask_vae,
    world_masks,
)
from paligemma_lib.segmentation import (
    MaskVAE,
    load_mask_vae,
    mask_to_64,
    parse_segments,
    segment_answer,
    segment_scene,
    shipped_mask_vae_path,
)


def _conv(name, c_out, c_in, k):
    return {f"{name}.weight": (c_out, c_in, k, k), f"{name}.bias": (c_out,)}


def _resblock(name):
    return {
        **_conv(f"{name}.net.0", 128, 128, 3),
        **_conv(f"{name}.net.2", 128, 128, 3),
        **_conv(f"{name}.net.4", 128, 128, 1),
    }


def _convt(name, c_in, c_out):  # ConvTranspose2d: [in, out, k, k]
    return {f"{name}.weight": (c_in, c_out, 4, 4), f"{name}.bias": (c_out,)}


# vae-oid.npz as big_vision's code reads it (issue 31), written out by hand
LAYOUT = {
    "_vq_vae._embedding": (128, 512),
    **_conv("encoder.0", 16, 1, 4),
    **_conv("encoder.2", 32, 16, 4),
    **_conv("encoder.4", 64, 32, 4),
    **_conv("encoder.6", 128, 64, 4),
    **_resblock("encoder.8"),
    **_resblock("encoder.9"),
    **_conv("encoder.10", 512, 128, 1),
    **_conv("decoder.0", 128, 512, 1),
    **_resblock("decoder.2"),
    **_resblock("decoder.3"),
    **_convt("decoder.4", 128, 128),
    **_convt("decoder.6", 128, 64),
    **_convt("decoder.8", 64, 32),
    **_convt("decoder.10", 32, 16),
    **_conv("decoder.12", 1, 16, 1),
}


def random_arrays(seed=0):
    """Random float32 arrays of LAYOUT, weights at He scale (std sqrt(2 / inputs
    per output)) so that activations neither vanish nor explode over 13 layers"""
    rng = np.random.default_rng(seed)
    arrays = {}
    for key, shape in LAYOUT.items():
        if key.endswith("bias"):
            arrays[key] = rng.normal(0, 0.1, shape)
        elif key.startswith("_vq_vae"):
            arrays[key] = rng.normal(0, 1, shape)
        else:
            is_transposed = key in {f"decoder.{i}.weight" for i in (4, 6, 8, 10)}
            # a stride-2 4 x 4 transposed convolution sums in x 2 x 2 inputs
            inputs = shape[0] * 4 if is_transposed else int(np.prod(shape[1:]))
            arrays[key] = rng.normal(0, np.sqrt(2 / inputs), shape)
    return {k: v.astype(np.float32) for k, v in arrays.items()}


@pytest.fixture(scope="module")
def vae_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vae") / "vae-oid.npz"
    arrays = random_arrays()
    np.savez(path, **arrays)
    return path, arrays


# --- the same equations in float64, written from their definitions ---------


def conv2d(x, w, b, stride=1, pad=0):
    "x [C, H, W], w [O, C, k, k]: out[o, i, j] = b[o] + sum w[o, c, u, v] x[c, ...]"
    k = w.shape[-1]
    xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad)))
    h_out = (xp.shape[1] - k) // stride + 1
    w_out = (xp.shape[2] - k) // stride + 1
    out = np.zeros((w.shape[0], h_out, w_out))
    for u in range(k):
        for v in range(k):
            window = xp[
                :, u : u + stride * h_out : stride, v : v + stride * w_out : stride
            ]
            out += np.einsum("oc,chw->ohw", w[:, :, u, v], window)
    return out + b[:, None, None]


def conv_transpose2d(x, w, b, stride=2, pad=1):
    """x [C, H, W], w [C, O, k, k]: each input pixel (i, j) adds w[c, :, u, v] x[c,
    i, j] at output (i * stride - pad + u, j * stride - pad + v)"""
    c, h, wd = x.shape
    k = w.shape[-1]
    full = np.zeros((w.shape[1], (h - 1) * stride + k, (wd - 1) * stride + k))
    for u in range(k):
        for v in range(k):
            full[:, u : u + stride * h : stride, v : v + stride * wd : stride] += (
                np.einsum("co,chw->ohw", w[:, :, u, v], x)
            )
    out = full[:, pad : full.shape[1] - pad, pad : full.shape[2] - pad]
    return out + b[:, None, None]


def relu(x):
    return np.where(x > 0, x, 0.0)


def resblock(a, x, name):
    y = relu(conv2d(x, a[f"{name}.net.0.weight"], a[f"{name}.net.0.bias"], pad=1))
    y = relu(conv2d(y, a[f"{name}.net.2.weight"], a[f"{name}.net.2.bias"], pad=1))
    return x + conv2d(y, a[f"{name}.net.4.weight"], a[f"{name}.net.4.bias"])


def decoder_reference(a, codes):
    "16 codes -> [64, 64], float64"
    x = a["_vq_vae._embedding"][codes].reshape(4, 4, 512).transpose(2, 0, 1)
    x = relu(conv2d(x, a["decoder.0.weight"], a["decoder.0.bias"]))
    x = resblock(a, x, "decoder.2")
    x = resblock(a, x, "decoder.3")
    for i in (4, 6, 8, 10):
        x = relu(conv_transpose2d(x, a[f"decoder.{i}.weight"], a[f"decoder.{i}.bias"]))
    return conv2d(x, a["decoder.12.weight"], a["decoder.12.bias"])[0]


def encoder_reference(a, mask):
    "[64, 64] in [0, 1] -> [512, 4, 4], float64 (big_vision: 2 (x - 0.5))"
    x = 2.0 * (mask[None] - 0.5)
    for i in (0, 2, 4, 6):
        x = relu(conv2d(x, a[f"encoder.{i}.weight"], a[f"encoder.{i}.bias"], 2, pad=1))
    x = resblock(a, x, "encoder.8")
    x = resblock(a, x, "encoder.9")
    return conv2d(x, a["encoder.10.weight"], a["encoder.10.bias"])


def squared_distances(z, e):
    "z [N, D], e [K, D] -> [N, K], one difference at a time"
    return np.stack([((z - e[k]) ** 2).sum(-1) for k in range(len(e))], axis=1)


# float32 (ours) against float64 (the reference): each output is a sum of at
# most K = 128 * 9 = 1152 products; rounding errors of a float32 sum behave as a
# random walk, about sqrt(K) * 2^-24 = 2e-6 of the output's magnitude per layer,
# and 13 layers chain them (with He-scaled weights each passes an error on at
# about its own size): about 13 * 2e-6 = 3e-5 of the outputs' scale. Allowed:
# 1e-4 of the largest magnitude, a margin of 3.
REL = 1e-4


def _float64(arrays):
    return {k: v.astype(np.float64) for k, v in arrays.items()}


def test_state_dict_is_the_checkpoint_layout():
    ours = {k: tuple(v.shape) for k, v in MaskVAE().state_dict().items()}
    assert ours == LAYOUT


def test_decoder_matches_the_equations(vae_file):
    path, arrays = vae_file
    vae = load_mask_vae(path)
    a64 = _float64(arrays)
    codes = np.random.default_rng(1).integers(0, 128, (3, 16))
    with torch.no_grad():
        ours = vae.decode(torch.from_numpy(codes)).double().numpy()
    for got, row in zip(ours, codes):
        ref = decoder_reference(a64, row)
        assert ref.std() > 0.05 * np.abs(ref).max()  # a mask, not a constant
        assert np.abs(got - ref).max() <= REL * np.abs(ref).max()


def test_encoder_and_codes_match_the_equations(vae_file):
    path, arrays = vae_file
    vae = load_mask_vae(path)
    a64 = _float64(arrays)
    yy, xx = np.mgrid[:64, :64]
    masks = np.stack(
        [
            ((yy - 30) ** 2 + (xx - 35) ** 2 < 25**2),
            (abs(yy - 32) + abs(xx - 20) < 18),
            np.random.default_rng(2).random((64, 64)) < 0.5,
        ]
    ).astype(np.float32)
    with torch.no_grad():
        z = vae.encoder(2 * torch.from_numpy(masks)[:, None] - 1).double().numpy()
        codes = vae.encode(torch.from_numpy(masks)).numpy()
    e = a64["_vq_vae._embedding"]
    for got_z, got_codes, mask in zip(z, codes, masks):
        ref = encoder_reference(a64, mask.astype(np.float64))
        scale = np.abs(ref).max()
        assert np.abs(got_z - ref).max() <= REL * scale
        # the codes: the nearest codes of our own float32 z, by brute force
        z_rows = got_z.reshape(512, 16).T  # [16, 512], row-major positions
        d = squared_distances(z_rows, e)  # [16, 128]
        best = np.sort(d, axis=1)
        # ours computes |z|^2 - 2 z.e + |e|^2 in float32: three sums of 512
        # products, each within 512 * 2^-24 of its sum of |terms|, in all at
        # most 512 * 2^-24 * (|z| + |e|)^2: no pair closer than twice that
        norms = np.linalg.norm(z_rows, axis=1)[:, None] + np.linalg.norm(e, axis=1)
        bound = (512 * 2.0**-24 * norms**2).max()
        assert (best[:, 1] - best[:, 0] > 2 * bound).all()
        assert np.array_equal(got_codes, d.argmin(1))


def test_encode_gives_the_quantisers_codes(vae_file):
    """`encode` skips the quantiser's losses (the answers' codes are most of a
    segments example's time): its codes are the training forward's, bit for bit"""
    vae = load_mask_vae(vae_file[0])
    masks = torch.rand(5, 64, 64, generator=torch.Generator().manual_seed(3)) < 0.5
    with torch.no_grad():
        _, quantized = vae(masks.float())
        assert torch.equal(vae.encode(masks.float()), quantized.codes)


def test_nearest_codes_are_the_brute_force_ones():
    vae = MaskVAE()
    z = torch.randn(200, 512, dtype=torch.float64)
    e = vae._vq_vae._embedding.detach().double()
    brute = squared_distances(z.numpy(), e.numpy()).argmin(1)
    assert np.array_equal(vae._vq_vae.nearest_codes(z).numpy(), brute)


def test_code_usage():
    counts, perplexity, dead = code_usage(torch.tensor([[0, 0, 1, 3]]), 4)
    assert counts.tolist() == [2, 1, 0, 1] and dead == [2]
    p = np.array([0.5, 0.25, 0.25])
    # both in float64: three products, a sum, a log and an exp, each rounded by at
    # most 2^-53 relative (~1e-16): 1e-12 leaves a margin of 10^4
    assert perplexity == pytest.approx(np.exp(-(p * np.log(p)).sum()), rel=1e-12)


# --- the loader -------------------------------------------------------------


def test_loader_reads_every_tensor_strictly(vae_file):
    path, arrays = vae_file
    vae = load_mask_vae(path)
    assert not vae.training
    state = vae.state_dict()
    assert state.keys() == arrays.keys()
    for key, value in arrays.items():
        assert np.array_equal(state[key].numpy(), value), key


def test_loader_reads_the_environment_variable(vae_file, monkeypatch):
    path, arrays = vae_file
    monkeypatch.setenv("PALIGEMMA_SEG_VAE", str(path))
    emb = load_mask_vae().state_dict()["_vq_vae._embedding"].numpy()
    assert np.array_equal(emb, arrays["_vq_vae._embedding"])
    monkeypatch.delenv("PALIGEMMA_SEG_VAE")
    shipped = load_mask_vae(shipped_mask_vae_path()).state_dict()
    for key, value in load_mask_vae().state_dict().items():  # path, variable, shipped
        assert torch.equal(value, shipped[key]), key


def _refusal(tmp_path, arrays):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError) as error:
        load_mask_vae(tmp_path / "bad.npz")
    message = str(error.value)
    assert "\n" not in message
    return message


def test_loader_names_a_missing_tensor(vae_file, tmp_path):
    arrays = {k: v for k, v in vae_file[1].items() if k != "encoder.9.net.2.weight"}
    message = _refusal(tmp_path, arrays)
    assert "'encoder.9.net.2.weight'" in message and "[128, 128, 3, 3]" in message


def test_loader_names_an_extra_tensor(vae_file, tmp_path):
    arrays = {**vae_file[1], "decoder.14.bias": np.zeros(1, np.float32)}
    assert "'decoder.14.bias'" in _refusal(tmp_path, arrays)


def test_loader_names_a_misshaped_tensor(vae_file, tmp_path):
    arrays = {**vae_file[1], "decoder.6.weight": np.zeros((64, 128, 4, 4))}
    message = _refusal(tmp_path, arrays)
    assert "'decoder.6.weight'" in message
    assert "[64, 128, 4, 4]" in message and "[128, 64, 4, 4]" in message


def test_loader_ignores_exactly_the_ema_buffers(vae_file, tmp_path):
    "AiT's VectorQuantizerEMA saves its moving averages beside the codebook"
    path, arrays = vae_file
    ema = {
        **arrays,
        "_vq_vae._ema_cluster_size": np.arange(128, dtype=np.float32),
        "_vq_vae._ema_w": np.ones((128, 512), np.float32),
    }
    np.savez(tmp_path / "vae-oid.npz", **ema)
    state = load_mask_vae(tmp_path / "vae-oid.npz").state_dict()
    assert state.keys() == arrays.keys()
    for key, value in arrays.items():
        assert np.array_equal(state[key].numpy(), value), key
    # one of them alone is fine too; at another shape, or another name, refused
    only = {k: v for k, v in ema.items() if k != "_vq_vae._ema_w"}
    np.savez(tmp_path / "one.npz", **only)
    assert load_mask_vae(tmp_path / "one.npz").state_dict().keys() == arrays.keys()
    message = _refusal(tmp_path, {**ema, "_vq_vae._ema_w": np.ones((128, 64))})
    assert "'_vq_vae._ema_w'" in message and "[128, 512]" in message
    message = _refusal(tmp_path, {**ema, "_vq_vae._ema_n": np.ones(1)})
    assert "'_vq_vae._ema_n'" in message and "does not have" in message


def test_loader_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no mask VAE file"):
        load_mask_vae(tmp_path / "vae-oid.npz")


# --- answers to masks ---------------------------------------------------------


def _loc(y0, x0, y1, x1):
    return "".join(f"<loc{b:04d}>" for b in (y0, x0, y1, x1))


def _seg(codes):
    return "".join(f"<seg{c:03d}>" for c in codes)


@pytest.fixture(scope="module")
def vae(vae_file):
    vae = load_mask_vae(vae_file[0])
    # a bias at the median of one decoded mask: that mask is half inside
    with torch.no_grad():
        vae.decoder[12].bias -= vae.decode(torch.arange(16)[None]).median()
    return vae


def _check_mask(segment, codes, vae, width, height, antialias):
    "Empty outside the box; inside, the decoded mask resized by torch, cut at 0"
    x0, y0, x1, y1 = (int(c) for c in segment.box)
    outside = segment.mask.clone()
    outside[y0:y1, x0:x1] = False
    assert segment.mask.shape == (height, width) and not outside.any()
    with torch.no_grad():
        m64 = vae.decode(torch.tensor([codes]))
    ref = F.interpolate(
        m64[None], (y1 - y0, x1 - x0), mode="bilinear", antialias=antialias
    )[0, 0]
    # Pillow and torch both resize in float32 with their own weights: they agree
    # to a few float32 roundings of the largest value, so pixels whose value is
    # within 1e-4 of that from the cut at 0 may fall either way
    clear = ref.abs() > 1e-4 * m64.abs().max()
    inside = segment.mask[y0:y1, x0:x1]
    assert clear.float().mean() > 0.95
    assert torch.equal(inside[clear], (ref > 0)[clear])
    assert 0 < inside.sum() < inside.numel()


def test_two_objects_decoded(vae):
    codes_a, codes_b = list(range(16)), list(range(60, 76))
    text = (
        f"{_loc(100, 50, 900, 700)}{_seg(codes_a)} red circle ; "
        f"{_loc(10, 800, 200, 1000)}{_seg(codes_b)} square"
    )
    width, height = 320, 240
    first, second = parse_segments(text, width, height, vae)
    assert (first.label, second.label) == ("red circle", "square")
    assert first.valid and second.valid
    # the box the mask fills: bin / 1023 x side, cut down to a whole pixel
    assert first.box == tuple(
        int(bin_to_coordinate(b, s))
        for b, s in ((50, width), (100, height), (700, width), (900, height))
    )
    # first box: 203 x 187 pixels, enlarged from 64; second: 62 x 44, shrunk
    _check_mask(first, codes_a, vae, width, height, antialias=False)
    _check_mask(second, codes_b, vae, width, height, antialias=True)


@pytest.mark.parametrize(
    "bad",
    [
        _loc(10, 10, 500, 500) + _seg(range(15)) + " circle",  # 15 codes
        _loc(10, 10, 500, 500) + _seg(range(8)) + " " + _seg(range(8)) + " circle",
        _loc(10, 10, 500, 500) + " circle " + _seg(range(16)),  # label first
        "<loc0010><loc0010> <loc0500><loc0500>" + _seg(range(16)) + " circle",
        _loc(10, 10, 500, 500) + "<loc0005>" + _seg(range(16)) + " circle",
        "<loc0010><loc0010><loc0500>" + _seg(range(16)) + " circle",  # 3 locs
        _loc(500, 10, 10, 500) + _seg(range(16)) + " circle",  # y1 < y0
        _loc(10, 500, 500, 500) + _seg(range(16)) + " circle",  # x1 == x0
        _loc(10, 10, 1500, 500) + _seg(range(16)) + " circle",  # bin > 1023
        _loc(10, 10, 500, 500) + _seg([200] * 16) + " circle",  # code > 127
        _loc(11, 10, 20, 500) + _seg(range(16)) + " circle",  # < 1 pixel high
        "circle",
    ],
)
def test_malformed_objects_are_invalid_not_guessed(vae, bad):
    good = _loc(0, 0, 1023, 1023) + _seg(range(16)) + " square"
    segments = parse_segments(f"{good} ; {bad} ; ", 100, 100, vae)
    assert [s.valid for s in segments] == [True, False]
    assert segments[1].label == "circle"
    assert segments[1].box is None and segments[1].mask is None
    assert segments[1].text == bad


@pytest.mark.parametrize(
    "text",
    [
        _loc(10, 10, 500, 500) + _seg(range(16)) + _seg([99]) + " circle",  # 17
        _loc(10, 10, 500, 500) + _seg(range(16)) + _seg([99] * 5) + " circle",
        _loc(10, 10, 500, 500) + " " + _seg(range(16)) + " circle",  # a space
        _loc(10, 10, 500, 500) + "\n " + _seg(range(16)) + "circle",
        " " + _loc(10, 10, 500, 500) + _seg(range(16)) + _seg([5]) + "circle <seg001>",
    ],
)
def test_objects_read_as_the_evaluator_reads_them(vae, text):
    "big_vision's evaluator: the first 4 <loc> and 16 <seg>, the rest ignored"
    (plain,) = parse_segments(
        _loc(10, 10, 500, 500) + _seg(range(16)) + " circle", 100, 100, vae
    )
    (got,) = parse_segments(text, 100, 100, vae)
    assert got.valid and got.label == "circle" and got.text == text.strip()
    assert got.box == plain.box and torch.equal(got.mask, plain.mask)


def test_boxes_are_the_evaluators_whole_pixels(vae):
    "bin / 1023 x side, cut down: bins 100 and 200 of 224 px are 21 and 43"
    text = _loc(100, 100, 200, 200) + _seg(range(16)) + " x"
    (got,) = parse_segments(text, 224, 224, vae)
    assert got.box == (21, 21, 43, 43)
    assert all(isinstance(c, int) for c in got.box)
    assert not got.mask[:21].any() and not got.mask[43:].any()
    assert not got.mask[:, :21].any() and not got.mask[:, 43:].any()


def test_an_empty_answer_has_no_objects(vae):
    assert parse_segments("", 10, 10, vae) == []
    assert parse_segments(" ; ", 10, 10, vae) == []


def test_encode_and_decode_refuse_wrong_shapes():
    vae = MaskVAE()
    with pytest.raises(ValueError, match=r"masks \[B, 64, 64\]"):
        vae.encode(torch.zeros(1, 32, 32))
    with pytest.raises(ValueError, match=r"codes \[B, 16\]"):
        vae.decode(torch.zeros(1, 15, dtype=torch.long))


# --- the segmentation world ---------------------------------------------------


def test_scenes_are_exact_and_deterministic():
    from paligemma_lib.data import COLOURS

    for seed in (0, 5, 123456789):
        scene = segment_scene(seed)
        again = segment_scene(seed)
        assert scene.image.tobytes() == again.image.tobytes()
        assert torch.equal(scene.masks, again.masks)
        pixels = np.array(scene.image)
        masks = scene.masks.numpy()
        assert (masks.sum(0) <= 1).all()
        for colour, mask, (x0, y0, x1, y1) in zip(scene.colours, masks, scene.boxes):
            assert (pixels[mask] == COLOURS[colour]).all()
            ys, xs = np.nonzero(mask)
            assert (x0, y0, x1, y1) == (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
        assert segment_scene(seed + 1).image.tobytes() != scene.image.tobytes()


def test_scene_seed_errors():
    with pytest.raises(ValueError, match="must be an int"):
        segment_scene(-1)
    with pytest.raises(ValueError, match="must be an int"):
        segment_scene(1.0)


def test_mask_to_64():
    full = torch.ones(100, 100, dtype=torch.bool)
    ones = mask_to_64(full, (10, 20, 90, 70))
    # shrinking averages ones with weights that sum to 1 in float32: a few
    # roundings of 2^-24 (6e-8) each, well within 1e-6
    torch.testing.assert_close(ones, torch.ones(64, 64), rtol=0, atol=1e-6)
    mask = torch.rand(200, 200) > 0.5
    # a 64 x 64 box is copied as it is
    assert torch.equal(mask_to_64(mask, (5, 7, 69, 71)), mask[7:71, 5:69].float())


def test_segment_answer_round_trip(vae):
    scene = next(
        s for s in map(segment_scene, range(100)) if s.labels.count("triangle") == 2
    )
    text = segment_answer(scene, "triangle", vae)
    assert text.count(" ; ") == 1
    decoded = parse_segments(text, 224, 224, vae)
    mine = [b for b, k in zip(scene.boxes, scene.labels) if k == "triangle"]
    assert [s.label for s in decoded] == ["triangle", "triangle"]
    for segment, box in zip(decoded, mine):
        # half a bin from the true box, then cut down to a whole pixel
        assert all(b - a in (0, 1) for a, b in zip(segment.box, box))
    crops = torch.stack(
        [
            mask_to_64(m, b)
            for m, b, k in zip(scene.masks, scene.boxes, scene.labels)
            if k == "triangle"
        ]
    )
    with torch.no_grad():
        codes = vae.encode(crops)
    assert [s.text.count("<seg") for s in decoded] == [16, 16]
    seg = [int(c) for c in re.findall(r"<seg(\d{3})>", text)]
    assert seg == codes.flatten().tolist()
    absent = next(k for k in ("circle", "square") if k not in scene.labels)
    with pytest.raises(ValueError, match=f"has no {absent}"):
        segment_answer(scene, absent, vae)


# --- our own VAE: trained here, shipped in the package ----------------------


def test_shipped_vae_loads_strictly():
    "float16 arrays of vae-oid.npz's layout, read as float32, every key"
    path = shipped_mask_vae_path()
    assert path.stat().st_size < 5_000_000  # 2.04 M weights x 2 bytes
    with np.load(path) as npz:
        arrays = {key: npz[key] for key in npz.files}
    assert {k: v.shape for k, v in arrays.items()} == LAYOUT
    assert all(v.dtype == np.float16 for v in arrays.values())
    state = load_mask_vae(path).state_dict()
    for key, value in arrays.items():
        assert state[key].dtype == torch.float32
        assert np.array_equal(state[key].numpy(), value.astype(np.float32)), key


def test_shipped_record_recomputes():
    """The record's per-object IoUs of its first 3 test scenes, recomputed.
    The weights are fixed numbers and the masks exact, so only the order of
    float32 sums inside the convolutions may differ here from where the record
    was made: a decoded value moves by a few roundings, and a pixel changes side
    only if it lies that close to 0. Allowing 2 such pixels per object, the IoU
    moves by at most 2 / |union| <= 2 / |ground truth| (the union holds it)."""
    record = json.loads(
        (shipped_mask_vae_path().parent / "training_record.json").read_text()
    )
    start, stop = record["test_seeds"]
    assert range(start, stop) == VAE_TEST_SEEDS and stop - start >= 100
    assert not set(VAE_TEST_SEEDS) & set(VAE_TRAIN_SEEDS)
    report = reconstruction_report(
        load_mask_vae(shipped_mask_vae_path()), range(start, start + 3)
    )
    n = len(report["labels"])
    objects = record["test_objects"]
    assert report["labels"] == objects["labels"][:n]
    sizes_64, sizes_full = [], []
    for seed in range(start, start + 3):
        scene = segment_scene(seed)
        for mask, box in zip(scene.masks, scene.boxes):
            sizes_64.append((mask_to_64(mask, box) > 0.5).sum().item())
            sizes_full.append(mask.sum().item())
    for key, sizes in (("iou_64", sizes_64), ("iou_full", sizes_full)):
        for got, recorded, size in zip(report[key], objects[key][:n], sizes):
            assert abs(got - recorded) <= 2 / size, (key, got, recorded)
    assert record["test_mean_iou_full"] == pytest.approx(np.mean(objects["iou_full"]))


def test_training_is_deterministic():
    """Bitwise on one thread. With several, the CPU kernels split the weight
    gradients' sums between threads in an order that varies from run to run, so
    the weights differ in the last bits (seen: 4e-9 after 3 steps)."""
    masks = world_masks(range(8))  # about 16 masks
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [train_mask_vae(3, batch_size=8, seed=1, masks=masks) for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    (a, history_a), (b, history_b) = runs
    assert history_a == history_b
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key


def test_codebook_from_the_data_uses_more_codes():
    "The same encoder and batch: a random codebook against codes from the batch"
    masks = world_masks(range(20))[:32]
    torch.manual_seed(0)
    vae = MaskVAE()
    with torch.no_grad():
        random_codes = vae.encode(masks)
        init_codebook(vae, masks, torch.Generator().manual_seed(0))
        data_codes = vae.encode(masks)
    used = lambda codes: len(codes.unique())  # noqa: E731
    assert used(random_codes) <= 4 < 32 <= used(data_codes)


def test_dead_codes_restart_on_encoder_outputs():
    torch.manual_seed(0)
    vae = MaskVAE()
    rows = torch.randn(64, 512)
    counts = torch.zeros(128, dtype=torch.long)
    counts[:100] = 1  # codes 100..127 unused
    before = vae._vq_vae._embedding.detach().clone()
    assert restart_dead_codes(vae, rows, counts, torch.Generator().manual_seed(0)) == 28
    after = vae._vq_vae._embedding.detach()
    assert torch.equal(after[:100], before[:100])
    for code in after[100:]:  # each one an encoder output
        assert (rows == code).all(1).any()


def test_parse_segments_defaults_to_the_shipped_vae(monkeypatch):
    monkeypatch.delenv("PALIGEMMA_SEG_VAE", raising=False)
    scene = segment_scene(3)
    vae = load_mask_vae(shipped_mask_vae_path())
    text = segment_answer(scene, scene.labels[0])
    assert text == segment_answer(scene, scene.labels[0], vae)
    default = parse_segments(text, 224, 224)
    explicit = parse_segments(text, 224, 224, vae)
    assert [torch.equal(a.mask, b.mask) for a, b in zip(default, explicit)] == [
        True
    ] * len(default)


# --- the segments world and its metric ---------------------------------------


def test_segments_world_examples_are_the_scenes_answers():
    from paligemma_lib.data import SPLITS, SyntheticDataset, make_example
    from paligemma_lib.segmentation import load_mask_vae, segment_answer

    vae = load_mask_vae(shipped_mask_vae_path())
    data = SyntheticDataset("segments", split="test", size=8)
    for i in range(len(data)):
        ex = data.example(i)
        scene = segment_scene(ex.seed)
        kind = ex.prompt.removeprefix("segment ")
        mine = [j for j, label in enumerate(scene.labels) if label == kind]
        assert ex.world == "segments" and ex.task == "segment" and mine
        assert ex.answer == segment_answer(scene, kind, vae)
        assert torch.equal(ex.masks, scene.masks[mine])
        assert (
            data[i]
            == ex.triple()
            == make_example("segments", SPLITS["test"][i]).triple()
        )
    with pytest.raises(ValueError, match="no task 'caption'"):
        make_example("segments", 0, task="caption")


def test_matched_ious_pairs_greedily_and_counts_what_is_left():
    from paligemma_lib.segment_eval import matched_ious
    from paligemma_lib.segmentation import Segment

    true = torch.zeros(2, 6, 6, dtype=torch.bool)
    true[0, :3, :3] = True  # 9 pixels
    true[1, 3:, 3:] = True
    half = torch.zeros(6, 6, dtype=torch.bool)
    half[:3, :] = True  # 18 pixels, holding all of true[0]: IoU 9 / 18
    exact = true[1].clone()
    # greedy: `exact` takes true[1] (IoU 1) before `half` could want it
    found = [
        Segment("x", (0, 0, 6, 3), half, ""),
        Segment("x", (3, 3, 6, 6), exact, ""),
    ]
    assert matched_ious(found, true) == ([1.0, 0.5], 0)
    bad = Segment("x", None, None, "<loc0001>x")
    assert matched_ious([bad], true) == ([0.0, 0.0, 0.0], 1)  # 1 invalid + 2 missed
    assert matched_ious(found + [bad], true[:1]) == ([0.5, 0.0, 0.0], 1)


def test_segment_metrics_of_true_answers_beat_both_baselines():
    from paligemma_lib.data import SyntheticDataset
    from paligemma_lib.segment_eval import segment_metrics

    data = SyntheticDataset("segments", split="validation", size=12)
    examples = [data.example(i) for i in range(len(data))]
    got = segment_metrics(examples, [ex.answer for ex in examples])
    assert got["objects graded"] == sum(len(ex.labels) for ex in examples)
    assert got["invalid objects"] == 0
    # the true masks through the shipped VAE: its reconstruction IoU, ~0.96
    assert got["mIoU"] > 0.85 > got["filled box mIoU"]
    empty = segment_metrics(examples, ["" for _ in examples])
    assert empty["mIoU"] == empty["filled box mIoU"] == 0.0
    broken = segment_metrics(examples[:1], ["<loc0001><seg001> circle"])
    assert broken["invalid objects"] == 1 and broken["mIoU"] == 0.0


def test_grade_reads_the_vae_once(vae_file, monkeypatch):
    "grade(vae=None) loads load_mask_vae()'s file once, not once per example"
    import paligemma_lib.segmentation as segmentation
    from paligemma_lib.data import KINDS, SyntheticDataset
    from paligemma_lib.segment_eval import grade

    monkeypatch.setenv("PALIGEMMA_SEG_VAE", str(vae_file[0]))
    monkeypatch.setattr(segmentation, "_ANSWER_VAES", {})
    calls, real = [], segmentation.load_mask_vae
    monkeypatch.setattr(
        segmentation,
        "load_mask_vae",
        lambda path=None: calls.append(path) or real(path),
    )
    data = SyntheticDataset("segments", split="validation", size=4)
    flat = {kind: torch.zeros(64, 64) for kind in KINDS}
    for i in range(len(data)):
        ex = data.example(i)
        assert grade(ex, ex.answer, None, flat)["invalid"] == 0
    assert calls == [str(vae_file[0])]


def test_the_scene_is_painted_as_pasting_each_mask_paints_it():
    "_paint (an index image and a palette) against Pillow's paste through masks"
    from PIL import Image

    from paligemma_lib.data import COLOURS
    from paligemma_lib.segmentation import _paint, _silhouette

    rng = __import__("random").Random(3)
    for n in (1, 2, 3, 3, 3):
        kinds = [rng.choice(("circle", "square", "triangle")) for _ in range(n)]
        full = [_silhouette(rng, kind) for kind in kinds]  # overlapping, often
        colours = [COLOURS[c] for c in rng.sample(list(COLOURS), n)]
        background = rng.randint(210, 250)
        pasted = Image.new("RGB", full[0].shape[::-1], (background,) * 3)
        for colour, mask in zip(colours, full):
            pasted.paste(colour, mask=Image.fromarray(mask.astype(np.uint8) * 255))
        painted = _paint(background, colours, full)
        assert painted.mode == "RGB"
        assert np.array_equal(np.asarray(painted), np.asarray(pasted))


def test_a_mask_box_is_its_pixels_extent():
    "_mask_box against np.nonzero's extremes, on random masks and edge cases"
    from paligemma_lib.segmentation import _mask_box

    gen = np.random.default_rng(0)
    masks = [gen.random((224, 224)) > 0.999 for _ in range(20)]
    masks += [np.eye(5, dtype=bool), np.pad(np.ones((1, 1), bool), ((3, 0), (0, 4)))]
    for mask in masks:
        ys, xs = np.nonzero(mask)
        expected = (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
        assert _mask_box(mask) == tuple(int(v) for v in expected)
