"""int8 weight-only quantisation (chapter 8.1): the arithmetic against an explicit
float64 computation, the error bound of one product, the state round trip, loading
with quantize="int8", the CLI's --quantize, and what is refused."""

import io
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_weights import tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from paligemma_lib import PaliGemmaProcessor, load_pretrained, save_pretrained
from paligemma_lib.data import SyntheticDataset
from paligemma_lib.generation import answer, generate
from paligemma_lib.lora import LoraConfig, add_lora
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.quantize import (
    DECODER_LINEARS,
    INT8_MAX,
    SUM_ROWS,
    Int8Linear,
    int8_weights,
    quantize_int8,
)

U32 = 2.0**-24  # float32's unit roundoff


def gamma(n: int, u: float) -> float:
    "Higham's gamma_n: the relative error bound of a sum of n products, rounding u"
    return n * u / (1 - n * u)


def weight(out_features=24, in_features=40, seed=0) -> torch.Tensor:
    "Rows of very different sizes, one of them all zero"
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    w *= torch.logspace(-3, 1, out_features)[:, None]
    w[3] = 0.0
    return w


def test_codes_and_scales_are_the_float64_arithmetic():
    w = weight()
    q, scale = int8_weights(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    w64 = w.double()
    amax = w64.abs().amax(dim=1)
    s_ref = torch.where(amax == 0, 1.0, amax / 127)  # the all-zero row: any scale
    # one rounding to float32 (half an ulp) plus at most one step up (one ulp): at
    # most 1.5 ulp, an ulp being at most 2 * U32 of the value
    assert ((scale.double() - s_ref).abs() <= 1.5 * 2 * U32 * s_ref).all()
    assert scale.double()[3] == 1.0 and (q[3] == 0).all()
    q_ref = torch.round(w64 / scale.double()[:, None]).clamp(-127, 127)
    # w / scale in float32 is off by at most |w / scale| * U32 <= 127 * U32: the codes
    # are the float64 ones except where the float64 ratio is that close to a tie
    ratio = w64 / scale.double()[:, None]
    near_tie = ((ratio - ratio.floor()) - 0.5).abs() <= 127 * U32
    assert torch.equal(q.double()[~near_tie], q_ref[~near_tie])
    assert ((q.double() - q_ref).abs() <= 1).all()
    assert (q.abs().amax(dim=1)[amax > 0] == INT8_MAX).all()  # the row's max uses 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_weight_moves_by_at_most_half_a_step(dtype):
    w = weight().to(dtype)
    q, scale = int8_weights(w)
    assert scale.dtype == dtype
    error = (q.double() * scale.double()[:, None] - w.double()).abs()  # exact in f64
    # half a step, plus float32's rounding of w / scale (at most 127 * U32 of a step;
    # the division runs in float32 for bf16 weights too)
    assert (error <= scale.double()[:, None] * (0.5 + 127 * U32)).all()


def test_forward_is_the_dequantised_product_and_within_the_bound():
    torch.manual_seed(0)
    linear = nn.Linear(40, 24, bias=True)
    with torch.no_grad():
        linear.weight.copy_(weight())
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(5, 40)
    with torch.no_grad():
        y_int8, y = layer(x), linear(x)
    q64, s64 = layer.weight_int8.double(), layer.weight_scale.double()
    x64, w_hat = x.double(), q64 * s64[:, None]
    reference = F.linear(x64, w_hat, linear.bias.double())  # the dequantised layer
    n = linear.in_features
    magnitudes = F.linear(x64.abs(), w_hat.abs(), linear.bias.double().abs())
    # float32: n products summed (gamma_n), then the scaling and the bias (2 roundings)
    rounding = gamma(n + 2, U32) * magnitudes
    assert ((y_int8.double() - reference).abs() <= rounding).all()
    # the bound of one product against the float layer: s/2 * sum|x| per output, plus
    # the float32 rounding of both sides
    bound = s64 / 2 * x64.abs().sum(-1, keepdim=True)
    both = rounding + gamma(n + 1, U32) * F.linear(
        x64.abs(), linear.weight.double().abs(), linear.bias.double().abs()
    )
    assert ((y_int8.double() - y.double()).abs() <= bound + both).all()


def compiled_graph(module, x):
    "The FX graph torch.compile traces for module(x), and its output"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    y = torch.compile(module, backend=backend)(x)
    return graphs[0], y


@pytest.mark.parametrize("rows", [1, 5, SUM_ROWS])
def test_compiled_decoding_rows_take_the_sum_route(rows):
    """Compiled, a few rows (decoding) multiply as a product and a sum over the
    inputs: Inductor fuses it, where it hands the cast's F.linear to
    torch._weight_int8pack_mm, whose CUDA kernel took 10x as long on an H200
    (paligemma_lib/assets/records/int8-profile-h200-20261126-0527.json)"""
    torch.manual_seed(0)
    linear = nn.Linear(40, 24, bias=True)  # 40 inputs: the cast route on a CPU
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(rows, 40)
    graph, y = compiled_graph(layer, x)
    targets = {str(node.target) for node in graph.nodes}
    assert "sum" in targets and not any("linear" in t for t in targets), targets
    with torch.no_grad():
        eager = layer.cast_product(x) + layer.bias
    q64, s64 = layer.weight_int8.double(), layer.weight_scale.double()
    magnitudes = F.linear(x.double().abs(), (q64 * s64[:, None]).abs())
    magnitudes += layer.bias.double().abs()
    # each side: 40 products summed, the scaling and the bias in float32
    # (gamma_42 of the magnitudes each), in either order
    bound = 2 * gamma(40 + 2, U32) * magnitudes
    assert ((y.double() - eager.double()).abs() <= bound).all()


def test_compiled_float16_sum_scales_the_codes_first():
    """float16 as cast_product does it: the codes scaled before the products, so no
    product of an activation and a code up to 127 leaves float16's range"""
    torch.manual_seed(0)
    linear = nn.Linear(40, 24).half()  # 40: the cast route on a CPU
    with torch.no_grad():
        linear.weight.mul_(0.05)  # a real layer's weights: |w| well under 1
    layer = Int8Linear.from_linear(linear)
    x = (torch.randn(2, 40) * 300).half()  # x * 127 * ... would overflow unscaled
    graph, y = compiled_graph(layer, x)
    assert "sum" in {str(node.target) for node in graph.nodes}
    assert torch.isfinite(y).all()
    q64, s64 = layer.weight_int8.double(), layer.weight_scale.double()
    w_hat = q64 * s64[:, None]
    reference = F.linear(x.double(), w_hat, linear.bias.double())
    magnitudes = F.linear(x.double().abs(), w_hat.abs(), linear.bias.double().abs())
    # float16 (u = 2^-11): the scaled codes and the products rounded once each, 40
    # terms summed, the bias added: gamma_67 of the magnitudes
    assert (
        (y.double() - reference).abs() <= gamma(40 + 3, 2.0**-11) * magnitudes
    ).all()


def test_compiled_prefill_rows_keep_the_cast_route():
    "More rows than SUM_ROWS (a prompt): the product and sum would be [rows, out, in]"
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(nn.Linear(40, 24))
    graph, _ = compiled_graph(layer, torch.randn(SUM_ROWS + 1, 40))
    assert any("linear" in str(node.target) for node in graph.nodes)


def tiny_model(seed=0) -> PaliGemmaForConditionalGeneration:
    torch.manual_seed(seed)
    return PaliGemmaForConditionalGeneration(tiny_config()).eval()


def inputs(config):
    ids = torch.tensor([[config.image_token_index] * config.num_image_tokens + [2, 7]])
    size = config.vision.image_size
    return dict(
        input_ids=ids,
        pixel_values=torch.randn(1, 3, size, size, generator=torch.Generator()),
        attention_mask=torch.ones_like(ids),
        token_type_ids=torch.zeros_like(ids),
    )


def test_quantize_int8_replaces_the_decoder_linears_only():
    model = tiny_model()
    names = quantize_int8(model)
    layers = model.config.text.num_hidden_layers
    assert len(names) == len(DECODER_LINEARS) * layers
    assert all(isinstance(model.get_submodule(n), Int8Linear) for n in names)
    assert isinstance(model.multi_modal_projector.linear, nn.Linear)
    assert not any(isinstance(m, Int8Linear) for m in model.vision_tower.modules())
    text = model.language_model
    assert text.lm_head.weight is text.model.embed_tokens.weight  # still tied
    with pytest.raises(ValueError, match="already quantised"):
        quantize_int8(model)


def test_state_round_trip():
    "Bit-exact on purpose: the same tensors through the same operations"
    model, other = tiny_model(0), tiny_model(1)
    quantize_int8(model)
    quantize_int8(other)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer), strict=True)
    batch = inputs(model.config)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, other(**batch).logits)


def test_load_pretrained_int8_is_quantize_int8_of_the_float_model(tmp_path):
    "Bit-exact on purpose: the same weights quantised by the same function"
    save_pretrained(tiny_model(), tmp_path)
    loaded = load_pretrained(tmp_path, dtype="fp32", quantize="int8")
    by_hand = load_pretrained(tmp_path, dtype="fp32")
    quantize_int8(by_hand)
    assert sum(isinstance(m, Int8Linear) for m in loaded.modules()) == len(
        DECODER_LINEARS
    ) * len(loaded.language_model.model.layers)
    batch = inputs(loaded.config)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, by_hand(**batch).logits)
    with pytest.raises(ValueError, match=r"quantize='int4': choose None .* or 'int8'"):
        load_pretrained(tmp_path, quantize="int4")


def test_compiled_generation_runs_the_int8_model():
    "generate(compile=True) gives the eager tokens on an int8 model"
    model = tiny_model()
    quantize_int8(model)
    kw = dict(inputs(model.config), max_new_tokens=3, eos_token_id=None)
    eager = generate(model, **kw, cache="static")
    assert torch.equal(generate(model, **kw, cache="static", compile=True), eager)


def test_lora_is_refused_on_an_int8_model():
    model = tiny_model()
    quantize_int8(model)
    with pytest.raises(ValueError, match=r"\(Int8Linear\), not an nn.Linear"):
        add_lora(model, LoraConfig())
    lora = tiny_model()
    add_lora(lora, LoraConfig())
    with pytest.raises(ValueError, match=r"merge_lora\(model\) first"):
        quantize_int8(lora)


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "paligemma_lib", *map(str, args)],
        capture_output=True,
        text=True,
    )


def test_cli_generate_int8_on_the_nano_model(tmp_path):
    example = SyntheticDataset("shapes", "test", task="count").example(5000)
    example.image.save(tmp_path / "image.png")
    args = ["generate", "--image", tmp_path / "image.png", "--prompt", example.prompt]
    run = cli(*args, "--quantize", "int8", "--device", "cpu")
    assert run.returncode == 0, run.stderr
    model = load_pretrained("nano", quantize="int8")
    expected = answer(
        model, PaliGemmaProcessor.from_pretrained("nano"), example.image, example.prompt
    )
    assert run.stdout == expected + "\n" and expected.strip()
    wrong = cli(*args, "--quantize", "int4")
    assert wrong.returncode == 2 and "invalid choice: 'int4'" in wrong.stderr
    with_adapter = cli(*args, "--quantize", "int8", "--adapter", "receipts")
    assert with_adapter.returncode == 1 and "Traceback" not in with_adapter.stderr
    assert "--quantize int8 with --adapter" in with_adapter.stderr


def test_save_pretrained_refuses_an_int8_model(tmp_path):
    "save_pretrained writes parameters: an int8 model's weights would be lost, silently"
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(tiny_config()).eval()
    quantize_int8(model)
    with pytest.raises(ValueError, match="quantise when loading"):
        save_pretrained(model, tmp_path / "int8")
    assert not (tmp_path / "int8").exists()


@pytest.mark.parametrize("n", [320, 300])  # the kernel's inputs: multiples of 16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_activations_on_a_cpu_take_the_int8_kernel(dtype, n, monkeypatch):
    """The kernel reads the codes (float32 activations rounded to bfloat16 for it);
    the cast route where the width is one the kernel cannot take (it would crash the
    process); both the exact sum, rounded"""
    torch.manual_seed(0)
    linear = nn.Linear(n, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, n) * 0.05)
    layer = Int8Linear.from_linear(linear.to(dtype))
    calls = []
    kernel = torch._weight_int8pack_mm
    monkeypatch.setattr(
        torch, "_weight_int8pack_mm", lambda *a: calls.append(1) or kernel(*a)
    )
    x = torch.randn(2, 3, n).to(dtype)  # [B, S, in]: rows flattened for the kernel
    with torch.no_grad():
        y = layer(x)
    assert calls == ([] if n % 16 else [1])
    assert y.shape == (2, 3, 40) and y.dtype == dtype
    q64 = layer.weight_int8.double() * layer.weight_scale.double()[:, None]
    b64 = layer.bias.double()
    exact = F.linear(x.double(), q64, b64)
    size = F.linear(x.double().abs(), q64.abs(), b64.abs())
    u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
    # float32 accumulation of n products, then up to three roundings in `dtype`
    # (the product's output, the scaling, the bias)
    allowed = (n * 2.0**-24 + 3 * u[dtype]) * size
    if dtype == torch.float32 and n % 16 == 0:
        # x rounded to bfloat16, the float32 sum rounded to bfloat16, then the
        # scaling and the bias in float32
        c = (1 + 2.0**-8) ** 2 * (1 + gamma(n, U32)) * (1 + U32) ** 2 - 1
        allowed = c * size
    assert ((y.double() - exact).abs() <= allowed).all()


class FloatOutputs(TorchDispatchMode):
    "Records the shape of every floating-point tensor an operation returns"

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def weight_sized(shapes, layer) -> list:
    "The recorded tensors as large as the layer's weight"
    return [
        (op, shape)
        for op, shape in shapes
        if torch.Size(shape).numel() >= layer.out_features * layer.in_features
    ]


@pytest.mark.parametrize("bias", [False, True])
def test_float32_on_a_cpu_never_builds_a_float_weight(bias):
    """Issue 33: the cast route wrote a float32 copy of the whole weight on every
    call (about 15x nn.Linear's time at Gemma-2B widths). No timing: no operation of
    a float32 forward may return a floating-point tensor as large as the weight. The
    recorder is shown to see such a copy: cast_product's"""
    torch.manual_seed(0)
    linear = nn.Linear(256, 320, bias=bias)  # multiples of 16, as Gemma's widths
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(2, 256)  # [tokens, in]: fewer elements than the weight
    with torch.no_grad(), FloatOutputs() as seen:
        y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (2, 320)
    assert layer.route(x) == "int8 kernel, bfloat16"
    assert weight_sized(seen.shapes, layer) == [], seen.shapes
    with torch.no_grad(), FloatOutputs() as cast:
        layer.cast_product(x)
    assert weight_sized(cast.shapes, layer)  # the copy the route above avoids


def test_float32_int8_model_never_builds_a_float_weight():
    "The same through a whole float32 model's forward: no decoder weight in float"
    model = tiny_model()
    quantize_int8(model)
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    weights = {(m.out_features, m.in_features) for m in layers}
    with torch.no_grad(), FloatOutputs() as seen:
        logits = model(**inputs(model.config)).logits
    assert torch.isfinite(logits).all()
    routes = {m.route(torch.ones(1, m.in_features)) for m in layers}
    assert routes == {"int8 kernel, bfloat16"}  # the tiny widths: multiples of 16
    copies = [(op, s) for op, s in seen.shapes if s in weights]
    assert copies == [], copies[:3]


def test_a_dtype_change_after_quantising_is_refused():
    """Issue 33: .to(bfloat16) after quantising rounded the scales again, without
    the step up, so a weight could move by about a step. Without the refusal, the
    bound below fails: rounded scales move a code-127 weight by up to 127 * 2^-8 of
    a step beyond its half step"""
    torch.manual_seed(0)
    linear = nn.Linear(256, 512, bias=False)
    w = linear.weight.detach().clone()
    layer = Int8Linear.from_linear(linear)
    with pytest.raises(
        ValueError, match=r"float32 -> torch.bfloat16\): .* choose the "
    ):
        layer.to(torch.bfloat16)
    scale = layer.weight_scale
    assert scale.dtype == torch.float32
    step = scale.double()[:, None]
    error = (layer.weight_int8.double() * step - w.double()).abs()
    assert (error <= step * (0.5 + 127 * U32)).all()
    # what the change would have done
    rounded = scale.to(torch.bfloat16).double()[:, None]
    moved = (layer.weight_int8.double() * rounded - w.double()).abs()
    assert (moved > rounded * (0.5 + 127 * U32)).any()
    model = tiny_model()
    quantize_int8(model)
    for change in (lambda m: m.half(), lambda m: m.to(torch.bfloat16)):
        with pytest.raises(ValueError, match="then quantise"):
            change(model)
    assert layer.to("cpu") is layer and layer.to(torch.float32) is layer


def fp16_bound(x: torch.Tensor, layer: Int8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float64 product of x and the layer's codes times scales, what it may be
    off by in float16). Each weight q*s rounded once to float16 (relative u = 2^-11,
    or 2^-25 absolute where subnormal); the products of two float16 numbers exact in
    float32 and summed there (the CPU's float16 products, and cuBLAS's, accumulate in
    float32): gamma_n = n u32 / (1 - n u32) of the sum of their sizes; the output
    rounded once to float16 (relative u, or 2^-25 absolute below 2^-14). So
    |error| <= ((1+u)^2 (1+gamma_n) - 1) sum|x||w|
               + 2^-25 ((1+u)(1+gamma_n) sum|x| + 1)"""
    u16, n = 2.0**-11, layer.in_features
    gamma = n * U32 / (1 - n * U32)
    w64 = layer.weight_int8.double() * layer.weight_scale.double()[:, None]
    exact = F.linear(x.double(), w64)
    size = F.linear(x.double().abs(), w64.abs())
    x_size = x.double().abs().sum(-1, keepdim=True)
    subnormal = 2.0**-25 * ((1 + u16) * (1 + gamma) * x_size + 1)
    return exact, ((1 + u16) ** 2 * (1 + gamma) - 1) * size + subnormal


def test_float16_cast_route_does_not_overflow():
    """Issue 28's reproduction: with the scale applied after the sum, the sum of x
    times codes up to 127 is 127/max|W| times the output, and float16 overflows (39
    infinities here where the largest output is 75). Seen to catch: cast_product
    scaling the output in float16 as in the other dtypes."""
    torch.manual_seed(0)
    linear = nn.Linear(2056, 64, bias=False)  # 2056 % 16 != 0: the cast route
    nn.init.normal_(linear.weight, std=0.02)
    layer = Int8Linear.from_linear(linear.half())
    x = (30 * torch.randn(4, 2056)).half()
    with torch.no_grad():
        y = layer(x)
    exact, allowed = fp16_bound(x, layer)
    unscaled = F.linear(x.double(), layer.weight_int8.double())
    assert unscaled.abs().max() > torch.finfo(torch.float16).max  # the old route: inf
    assert exact.abs().max() < 100
    assert torch.isfinite(y).all()
    assert ((y.double() - exact).abs() <= allowed).all()


def test_float16_routes_on_activations_of_a_real_forward():
    """Realistic magnitudes: the inputs every decoder Linear of the shipped nano model
    sees in a float16 forward of four test scenes (recorded by hooks), through both
    routes, the CPU's int8 kernel (nano's widths are multiples of 16) and the cast
    route a GPU takes, each against float64 of the same codes and scales. (On nano
    the old route stayed finite: its largest sum before the scale was about 24,000,
    37% of float16's limit; the reproduction above is what overflows.)"""
    model = load_pretrained("nano").to(torch.float16).eval()
    processor = PaliGemmaProcessor.from_pretrained("nano")
    scenes = SyntheticDataset({"shapes": 1}, split="test", size=4)
    images, prompts, _ = zip(*(scenes[i] for i in range(4)))
    batch = processor(list(images), list(prompts))
    names = quantize_int8(model)
    seen = {}
    hooks = [
        model.get_submodule(name).register_forward_pre_hook(
            lambda module, args, name=name: seen.setdefault(name, args[0].clone())
        )
        for name in names
    ]
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids,
            pixel_values=batch.pixel_values.half(),
            attention_mask=batch.attention_mask,
            token_type_ids=batch.token_type_ids,
        ).logits
    for hook in hooks:
        hook.remove()
    assert torch.isfinite(logits).all() and sorted(seen) == sorted(names)
    largest = max(x.abs().max().item() for x in seen.values())
    assert largest > 10  # float16 activations of a real model, not unit-sized ones
    for name, x in seen.items():
        layer = model.get_submodule(name)
        exact, allowed = fp16_bound(x, layer)
        with torch.no_grad():
            routes = {"kernel": layer(x), "cast": layer.cast_product(x)}
        for route, y in routes.items():
            assert y.dtype == torch.float16, (name, route)
            # the kernel scales after its float32 sum: one rounding fewer, same bound
            assert ((y.double() - exact).abs() <= allowed).all(), (name, route)
