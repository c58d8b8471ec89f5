"""tools/gpu_decode.py, the GPU script's part `decode` (issue 50): its kernel classes
(on the names an H200's profile gave), the head told from the decoder's products,
the bytes a class must read, and the candidate fixes computing what the shipped step
computes. The part itself runs in CI as `tools/gpu_run.py --rehearse`."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_decode  # noqa: E402
import gpu_run  # noqa: E402

from paligemma_lib.generation import decode_step  # noqa: E402
from paligemma_lib.kv_cache import StaticKVCache  # noqa: E402
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration  # noqa: E402
from paligemma_lib.quantize import quantize_int8  # noqa: E402

# kernels of a compiled decoding step on an H200 (torch 2.11), from
# paligemma_lib/assets/records/int8-profile-h200-20261126-0527.json and its run's log
H200_KERNELS = {
    "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT": "products",
    "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT": "products",
    "cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3": "attention",
    "at::native::weight_int8pack_mm_kernel(float const*, signed char const*)": (
        "products"
    ),
    "triton_red_fused__to_copy_add_gelu_mul_sum_unsqueeze_4": "products",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norms, RoPE, elementwise",
    "triton_poi_fused_add_cat_mul_neg_slice_3": "norms, RoPE, elementwise",
    "void at::native::unrolled_elementwise_kernel<"
    "at::native::direct_copy_kernel_cuda": "copies",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, "
    "at::native::ArgMaxOps<c10::BFloat16>, unsigned int, long, 4> >": (
        "argmax, sampling"
    ),
    "Memcpy HtoD (Pageable -> Device)": "copies",
    "aten::mm": "products",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::add": "norms, RoPE, elementwise",
}


@pytest.mark.parametrize("name", H200_KERNELS)
def test_each_kernel_has_its_class(name):
    assert gpu_decode.kind(name) == H200_KERNELS[name]


def test_the_head_is_told_from_the_decoders_products_of_the_same_kernel():
    steps, layers = 3, 2
    shared = "nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT"
    kernels = []
    for _ in range(steps):  # a step: 2 layers' products, then the head
        kernels += [(shared, 10.0), ("nvjet_other", 4.0)] * layers
        kernels += [(shared, 250.0), ("triton_per_fused_mean_rsqrt_1", 1.0)]
    classes = gpu_decode.split_head(kernels, steps, layers)
    assert classes["LM head"] == [250.0] * steps
    assert sorted(classes["decoder Linears"]) == [4.0] * 6 + [10.0] * 6
    assert classes["norms, RoPE, elementwise"] == [1.0] * steps
    alone = [("gemv_head", 250.0), ("gemm_layer", 9.0), ("gemm_layer", 9.0)]
    classes = gpu_decode.split_head(alone * steps, steps, layers)
    assert classes["LM head"] == [250.0] * steps
    assert classes["decoder Linears"] == [9.0] * 2 * steps


def tiny():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu import tiny_config

    torch.manual_seed(0)
    config = tiny_config()
    return PaliGemmaForConditionalGeneration(config).eval(), config


def test_class_bytes_are_the_weights_and_cache_a_step_reads():
    model, config = tiny()
    t = config.text
    D, F, H, K, d = (t.hidden_size, t.intermediate_size, t.num_attention_heads,
                     t.num_key_value_heads, t.head_dim)  # fmt: skip
    per_layer = D * H * d * 2 + D * K * d * 2 + 3 * D * F  # q, o; k, v; MLP
    nbytes = gpu_decode.class_bytes(model, batch=3, cache_length=50)
    assert nbytes["decoder Linears"] == 4 * t.num_hidden_layers * per_layer  # fp32
    assert nbytes["LM head"] == 4 * t.vocab_size * D
    assert nbytes["attention"] == 4 * 2 * t.num_hidden_layers * 3 * K * d * 50
    assert nbytes["norms, RoPE, elementwise"] == 4 * D * (2 * t.num_hidden_layers + 1)
    assert nbytes["argmax, sampling"] == 4 * 3 * t.vocab_size
    quantize_int8(model)  # one byte a code, a float32 scale an output
    outputs = H * d + 2 * K * d + D + 2 * F + D
    int8 = gpu_decode.class_bytes(model, batch=3, cache_length=50)
    assert int8["decoder Linears"] == t.num_hidden_layers * (per_layer + 4 * outputs)


def test_the_limits_and_gaps_are_their_arithmetic():
    times = {c: [] for c in gpu_decode.CLASSES}
    times["LM head"] = [500.0, 500.0]  # µs, two steps
    times["decoder Linears"] = [1000.0] * 4
    nbytes = dict.fromkeys(gpu_decode.CLASSES, 0)
    nbytes |= {"LM head": 10**9, "decoder Linears": 4 * 10**9}
    row = {"generate ms a step": 4.0, "replayed ms a step": 3.0,
           "classes": gpu_decode.class_table(times, nbytes, steps=2)}  # fmt: skip
    row = gpu_decode.with_limits(row, bandwidth=4e12)
    head, linears = row["classes"]["LM head"], row["classes"]["decoder Linears"]
    assert (head["ms"], head["limit ms"], head["of limit"]) == (0.5, 0.25, 0.5)
    assert (linears["ms"], linears["limit ms"], linears["of limit"]) == (2.0, 1.0, 0.5)
    assert row["kernels ms a step"] == 2.5 and row["gaps ms a step"] == 0.5
    assert row["limit ms a step"] == 1.25 and row["of limit"] == 0.312


def one_step(model, config):
    "decode_step's logits at position 20 of a cache filled with random keys"
    torch.manual_seed(1)
    t, B, length = config.text, 2, 24
    cache = StaticKVCache(config, B, length)
    for layer in range(t.num_hidden_layers):
        cache.keys[layer].normal_(), cache.values[layer].normal_()
    cache.seek(20)
    mask = torch.ones(B, length, dtype=torch.long)
    mask[:, 21:] = 0
    token = torch.tensor([5, 7])
    return decode_step(model, token, torch.full((B, 1), 21), mask, cache)


@pytest.mark.parametrize("variant", ["grouped", "math", "tuned"])
def test_a_candidate_fix_computes_what_the_shipped_step_computes(variant):
    from paligemma_lib import gemma

    model, config = tiny()
    with torch.inference_mode():
        shipped = one_step(model, config)
        with gpu_decode.variant(variant):
            candidate = one_step(model, config)
    # fp32 both; the same sums in another order: a few ulps of the logits
    torch.testing.assert_close(candidate, shipped, rtol=1e-5, atol=1e-5)  # fp32 sums
    assert gemma.repeat_kv(torch.ones(1, 1, 2, 3), 4).shape == (1, 4, 2, 3)  # back


def test_grouped_attention_leaves_the_copies_of_repeat_kv_out():
    from paligemma_lib import gemma

    calls = []
    original = gemma.repeat_kv
    model, config = tiny()
    try:
        gemma.repeat_kv = lambda x, n: calls.append(n) or original(x, n)
        with torch.inference_mode():
            one_step(model, config)
            shipped_calls = len(calls)
            with gpu_decode.variant("grouped"):
                calls.clear()
                one_step(model, config)
    finally:
        gemma.repeat_kv = original
    assert shipped_calls == 2 * config.text.num_hidden_layers and calls == []


def test_decode_is_a_part_a_plain_run_leaves_out_and_fits_a_call():
    assert "decode" in gpu_run.PARTS and "decode" not in gpu_run.DEFAULT_PARTS
    assert gpu_run.INSTALL + gpu_run.BUDGETS["decode"] <= gpu_run.CALL
    assert gpu_run.REHEARSAL_BUDGETS["decode"] <= 120  # the issue: about 90 s
    labels = [f"{d}, batch {b}, {v}" for d, b, v in gpu_decode.ROWS]
    assert labels[:3] == ["bf16, batch 1, as shipped", "int8, batch 1, as shipped",
                          "bf16, batch 8, as shipped"]  # fmt: skip
    with pytest.raises(ValueError, match="unknown variant"):
        with gpu_decode.variant("fastest"):
            pass
