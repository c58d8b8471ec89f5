"""Chapter 10: LoRA. Target matching against PEFT's own matcher, parameter counts
against PEFT's, merge and unmerge, adapters both ways between us and PEFT on
transformers' PaliGemma, and the errors."""

import copy
import json

import peft
import pytest
import torch
import transformers
from hf_reference import transformers_pair
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists
from safetensors import safe_open
from safetensors.torch import save_file

from paligemma_lib.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    load_adapter,
    peft_name,
    save_adapter,
)
from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig
from paligemma_lib.lora import (
    ALL_LINEAR,
    DEFAULT_TARGETS,
    LoraConfig,
    LoraLinear,
    add_lora,
    count_parameters,
    lora_modules,
    lora_state_dict,
    matches,
    merge_lora,
    unmerge_lora,
)
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.weights import save_pretrained

IMAGE = 299
LANGUAGE_ONLY = (
    r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    "Tiny models: one thread is faster, and stays fast on busy cores"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(heads=4, kv_heads=1):
    return PaliGemmaConfig(
        vision=VisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=28,
            patch_size=14,
        ),
        text=TextConfig(
            vocab_size=300,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=16,
        ),
        image_token_index=IMAGE,
        projection_dim=48,
    )


ATTENTION = {"MQA": config(4, 1), "GQA": config(4, 2)}


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat(
        [
            torch.full((2, 4), IMAGE),
            torch.tensor([[2], [2]]),
            torch.randint(3, 280, (2, 5), generator=g),
        ],
        1,
    )
    return dict(
        input_ids=ids,
        pixel_values=torch.randn(2, 3, 28, 28, generator=g),
        attention_mask=torch.ones_like(ids),
        token_type_ids=torch.cat([torch.zeros(2, 7), torch.ones(2, 3)], 1).long(),
    )


def logits(model, seed=0):
    with torch.no_grad():
        return model.eval()(**inputs(seed)).logits


def randomise_lora_B(named_parameters, seed=1, std=0.3):
    "A fresh adapter is a no-op (B = 0): give B values, as training would"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_parameters:
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.fixture(scope="module")
def meta_3b():
    "Our PaliGemma-3B and transformers' on meta: names and shapes, no memory"
    with torch.device("meta"):
        ours = PaliGemmaForConditionalGeneration(PaliGemmaConfig())
        hf_config = transformers.PaliGemmaConfig(**PaliGemmaConfig().to_hf())
        theirs = transformers.PaliGemmaForConditionalGeneration(hf_config)
    return ours, theirs


# ---------------------------------------------------------------- target matching

SPECS = [
    DEFAULT_TARGETS,
    ["q_proj"],
    ["self_attn.q_proj", "mlp.fc1"],
    ["language_model.model.layers.3.mlp.up_proj"],
    ["model.language_model.layers.3.mlp.up_proj"],
    ["proj", "_proj", "q"],
    ["layers.0.self_attn.q_proj"],
    ["linear"],
    LANGUAGE_ONLY,
    r"q_proj",
    r".*q_proj",
    r".*\.layers\.1\d\..*_proj",
    r"(vision_tower|model\.vision_tower).*\.(fc1|fc2)",
    r".*multi_modal_projector.*",
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_matching_is_peft_matching(spec, meta_3b):
    ours, theirs = meta_3b
    names = [n for n, _ in ours.named_modules()] + [
        n for n, _ in theirs.named_modules()
    ]
    names += ["q_proj", "my_q_proj", "a.my_q_proj", "a.q_proj.b", "xq_proj", ""]
    peft_config = peft.LoraConfig(target_modules=spec)
    for name in names:
        assert matches(spec, name) == bool(
            check_target_module_exists(peft_config, name)
        ), (spec, name)


# ---------------------------------------------------------------- counts


@pytest.mark.parametrize(
    "targets",
    [DEFAULT_TARGETS, LANGUAGE_ONLY, ALL_LINEAR],
    ids=["default", "text", "all-linear"],
)
def test_counts_at_3b_equal_peft(targets):
    with torch.device("meta"):
        ours = PaliGemmaForConditionalGeneration(PaliGemmaConfig())
        hf_config = transformers.PaliGemmaConfig(**PaliGemmaConfig().to_hf())
        theirs = transformers.PaliGemmaForConditionalGeneration(hf_config)
    wrapped = add_lora(ours, LoraConfig(r=8, alpha=16, target_modules=targets))
    theirs = peft.get_peft_model(
        theirs, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets)
    )
    assert count_parameters(ours) == theirs.get_nb_trainable_parameters()
    peft_names = {
        n.removeprefix(PEFT_PREFIX)
        for n, m in theirs.named_modules()
        if isinstance(m, LoraLayer)
    }
    assert {peft_name(n) for n in wrapped} == peft_names
    if targets == ALL_LINEAR:  # every Linear but the LM head
        assert "language_model.lm_head" not in wrapped
        assert len(wrapped) == 18 * 7 + 27 * 6 + 1  # and the projector
        return
    text_only = 18 * 8 * (4 * 2048 + 2 * (2048 + 256) + 3 * (2048 + 16384))
    vision = 27 * 3 * 8 * 2 * 1152  # q_proj, k_proj, v_proj of SigLIP
    expected = text_only + vision if targets == DEFAULT_TARGETS else text_only
    assert count_parameters(ours)[0] == expected
    assert len(wrapped) == (207 if targets == DEFAULT_TARGETS else 126)


def test_add_lora_freezes_all_but_adapters_and_keeps_dtypes():
    model = PaliGemmaForConditionalGeneration(config()).to(torch.bfloat16)
    names = add_lora(model, LoraConfig(r=4, target_modules=["q_proj", "fc2"]))
    assert len(names) == 2 * 2 + 2  # q_proj in both stacks, fc2 in SigLIP
    for name, p in model.named_parameters():
        is_lora = ".lora_A." in name or ".lora_B." in name
        assert p.requires_grad == is_lora, name
        assert p.dtype == (torch.float32 if is_lora else torch.bfloat16), name
    trainable, total = count_parameters(model)
    assert trainable == sum(
        4 * (m.base_layer.in_features + m.base_layer.out_features)
        for m in lora_modules(model).values()
    )
    assert total == sum(p.numel() for p in model.parameters())
    out = model(**{**inputs(), "pixel_values": inputs()["pixel_values"].bfloat16()})
    assert out.logits.dtype == torch.bfloat16


# ---------------------------------------------------------------- the wrapper


def test_lora_linear_wraps_without_copying():
    torch.manual_seed(0)
    linear = torch.nn.Linear(20, 12)
    lora = LoraLinear(linear, r=3, alpha=6)
    x = torch.randn(4, 20)
    assert lora.base_layer is linear
    assert torch.equal(lora(x), linear(x))  # B = 0
    assert torch.count_nonzero(lora.lora_A.weight) == 3 * 20
    torch.nn.init.normal_(lora.lora_B.weight)
    delta = lora.lora_B.weight @ lora.lora_A.weight * 2.0
    torch.testing.assert_close(lora(x), linear(x) + x @ delta.T)
    torch.testing.assert_close(lora.delta_weight(), delta)


def peft_pair(base, dtype=torch.float32, seed=0):
    "Ours and PEFT's LoRA (r=4, alpha=8) on copies of the one-Linear model `base`"
    torch.manual_seed(seed)
    ours = copy.deepcopy(base)
    add_lora(ours, LoraConfig(r=4, alpha=8, target_modules=["0"], dtype=dtype))
    torch.manual_seed(seed)
    theirs = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"])
    )
    return ours, theirs


def test_lora_A_init_is_peft_init():
    ours, theirs = peft_pair(torch.nn.Sequential(torch.nn.Linear(40, 24)), seed=5)
    (A,) = [p for n, p in theirs.named_parameters() if "lora_A" in n]
    (B,) = [p for n, p in theirs.named_parameters() if "lora_B" in n]
    assert torch.equal(ours[0].lora_A.weight, A)  # the same random numbers
    assert torch.equal(ours[0].lora_B.weight, B) and not B.any()


def test_bf16_base_output_is_peft_output_bit_for_bit():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 48)).to(torch.bfloat16)
    ours, theirs = peft_pair(base)
    randomise_lora_B(ours.named_parameters(), std=0.05)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_" in name:
                assert p.dtype == torch.float32  # PEFT's adapters are fp32 too
                part = "lora_A" if "lora_A" in name else "lora_B"
                p.copy_(getattr(ours[0], part).weight)
        x = torch.randn(16, 64).bfloat16()
        out = ours(x)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, theirs(x))  # the sum is rounded once, as PEFT's


@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_a_bf16_base(lora_dtype):
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config()).to(torch.bfloat16)
    add_lora(model, LoraConfig(r=4, target_modules=["q_proj", "fc1"], dtype=lora_dtype))
    base_before = {
        n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(trainable, lr=1e-2)
    x = {**inputs(), "pixel_values": inputs()["pixel_values"].bfloat16()}
    loss = model(**x, labels=x["input_ids"]).loss
    loss.backward()
    optimiser.step()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.dtype == p.grad.dtype == lora_dtype, name
            assert torch.isfinite(p.grad).all(), name
        else:
            assert p.grad is None and torch.equal(p, base_before[name]), name
    assert any(p.grad.any() for p in trainable)


def test_dropout_only_on_the_lora_path():
    torch.manual_seed(0)
    linear = torch.nn.Linear(20, 12)
    lora = LoraLinear(linear, r=3, alpha=3, dropout=0.9).train()
    x = torch.randn(64, 20)
    assert torch.equal(lora(x), linear(x))  # B = 0: dropout cannot reach the base
    torch.nn.init.normal_(lora.lora_B.weight)
    torch.manual_seed(3)
    out = lora(x)
    torch.manual_seed(3)
    dropped = torch.nn.functional.dropout(x, 0.9)
    expected = linear(x) + dropped @ (lora.lora_B.weight @ lora.lora_A.weight).T
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------- merge and unmerge


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merge_then_unmerge(dtype):
    torch.manual_seed(0)
    reference = PaliGemmaForConditionalGeneration(config())
    add_lora(reference, LoraConfig(r=4, alpha=8))
    randomise_lora_B(reference.named_parameters())
    model = copy.deepcopy(reference)
    for name, p in model.named_parameters():
        if "lora_" not in name:
            p.data = p.data.to(dtype)
    x = {**inputs(), "pixel_values": inputs()["pixel_values"].to(dtype)}
    with torch.no_grad():
        ref = reference(**inputs()).logits
        unmerged = model(**x).logits.float()
        adapters = merge_lora(model)
        merged = model(**x).logits.float()
    assert not lora_modules(model) and model.merged_lora is adapters
    assert all(type(m) is not LoraLinear for m in model.modules())
    # Derived as in chapter 10 (c058): k operations write a rounded result on the path
    # from the pixels to a logit (12 per SigLIP layer, 14 per Gemma layer, 8 outside),
    # each off by at most half a step of `dtype` of its value, adding up to first order
    # (every layer normalises its input). bf16 products accumulate in fp32 and round
    # once; fp32 products round at each of up to `width` additions, so an fp32 operation
    # counts `width` roundings.
    c = config()
    k = 12 * c.vision.num_hidden_layers + 14 * c.text.num_hidden_layers + 8
    width = max(c.vision.intermediate_size, c.text.intermediate_size)
    roundings = k * (width if dtype == torch.float32 else 1)
    step = torch.finfo(dtype).eps * 2 ** ref.abs().max().log2().floor().item()
    for a, b, models in [(merged, unmerged, 2), (merged, ref, 1), (unmerged, ref, 1)]:
        # the reference is fp32: in the fp32 case it is one of the two rounded models
        torch.testing.assert_close(a, b, atol=models * roundings * step, rtol=0)
    unmerge_lora(model)
    assert set(lora_modules(model)) == set(adapters) and not hasattr(
        model, "merged_lora"
    )
    eps = torch.finfo(dtype).eps
    for name, lora in lora_modules(reference).items():
        original = lora.base_layer.weight.to(dtype).float()
        restored = model.get_submodule(name).base_layer.weight.float()
        bound = eps * (original.abs() + lora.delta_weight().abs())
        assert ((restored - original).abs() <= bound).all(), name


def test_merged_model_saves_for_transformers(tmp_path):
    ours, theirs = transformers_pair(config(), seed=0)
    add_lora(ours, LoraConfig(r=4, alpha=8))
    randomise_lora_B(ours.named_parameters())
    with_adapter = logits(ours)
    merge_lora(ours)
    save_pretrained(ours, tmp_path)
    loaded = transformers.PaliGemmaForConditionalGeneration.from_pretrained(tmp_path)
    # fp32 against transformers' fp32: other kernels and orders (eager vs sdpa
    # attention), products of width <= 96: ~96 x 2^-24 ~ 6e-6 relative each, over 4
    # layers and a softmax; 1e-4 for logits of order 1
    torch.testing.assert_close(logits(loaded), with_adapter, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- PEFT round trips

ROUND_TRIP_TARGETS = {
    "default": DEFAULT_TARGETS,  # q/k/v of SigLIP too
    "vision": ["out_proj", "fc1", "fc2", "multi_modal_projector.linear"],
    "regex": r".*language_model.*\.(k_proj|down_proj)|.*vision_tower.*\.(q_proj|fc2)",
    "all-linear": ALL_LINEAR,  # every Linear but the LM head, in both
}


@pytest.mark.parametrize("targets", ROUND_TRIP_TARGETS, ids=str)
@pytest.mark.parametrize("attention", ATTENTION, ids=str)
def test_our_adapter_loads_into_peft(attention, targets, tmp_path):
    ours, theirs = transformers_pair(ATTENTION[attention], seed=0)
    names = add_lora(
        ours, LoraConfig(r=4, alpha=12, target_modules=ROUND_TRIP_TARGETS[targets])
    )
    randomise_lora_B(ours.named_parameters())
    save_adapter(ours, tmp_path)
    theirs = peft.PeftModel.from_pretrained(theirs, tmp_path)
    peft_names = {
        n.removeprefix(PEFT_PREFIX)
        for n, m in theirs.named_modules()
        if isinstance(m, LoraLayer)
    }
    assert peft_names == {peft_name(n) for n in names}
    # loaded for inference, PEFT's adapter is frozen: compare the totals
    assert count_parameters(ours)[1] == theirs.get_nb_trainable_parameters()[1]
    # fp32 against transformers' fp32: other kernels and orders (eager vs sdpa
    # attention), products of width <= 96: ~96 x 2^-24 ~ 6e-6 relative each, over 4
    # layers and a softmax; 1e-4 for logits of order 1
    torch.testing.assert_close(logits(theirs), logits(ours), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("targets", ROUND_TRIP_TARGETS, ids=str)
@pytest.mark.parametrize("attention", ATTENTION, ids=str)
def test_peft_adapter_loads_into_ours(attention, targets, tmp_path):
    ours, theirs = transformers_pair(ATTENTION[attention], seed=0)
    before = logits(ours)
    theirs = peft.get_peft_model(
        theirs,
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=ROUND_TRIP_TARGETS[targets]),
    )
    randomise_lora_B(theirs.named_parameters())
    theirs.save_pretrained(tmp_path)
    names = load_adapter(ours, tmp_path)
    assert count_parameters(ours) == theirs.get_nb_trainable_parameters()
    expected = logits(theirs)
    assert not torch.allclose(expected, before, atol=1e-2)  # the adapter matters
    # fp32 against transformers' fp32: other kernels and orders (eager vs sdpa
    # attention), products of width <= 96: ~96 x 2^-24 ~ 6e-6 relative each, over 4
    # layers and a softmax; 1e-4 for logits of order 1
    torch.testing.assert_close(logits(ours), expected, atol=1e-4, rtol=1e-4)
    # saved again by us, the same tensors under the same names
    save_adapter(ours, tmp_path / "again")
    assert _tensors(tmp_path / "again").keys() == _tensors(tmp_path).keys()
    for key, t in _tensors(tmp_path).items():
        assert torch.equal(_tensors(tmp_path / "again")[key], t), key
    assert len(names) == len(lora_modules(ours))


def _tensors(folder):
    with safe_open(folder / ADAPTER_WEIGHTS, framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


OLD_SPELLINGS = {
    "4.x": {  # transformers 4.x before 4.52, as adapters on the Hub are saved
        "base_model.model.model.language_model.": (
            "base_model.model.language_model.model."
        ),
        "base_model.model.model.vision_tower.": (
            "base_model.model.vision_tower.vision_model."
        ),
        "base_model.model.model.multi_modal_projector.": (
            "base_model.model.multi_modal_projector."
        ),
    },
    "4.5x": {  # transformers 4.52 to 4.57, in memory: only SigLIP differs from 5
        "base_model.model.model.language_model.": (
            "base_model.model.model.language_model."
        ),
        "base_model.model.model.vision_tower.": (
            "base_model.model.model.vision_tower.vision_model."
        ),
        "base_model.model.model.multi_modal_projector.": (
            "base_model.model.model.multi_modal_projector."
        ),
    },
}


@pytest.mark.parametrize("spelling", OLD_SPELLINGS, ids=str)
def test_transformers_4_spelling_loads(spelling, tmp_path):
    ours, theirs = transformers_pair(config(), seed=0)
    theirs = peft.get_peft_model(
        theirs,
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "fc1", "linear"]),
    )
    randomise_lora_B(theirs.named_parameters())
    theirs.save_pretrained(tmp_path / "new")
    old = tmp_path / "old"
    old.mkdir()
    renamed = {}
    old_spelling = OLD_SPELLINGS[spelling]
    for key, t in _tensors(tmp_path / "new").items():
        prefix = next(p for p in old_spelling if key.startswith(p))
        renamed[old_spelling[prefix] + key[len(prefix) :]] = t
    assert any(".vision_tower.vision_model." in k for k in renamed)
    save_file(renamed, old / ADAPTER_WEIGHTS)
    (old / ADAPTER_CONFIG).write_text((tmp_path / "new" / ADAPTER_CONFIG).read_text())
    load_adapter(ours, old)
    # fp32 against transformers' fp32: other kernels and orders (eager vs sdpa
    # attention), products of width <= 96: ~96 x 2^-24 ~ 6e-6 relative each, over 4
    # layers and a softmax; 1e-4 for logits of order 1
    torch.testing.assert_close(logits(ours), logits(theirs), atol=1e-4, rtol=1e-4)


def test_a_regex_in_our_spelling_is_saved_as_names_peft_matches(tmp_path):
    ours, theirs = transformers_pair(config(), seed=0)
    regex = r"language_model\.model\.layers\.0\.self_attn\.(q|v)_proj"  # ours only
    add_lora(ours, LoraConfig(r=4, target_modules=regex))
    randomise_lora_B(ours.named_parameters())
    save_adapter(ours, tmp_path)
    written = json.loads((tmp_path / ADAPTER_CONFIG).read_text())["target_modules"]
    assert written == [
        "model.language_model.layers.0.self_attn.q_proj",
        "model.language_model.layers.0.self_attn.v_proj",
    ]
    theirs = peft.PeftModel.from_pretrained(theirs, tmp_path)
    # fp32 against transformers' fp32: other kernels and orders (eager vs sdpa
    # attention), products of width <= 96: ~96 x 2^-24 ~ 6e-6 relative each, over 4
    # layers and a softmax; 1e-4 for logits of order 1
    torch.testing.assert_close(logits(theirs), logits(ours), atol=1e-4, rtol=1e-4)


def test_lora_state_dict_holds_only_adapters():
    model = PaliGemmaForConditionalGeneration(config())
    names = add_lora(model, LoraConfig(r=2, target_modules=["v_proj"]))
    state = lora_state_dict(model)
    assert sorted(state) == sorted(
        f"{n}.{part}.weight" for n in names for part in ("lora_A", "lora_B")
    )


# ---------------------------------------------------------------- errors


def error(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as caught:
        call(*args, **kwargs)
    return str(caught.value)


@pytest.mark.parametrize("r", [0, -1, 2.5, True])
def test_rank_below_one_is_refused(r):
    assert f"r={r!r}" in error(LoraConfig, r=r)


@pytest.mark.parametrize("alpha", [0, -16, True])
def test_alpha_not_above_zero_is_refused(alpha):
    assert f"alpha={alpha!r}" in error(LoraConfig, alpha=alpha)


def test_targets_that_match_nothing_are_refused():
    model = PaliGemmaForConditionalGeneration(config())
    message = error(add_lora, model, LoraConfig(target_modules=["q_proj", "qproj"]))
    assert "'qproj'" in message and "q_proj" in message  # and the names there are
    message = error(add_lora, model, LoraConfig(target_modules=r"q_proj"))
    assert "'q_proj' matches no module" in message
    assert "must match the whole name" in message and r"'.*\.q_proj'" in message
    assert not lora_modules(model)  # nothing was changed
    assert all(p.requires_grad for p in model.parameters())


def test_targets_that_are_not_linear_are_refused():
    model = PaliGemmaForConditionalGeneration(config())
    message = error(add_lora, model, LoraConfig(target_modules=["embed_tokens"]))
    assert "language_model.model.embed_tokens (Embedding), not an nn.Linear" in message
    message = error(add_lora, model, LoraConfig(target_modules=r".*layers\.0\.mlp"))
    assert "not an nn.Linear" in message
    message = error(add_lora, model, LoraConfig(target_modules=["lm_head"]))
    assert "tied to language_model.model.embed_tokens.weight" in message


def test_adding_twice_is_refused(tmp_path):
    model = PaliGemmaForConditionalGeneration(config())
    add_lora(model, LoraConfig(target_modules=["q_proj"]))
    assert "already has LoRA adapters" in error(add_lora, model, LoraConfig())
    save_adapter(model, tmp_path)
    assert "already has LoRA adapters" in error(load_adapter, model, tmp_path)


def test_merge_and_unmerge_need_adapters():
    model = PaliGemmaForConditionalGeneration(config())
    assert "no LoRA adapters to merge" in error(merge_lora, model)
    assert "no merged adapters" in error(unmerge_lora, model)


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapter")
    _, theirs = transformers_pair(config(), seed=0)
    theirs = peft.get_peft_model(
        theirs, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "fc2"])
    )
    theirs.save_pretrained(folder)
    return folder


def edited_adapter(source, target, config_changes=None, tensors=None):
    target.mkdir()
    config = json.loads((source / ADAPTER_CONFIG).read_text())
    (target / ADAPTER_CONFIG).write_text(
        json.dumps({**config, **(config_changes or {})})
    )
    save_file(
        tensors if tensors is not None else _tensors(source), target / ADAPTER_WEIGHTS
    )
    return target


@pytest.mark.parametrize(
    "change, named",
    [
        ({"use_dora": True}, "use_dora=True"),
        ({"use_rslora": True}, "use_rslora=True"),
        ({"bias": "all"}, "bias='all'"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern="),
        ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern="),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save="),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4'"),
        ({"init_lora_weights": "olora"}, "init_lora_weights='olora'"),
        ({"init_lora_weights": "corda"}, "init_lora_weights='corda'"),
        ({"init_lora_weights": "loftq"}, "init_lora_weights='loftq'"),
    ],
    ids=str,
)
def test_unsupported_adapter_settings_are_refused(
    change, named, peft_adapter, tmp_path
):
    folder = edited_adapter(peft_adapter, tmp_path / "edited", change)
    model = PaliGemmaForConditionalGeneration(config())
    message = error(load_adapter, model, folder)
    assert named in message and "adapter_config.json" in message
    assert not lora_modules(model)


def test_unknown_key_and_wrong_shape_are_refused(peft_adapter, tmp_path):
    tensors = _tensors(peft_adapter)
    model = PaliGemmaForConditionalGeneration(config())
    key = (
        "base_model.model.model.language_model.layers.5.self_attn.q_proj.lora_A.weight"
    )
    folder = edited_adapter(
        peft_adapter, tmp_path / "deeper", tensors={**tensors, key: torch.zeros(4, 48)}
    )
    assert key in error(load_adapter, model, folder)
    key = (
        "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_M.weight"
    )
    folder = edited_adapter(
        peft_adapter, tmp_path / "unknown", tensors={**tensors, key: torch.zeros(4, 48)}
    )
    assert key in error(load_adapter, model, folder)
    key = (
        "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight"
    )
    folder = edited_adapter(
        peft_adapter, tmp_path / "shape", tensors={**tensors, key: torch.zeros(4, 47)}
    )
    message = error(load_adapter, model, folder)
    assert key in message and "[4, 47]" in message and "[4, 48]" in message
    folder = edited_adapter(peft_adapter, tmp_path / "rank", {"r": 8})
    assert "r=8" in error(load_adapter, model, folder)
    key_B = key.replace("lora_A", "lora_B")
    folder = edited_adapter(
        peft_adapter,
        tmp_path / "half",
        tensors={k: t for k, t in tensors.items() if k != key_B},
    )
    assert (
        "no lora_B weight for language_model.model.layers.0.self_attn.q_proj"
        in error(load_adapter, model, folder)
    )
    assert not lora_modules(model)  # nothing was changed by the refused files


@pytest.mark.parametrize(
    "key",
    [
        "base_model.model.lm_head.base_layer.weight",
        "base_model.model.model.language_model.layers.0.mlp.down_proj"
        ".modules_to_save.default.weight",
    ],
)
def test_tensors_that_are_not_lora_are_refused(key, peft_adapter, tmp_path):
    tensors = {**_tensors(peft_adapter), key: torch.zeros(2, 2)}
    folder = edited_adapter(peft_adapter, tmp_path / "extra", tensors=tensors)
    model = PaliGemmaForConditionalGeneration(config())
    message = error(load_adapter, model, folder)
    assert key in message and "not a LoRA A or B weight" in message
    assert "use it with PEFT" in message and not lora_modules(model)


def test_an_adapter_on_the_tied_lm_head_is_refused(tmp_path):
    ours, theirs = transformers_pair(config(), seed=0)
    theirs = peft.get_peft_model(
        theirs, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"])
    )
    theirs.save_pretrained(tmp_path, save_embedding_layers=False)
    message = error(load_adapter, ours, tmp_path)
    assert "adapts language_model.lm_head" in message
    assert "tied to language_model.model.embed_tokens.weight" in message
    assert not lora_modules(ours)


# --- trained token rows: PEFT's trainable_token_indices (issue 40) ---

ROWS = [3, 5, 7, 200]


def rows_inputs(seed=0):
    "inputs() with the trained ids in the text, where the embedding reads them"
    batch = inputs(seed)
    batch["input_ids"][:, 5:9] = torch.tensor(ROWS)
    return batch


def rows_logits(model, seed=0):
    with torch.no_grad():
        return model.eval()(**rows_inputs(seed)).logits


def randomise_rows(model, seed=2, std=0.3):
    "Rows as if trained: their starting values plus noise"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "trainable_tokens_delta" in name:
                p.add_(torch.randn(p.shape, generator=g) * std)


def with_rows(model, targets=("q_proj",)):
    add_lora(
        model,
        LoraConfig(
            r=4, alpha=8, target_modules=list(targets), trainable_token_indices=ROWS
        ),
    )
    randomise_lora_B(model.named_parameters())
    randomise_rows(model)
    return model


ROWS_NAME = "language_model.model.embed_tokens.token_adapter.trainable_tokens_delta"


@pytest.mark.parametrize("attention", ATTENTION, ids=str)
def test_our_token_rows_load_into_peft(attention, tmp_path):
    ours, theirs = transformers_pair(ATTENTION[attention], seed=0)
    with_rows(ours)
    save_adapter(ours, tmp_path)
    saved = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert saved["trainable_token_indices"] == ROWS
    assert PEFT_PREFIX + peft_name(ROWS_NAME) in _tensors(tmp_path)
    theirs = peft.PeftModel.from_pretrained(theirs, tmp_path)
    assert count_parameters(ours)[1] == theirs.get_nb_trainable_parameters()[1]
    # the round trips' tolerance, for the same reason: fp32 against transformers'
    # fp32, other kernels and orders, products of width <= 96 (~6e-6 relative
    # each) over 4 layers and a softmax; 1e-4 for logits of order 1
    torch.testing.assert_close(
        rows_logits(theirs), rows_logits(ours), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("attention", ATTENTION, ids=str)
def test_peft_token_rows_load_into_ours(attention, tmp_path):
    ours, theirs = transformers_pair(ATTENTION[attention], seed=0)
    before = rows_logits(ours)
    theirs = peft.get_peft_model(
        theirs,
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=ROWS
        ),
    )
    randomise_lora_B(theirs.named_parameters())
    randomise_rows(theirs)
    theirs.save_pretrained(tmp_path)
    load_adapter(ours, tmp_path)
    # PEFT's counts: the rows once (k x hidden), though embedding and head use them
    assert count_parameters(ours) == theirs.get_nb_trainable_parameters()
    lora = sum(t.numel() for n, t in lora_state_dict(ours).items() if "lora_" in n)
    hidden = ours.config.text.hidden_size
    assert count_parameters(ours)[0] == lora + len(ROWS) * hidden
    expected = rows_logits(theirs)
    assert not torch.allclose(expected, before, atol=1e-2)  # the adapter matters
    # the same tolerance as above, for the same reason
    torch.testing.assert_close(rows_logits(ours), expected, atol=1e-4, rtol=1e-4)
    save_adapter(ours, tmp_path / "again")  # the same tensors under the same names
    assert _tensors(tmp_path / "again").keys() == _tensors(tmp_path).keys()
    for key, t in _tensors(tmp_path).items():
        assert torch.equal(_tensors(tmp_path / "again")[key], t), key


def test_token_rows_change_only_the_listed_ids():
    base = PaliGemmaForConditionalGeneration(config()).eval()
    model = with_rows(copy.deepcopy(base))
    text, plain = model.language_model, base.language_model
    rows = text.model.embed_tokens.token_adapter.trainable_tokens_delta
    # one Parameter [k, hidden], in the embedding and in the tied head
    assert text.lm_head.token_adapter.trainable_tokens_delta is rows
    assert list(rows.shape) == [len(ROWS), config().text.hidden_size]
    # the table itself is the base's, untouched; code reading .weight still works
    assert text.model.embed_tokens.weight is text.lm_head.weight
    assert torch.equal(text.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    vocab = torch.arange(config().text.vocab_size)[None]  # every id once, [1, V]
    listed = torch.isin(vocab[0], torch.tensor(ROWS))
    with torch.no_grad():
        embedded, embedded_base = text.model.embed(vocab), plain.model.embed(vocab)
        assert torch.equal(embedded[0, ~listed], embedded_base[0, ~listed])
        scale = torch.tensor(config().text.hidden_size ** 0.5)
        assert torch.equal(embedded[0, listed], rows * scale)  # ROWS are sorted
        hidden = torch.randn(3, config().text.hidden_size)
        logits, logits_base = text.lm_head(hidden), plain.lm_head(hidden)
        assert torch.equal(logits[:, ~listed], logits_base[:, ~listed])
        # k dot products of width 48 against F.linear's: other orders, ~48 x
        # 2^-24 relative each
        torch.testing.assert_close(
            logits[:, listed], hidden @ rows.T, atol=1e-5, rtol=1e-5
        )
        assert not torch.allclose(logits[:, listed], logits_base[:, listed])


def test_a_training_step_moves_only_the_rows_and_the_adapter_without_decay():
    from paligemma_lib.optimization import make_optimizer, param_groups

    model = with_rows(PaliGemmaForConditionalGeneration(config()))
    rows = model.language_model.model.embed_tokens.token_adapter.trainable_tokens_delta
    decayed, kept = (g["params"] for g in param_groups(model, 0.1))
    assert any(p is rows for p in kept) and not any(p is rows for p in decayed)
    frozen = {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if not p.requires_grad
    }
    trained = {
        n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad
    }
    optimizer = make_optimizer(model, lr=1e-2, weight_decay=0.1)
    batch = rows_inputs()
    labels = batch["input_ids"].masked_fill(batch["token_type_ids"] == 0, -100)
    model.train()(**batch, labels=labels).loss.backward()
    optimizer.step()
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    assert not torch.equal(rows, trained[ROWS_NAME])
    # what trains is what the adapter file holds: A, B and the rows
    assert set(trained) == set(lora_state_dict(model))


def test_merge_writes_the_rows_and_unmerge_puts_the_originals_back():
    base = PaliGemmaForConditionalGeneration(config()).eval()
    model = with_rows(copy.deepcopy(base))
    adapted = rows_logits(model)
    rows = model.language_model.model.embed_tokens.token_adapter.trainable_tokens_delta
    merge_lora(model)
    text = model.language_model
    assert type(text.model.embed_tokens) is torch.nn.Embedding
    assert text.lm_head.weight is text.model.embed_tokens.weight
    assert torch.equal(text.model.embed_tokens.weight[ROWS], rows)
    assert not any("token_adapter" in n for n, _ in model.named_parameters())
    # fp32 merge: LoRA's W + BA rounds once (chapter 10), the rows are exact;
    # products of width <= 96 in another order
    torch.testing.assert_close(rows_logits(model), adapted, atol=1e-5, rtol=1e-5)
    unmerge_lora(model)
    assert torch.equal(
        text.model.embed_tokens.base_layer.weight,
        base.language_model.model.embed_tokens.weight,
    )
    # the rows come back exactly; LoRA's weights within two fp32 roundings
    torch.testing.assert_close(rows_logits(model), adapted, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_generation_uses_the_trained_rows(cache):
    from paligemma_lib.generation import generate

    base = PaliGemmaForConditionalGeneration(config()).eval()
    model = with_rows(copy.deepcopy(base))
    batch = inputs()
    first = generate(base, **batch, max_new_tokens=1)[:, 0]
    table = model.language_model.model.embed_tokens.weight
    with torch.no_grad():  # row 5 := 10 x the row of each prompt's first answer
        model.language_model.model.embed_tokens.token_adapter.trainable_tokens_delta[
            1
        ] = 10 * table[first[0]]
    tokens = generate(model, **batch, max_new_tokens=4, cache=cache)
    merged = copy.deepcopy(model)
    merge_lora(merged)
    assert torch.equal(
        tokens, generate(merged, **batch, max_new_tokens=4, cache="none")
    )
    assert tokens[0, 0] == 5  # the trained row won


@pytest.mark.parametrize(
    "ids, words",
    [
        ([3, 3], "id 3 is listed twice"),
        ([-1], ">= 0"),
        ([], "non-empty"),
        ({"embed_tokens": [3]}, "give a list of token ids"),
    ],
)
def test_bad_token_ids_are_refused(ids, words):
    assert words in error(LoraConfig, trainable_token_indices=ids)


def test_token_ids_outside_the_vocabulary_and_models_without_a_table_are_refused():
    model = PaliGemmaForConditionalGeneration(config())
    vocab = config().text.vocab_size
    message = error(add_lora, model, LoraConfig(trainable_token_indices=[3, vocab]))
    assert f"holds {vocab}" in message and f"0 to {vocab - 1}" in message
    assert not lora_modules(model)  # refused before anything changed
    linear = torch.nn.Sequential(torch.nn.Linear(4, 4))
    cfg = LoraConfig(target_modules=["0"], trainable_token_indices=[1])
    assert "are for PaliGemma" in error(add_lora, linear, cfg)


def test_token_rows_and_the_config_must_go_together(tmp_path):
    ours, _ = transformers_pair(config(), seed=0)
    save_adapter(with_rows(copy.deepcopy(ours)), tmp_path / "rows")
    folder = edited_adapter(
        tmp_path / "rows", tmp_path / "no-ids", {"trainable_token_indices": None}
    )
    message = error(load_adapter, copy.deepcopy(ours), folder)
    assert "trainable_token_indices=None" in message and "rows (" in message
    tensors = {k: t for k, t in _tensors(tmp_path / "rows").items() if "token" not in k}
    folder = edited_adapter(tmp_path / "rows", tmp_path / "no-rows", tensors=tensors)
    assert "holds no rows" in error(load_adapter, copy.deepcopy(ours), folder)
    folder = edited_adapter(
        tmp_path / "rows", tmp_path / "fewer", {"trainable_token_indices": [3, 5]}
    )
    message = error(load_adapter, model := copy.deepcopy(ours), folder)
    assert "[2, 48]" in message and "[4, 48]" in message and not lora_modules(model)


def test_token_rows_on_a_bf16_base_train_in_fp32():
    "The rows are the adapter's dtype (fp32), as A and B are; the table stays bf16"
    model = PaliGemmaForConditionalGeneration(config()).to(torch.bfloat16)
    with_rows(model)
    text = model.language_model
    rows = text.model.embed_tokens.token_adapter.trainable_tokens_delta
    assert rows.dtype == torch.float32 and text.lm_head.weight.dtype == torch.bfloat16
    batch = rows_inputs()
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    out = model(**batch)
    assert out.logits.dtype == torch.bfloat16  # the base's
    out.logits.float().logsumexp(-1).sum().backward()
    assert rows.grad is not None and rows.grad.dtype == torch.float32
    assert rows.grad.abs().sum() > 0
