"""Chapter 9: loading HF PaliGemma checkpoints in every key spelling, strict errors, and
saving for transformers."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.weights import (
    CheckpointError,
    find_real_checkpoint,
    load_pretrained,
    our_name,
    read_safetensors_header,
    save_pretrained,
)

IMAGE = 299


def tiny_config(text_layers=2):
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
            num_hidden_layers=text_layers,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
        ),
        image_token_index=IMAGE,
        projection_dim=48,
    )


@pytest.fixture(scope="module")
def theirs():
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration(
        transformers.PaliGemmaConfig(**tiny_config().to_hf())
    )
    return model.eval()


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
        token_type_ids=torch.zeros_like(ids),
    )


def logits_of(model):
    with torch.no_grad():
        return model(**inputs()).logits


HUB = {
    "model.vision_tower.": "vision_tower.vision_model.",
    "model.language_model.": "language_model.model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
}


def hub_key(key):
    prefix = next(p for p in HUB if key.startswith(p))
    return HUB[prefix] + key[len(prefix) :]


def write_state(state, folder, config_json, shards=1):
    "A checkpoint folder holding `state` in one file or `shards` files with an index"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config_json)
    state = {k: v.contiguous().clone() for k, v in state.items()}
    if shards == 1:
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: state[k] for k in part}, folder / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return folder


def write_checkpoint(theirs, folder, spelling, sharded):
    "The transformers model saved in one of the three key spellings, one file or shards"
    if spelling == "transformers5":
        theirs.save_pretrained(folder, max_shard_size="40kB" if sharded else "5GB")
        assert (folder / "model.safetensors.index.json").is_file() == sharded
        return folder
    config_json = json.dumps(theirs.config.to_dict())
    state = theirs.state_dict()
    if spelling == "hub":  # the Hub files: transformers 4.x names, no lm_head
        state = {hub_key(k): v for k, v in state.items() if k != "lm_head.weight"}
    return write_state(state, folder, config_json, shards=3 if sharded else 1)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("spelling", ["hub", "transformers5", "in_memory"])
def test_every_spelling_loads_to_transformers_logits(
    theirs, tmp_path, spelling, sharded
):
    folder = write_checkpoint(theirs, tmp_path / "ckpt", spelling, sharded)
    keys = {k for f in folder.glob("*.safetensors") for k in read_safetensors_header(f)}
    assert any(
        k.startswith(
            {
                "hub": "vision_tower.vision_model.",
                "transformers5": "vision_tower.encoder.",
                "in_memory": "model.vision_tower.",
            }[spelling]
        )
        for k in keys
    )
    ours = load_pretrained(folder)
    assert (
        ours.language_model.lm_head.weight
        is ours.language_model.model.embed_tokens.weight
    )
    assert not ours.training and not any(p.is_meta for p in ours.parameters())
    assert all(
        p.dtype == torch.float32 and p.device.type == "cpu" for p in ours.parameters()
    )
    # float32, the same tiny model in ours and transformers' kernels: reductions in
    # other orders, ~1e-6 relative on logits of size ~1
    torch.testing.assert_close(logits_of(ours), logits_of(theirs), rtol=1e-5, atol=1e-5)


def test_key_map():
    for key in [
        "vision_tower.vision_model.post_layernorm.bias",
        "vision_tower.post_layernorm.bias",
        "model.vision_tower.post_layernorm.bias",
        "model.vision_tower.vision_model.post_layernorm.bias",
    ]:
        assert our_name(key) == "vision_tower.vision_model.post_layernorm.bias"
    assert (
        our_name("model.language_model.norm.weight")
        == our_name("language_model.model.norm.weight")
        == "language_model.model.norm.weight"
    )
    assert (
        our_name("lm_head.weight")
        == our_name("language_model.lm_head.weight")
        == "language_model.lm_head.weight"
    )
    assert our_name("text_model.embeddings.token_embedding.weight") is None


def hub_layout(config: PaliGemmaConfig) -> dict:
    """Tensor names and shapes of a PaliGemma checkpoint on the Hub (transformers 4.x
    names), written out by hand"""
    v, t = config.vision, config.text
    shapes = {
        "vision_tower.vision_model.embeddings.patch_embedding.weight": (
            v.hidden_size,
            3,
            v.patch_size,
            v.patch_size,
        ),
        "vision_tower.vision_model.embeddings.patch_embedding.bias": (v.hidden_size,),
        "vision_tower.vision_model.embeddings.position_embedding.weight": (
            v.num_image_tokens,
            v.hidden_size,
        ),
        "vision_tower.vision_model.post_layernorm.weight": (v.hidden_size,),
        "vision_tower.vision_model.post_layernorm.bias": (v.hidden_size,),
        "multi_modal_projector.linear.weight": (config.projection_dim, v.hidden_size),
        "multi_modal_projector.linear.bias": (config.projection_dim,),
        "language_model.model.embed_tokens.weight": (t.vocab_size, t.hidden_size),
        "language_model.model.norm.weight": (t.hidden_size,),
    }
    for i in range(v.num_hidden_layers):
        p = f"vision_tower.vision_model.encoder.layers.{i}."
        for proj in ["q_proj", "k_proj", "v_proj", "out_proj"]:
            shapes[p + f"self_attn.{proj}.weight"] = (v.hidden_size, v.hidden_size)
            shapes[p + f"self_attn.{proj}.bias"] = (v.hidden_size,)
        for norm in ["layer_norm1", "layer_norm2"]:
            shapes[p + f"{norm}.weight"] = shapes[p + f"{norm}.bias"] = (v.hidden_size,)
        shapes[p + "mlp.fc1.weight"], shapes[p + "mlp.fc1.bias"] = (
            (v.intermediate_size, v.hidden_size),
            (v.intermediate_size,),
        )
        shapes[p + "mlp.fc2.weight"], shapes[p + "mlp.fc2.bias"] = (
            (v.hidden_size, v.intermediate_size),
            (v.hidden_size,),
        )
    for i in range(t.num_hidden_layers):
        p = f"language_model.model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (
            t.num_attention_heads * t.head_dim,
            t.hidden_size,
        )
        shapes[p + "self_attn.k_proj.weight"] = (
            t.num_key_value_heads * t.head_dim,
            t.hidden_size,
        )
        shapes[p + "self_attn.v_proj.weight"] = (
            t.num_key_value_heads * t.head_dim,
            t.hidden_size,
        )
        shapes[p + "self_attn.o_proj.weight"] = (
            t.hidden_size,
            t.num_attention_heads * t.head_dim,
        )
        shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (
            t.intermediate_size,
            t.hidden_size,
        )
        shapes[p + "mlp.down_proj.weight"] = (t.hidden_size, t.intermediate_size)
        shapes[p + "input_layernorm.weight"] = shapes[
            p + "post_attention_layernorm.weight"
        ] = (t.hidden_size,)
    return shapes


def test_real_3b_config_on_meta_has_the_hub_names_and_shapes():
    config = PaliGemmaConfig()  # google/paligemma-3b-pt-224
    with torch.device("meta"):
        ours = PaliGemmaForConditionalGeneration(config)
        theirs = transformers.PaliGemmaForConditionalGeneration(
            transformers.PaliGemmaConfig(**config.to_hf())
        )
    ours_shapes = {name: tuple(p.shape) for name, p in ours.named_parameters()}
    hub = hub_layout(config)
    assert len(hub) == 603 and ours_shapes == hub
    assert hub["language_model.model.layers.17.mlp.up_proj.weight"] == (16384, 2048)
    assert hub["vision_tower.vision_model.embeddings.position_embedding.weight"] == (
        256,
        1152,
    )
    translated = {our_name(k): tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert translated.pop("language_model.lm_head.weight") == (257216, 2048)
    assert translated == hub
    assert sum(p.numel() for p in ours.parameters()) == 2_923_466_480


def test_dtype_and_device(theirs, tmp_path):
    folder = write_checkpoint(theirs, tmp_path / "ckpt", "hub", False)
    bf16 = load_pretrained(folder, dtype="bf16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert (
        bf16.language_model.lm_head.weight
        is bf16.language_model.model.embed_tokens.weight
    )
    low = logits_of(bf16).float()
    # bf16 weights and activations (8 significant bits, eps 2^-7) against float32: each
    # layer rounds to bf16 a few times, a few eps relative on logits of size ~1: 0.05
    torch.testing.assert_close(low, logits_of(theirs), rtol=0.05, atol=0.05)
    save_pretrained(bf16, tmp_path / "bf16")
    assert (
        json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"]
        == "bfloat16"
    )
    assert {
        h["dtype"]
        for k, h in read_safetensors_header(
            tmp_path / "bf16" / "model.safetensors"
        ).items()
        if k != "__metadata__"
    } == {"BF16"}
    again = load_pretrained(tmp_path / "bf16")  # default: the stored dtype
    assert {p.dtype for p in again.parameters()} == {torch.bfloat16}
    assert {
        p.dtype
        for p in load_pretrained(tmp_path / "bf16", dtype=torch.float32).parameters()
    } == {torch.float32}
    assert load_pretrained(
        folder, device="auto"
    ).language_model.lm_head.weight.device.type == (
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    with pytest.raises(ValueError, match="dtype 'int8'"):
        load_pretrained(folder, dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            load_pretrained(folder, device="cuda")


def test_save_pretrained_is_what_transformers_loads(theirs, tmp_path):
    ours = load_pretrained(
        write_checkpoint(theirs, tmp_path / "src", "in_memory", False)
    )
    save_pretrained(ours, tmp_path / "saved")
    keys = set(read_safetensors_header(tmp_path / "saved" / "model.safetensors")) - {
        "__metadata__"
    }
    assert keys == set(hub_layout(tiny_config()))  # the Hub layout, LM head once (tied)
    reloaded, info = transformers.PaliGemmaForConditionalGeneration.from_pretrained(
        tmp_path / "saved", dtype=torch.float32, output_loading_info=True
    )
    assert (
        not info["missing_keys"]
        and not info["unexpected_keys"]
        and not info["mismatched_keys"]
    )
    reloaded_logits = logits_of(reloaded.eval())
    # float32, transformers' kernels against ours: reduction order, ~1e-6 relative
    torch.testing.assert_close(reloaded_logits, logits_of(ours), rtol=1e-5, atol=1e-5)
    ours_again = logits_of(load_pretrained(tmp_path / "saved"))
    # bit for bit: the same weights in the same model on the same kernels
    torch.testing.assert_close(ours_again, logits_of(ours), rtol=0, atol=0)


def test_saving_over_the_file_a_model_was_loaded_from(theirs, tmp_path):
    folder = write_checkpoint(theirs, tmp_path / "ckpt", "hub", False)
    ours = load_pretrained(
        folder
    )  # its parameters are views of the mapped model.safetensors
    before = logits_of(ours)
    with torch.no_grad():
        ours.multi_modal_projector.linear.bias.add_(1.0)
    save_pretrained(ours, folder)
    loaded = logits_of(load_pretrained(folder))
    # bit for bit: the same weights in the same model on the same kernels
    torch.testing.assert_close(loaded, logits_of(ours), rtol=0, atol=0)
    assert not torch.equal(logits_of(ours), before)


def break_checkpoint(theirs, folder, how):
    "A checkpoint folder broken in one way; returns it"
    good = write_checkpoint(theirs, folder, "hub", how == "missing_shard")
    state = {k: v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    state = {hub_key(k): v for k, v in state.items()}
    config_json = (good / "config.json").read_text()
    if how == "missing_shard":
        (good / "model-00002-of-00003.safetensors").unlink()
    elif how == "missing_layer":
        shutil.rmtree(good)
        write_state(
            {k: v for k, v in state.items() if ".layers.1." not in k or "vision" in k},
            folder,
            config_json,
        )
    elif how == "extra_layer":
        config = json.loads(config_json)
        config["text_config"]["num_hidden_layers"] = 1
        (good / "config.json").write_text(json.dumps(config))
    elif how == "unknown_tensor":
        shutil.rmtree(good)
        write_state(
            {**state, "text_model.head.weight": torch.zeros(2)}, folder, config_json
        )
    elif how == "wrong_shape":
        shutil.rmtree(good)
        state["multi_modal_projector.linear.bias"] = torch.zeros(47)
        write_state(state, folder, config_json)
    elif how == "two_spellings":
        shutil.rmtree(good)
        write_state(
            {
                **state,
                "model.language_model.norm.weight": state[
                    "language_model.model.norm.weight"
                ],
            },
            folder,
            config_json,
        )
    elif how == "untied_head":
        shutil.rmtree(good)
        write_state(
            {**state, "lm_head.weight": torch.randn(300, 48)}, folder, config_json
        )
    elif how == "pickle":
        (good / "model.safetensors").unlink()
        torch.save(state, good / "pytorch_model.bin")
    elif how == "no_weights":
        (good / "model.safetensors").unlink()
    elif how == "no_config":
        (good / "config.json").unlink()
    elif (
        how == "truncated"
    ):  # a download cut short: the header is intact, the data is not all there
        file = good / "model.safetensors"
        file.write_bytes(file.read_bytes()[:-100])
    elif how == "trailing_bytes":
        file = good / "model.safetensors"
        file.write_bytes(file.read_bytes() + b"\0" * 10)
    elif how == "damaged_file":
        (good / "model.safetensors").write_bytes(
            b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"
        )
    elif how == "bad_config":
        config = json.loads(config_json)
        config["text_config"]["num_key_value_heads"] = 3
        (good / "config.json").write_text(json.dumps(config))
    return folder


BROKEN = {
    "missing_shard": r"lists 3 shard files but 1 of them are not in "
    r".*is the download complete",
    "missing_layer": r"no tensor for language_model\.model\.layers\.1\.\S+ "
    r"\(2 layers expected by config\.json, "
    r"the files hold 1\); is the download complete\?",
    "extra_layer": r"tensor language_model\.model\.layers\.1\.\S+ "
    r"\(in model\.safetensors\) has no place",
    "unknown_tensor": r"not part of PaliGemma, e\.g\. text_model\.head\.weight",
    "wrong_shape": r"multi_modal_projector\.linear\.bias in model\.safetensors "
    r"has shape \[47\], but config\.json "
    r"implies \[48\]",
    "two_spellings": r"model\.language_model\.norm\.weight .* "
    r"two spellings of language_model\.model\.norm\.weight",
    "untied_head": r"lm_head\.weight differs from its embedding table",
    "pickle": r"pytorch_model\.bin, a pickle checkpoint; "
    r"only safetensors .*\.save_pretrained",
    "no_weights": r"no model\.safetensors or model\.safetensors\.index\.json",
    "no_config": r"not a PaliGemma checkpoint: it has no config\.json",
    "damaged_file": r"model\.safetensors is not a readable safetensors file",
    "truncated": r"model\.safetensors is truncated: its header promises (\d+) bytes, "
    r"the file has \d+; "
    r"is the download complete\?",
    "trailing_bytes": r"model\.safetensors has 10 bytes after the data "
    r"its header describes",
    "bad_config": r"config\.json does not describe .*num_key_value_heads 3",
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_bad_checkpoints_fail_with_a_message_naming_the_problem(theirs, tmp_path, how):
    folder = break_checkpoint(theirs, tmp_path / "ckpt", how)
    with pytest.raises(CheckpointError, match=BROKEN[how]):
        load_pretrained(folder)


def test_truncated_file_names_both_sizes(theirs, tmp_path):
    folder = write_checkpoint(theirs, tmp_path / "ckpt", "hub", False)
    size = (folder / "model.safetensors").stat().st_size
    break_checkpoint(theirs, folder, "truncated")
    with pytest.raises(
        CheckpointError, match=f"promises {size} bytes, the file has {size - 100};"
    ):
        read_safetensors_header(folder / "model.safetensors")


def test_a_stored_lm_head_is_compared_as_stored_and_never_converted(theirs, tmp_path):
    "A head differing from the embedding below bfloat16's precision is another head"
    folder = write_checkpoint(
        theirs, tmp_path / "ckpt", "in_memory", False
    )  # holds lm_head.weight, equal to the table
    model = load_pretrained(folder, dtype="bf16")
    assert (
        model.language_model.lm_head.weight
        is model.language_model.model.embed_tokens.weight
    )
    state = theirs.state_dict()
    embedding = state["model.language_model.embed_tokens.weight"]
    head = (
        embedding.bfloat16().float()
    )  # the table rounded to bfloat16: equal to it once both are converted
    assert torch.equal(head.bfloat16(), embedding.bfloat16()) and not torch.equal(
        head, embedding
    )
    write_state(
        {**state, "lm_head.weight": head},
        tmp_path / "nearly",
        json.dumps(theirs.config.to_dict()),
    )
    with pytest.raises(
        CheckpointError, match="lm_head.weight differs from its embedding table"
    ):
        load_pretrained(tmp_path / "nearly", dtype="bf16")


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    "Address ranges at which this process maps `path`, from /proc/self/maps (Linux)"
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path.resolve())):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(
    not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps"
)
def test_loading_in_the_stored_dtype_makes_no_second_copy(theirs, tmp_path):
    """A float32 parameter loaded as stored lies inside the mapping of
    model.safetensors; a converted one does not"""
    folder = write_checkpoint(theirs, tmp_path / "ckpt", "hub", False)
    file = folder / "model.safetensors"
    model = load_pretrained(folder)
    ranges = mapped_ranges(file)
    assert ranges, "the file is not mapped"
    for p in [
        model.language_model.model.embed_tokens.weight,
        model.multi_modal_projector.linear.weight,
        model.vision_tower.vision_model.post_layernorm.bias,
    ]:
        assert p.dtype == torch.float32 and any(
            start <= p.data_ptr() < end for start, end in ranges
        )
    converted = load_pretrained(folder, dtype="bf16")
    address = converted.language_model.model.embed_tokens.weight.data_ptr()
    assert not any(start <= address < end for start, end in mapped_ranges(file))


def test_not_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        load_pretrained(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        load_pretrained(tmp_path / "file")


def test_find_real_checkpoint(theirs, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PALIGEMMA_WEIGHTS", raising=False)
    assert find_real_checkpoint() is None
    snapshot = write_checkpoint(
        theirs,
        tmp_path
        / "cache"
        / "models--google--paligemma-3b-mix-224"
        / "snapshots"
        / "abc",
        "hub",
        False,
    )
    (snapshot / "tokenizer.model").write_bytes(b"")
    assert find_real_checkpoint() == snapshot
    monkeypatch.setenv("PALIGEMMA_WEIGHTS", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError):
        find_real_checkpoint()


def make_hub_cache(cache, repo="models--google--paligemma-3b-pt-224"):
    """A fake Hugging Face cache holding a tiny random PaliGemma saved by transformers,
    with chapter 6's tokenizer, laid out as snapshot_download leaves it"""
    from paligemma_lib.processing import PaliGemmaProcessor
    from paligemma_lib.tokenization import GemmaTokenizer, default_tokenizer_path

    tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
    config = tiny_config()
    config.text.vocab_size = len(tokenizer)
    config.image_token_index = tokenizer.image_token_id
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration(
        transformers.PaliGemmaConfig(**config.to_hf())
    ).eval()
    commits = {"main": "1" * 40, "bfloat16": "2" * 40}
    for branch, commit in commits.items():
        snapshot = cache / repo / "snapshots" / commit
        model.save_pretrained(snapshot)
        PaliGemmaProcessor(
            tokenizer,
            image_size=config.vision.image_size,
            num_image_tokens=config.num_image_tokens,
        ).save_pretrained(snapshot)
        (cache / repo / "refs").mkdir(parents=True, exist_ok=True)
        (cache / repo / "refs" / branch).write_text(commit)
    return {branch: cache / repo / "snapshots" / c for branch, c in commits.items()}


def test_finder_passes_over_snapshots_without_weights(tmp_path, monkeypatch):
    """A snapshot counts only with its weights: a bfloat16 download stopped after
    config.json and tokenizer.model, or an index with a shard missing, is passed
    over for a complete one (the files' contents are not read by the finder)"""
    from paligemma_lib.model_files import cached_snapshots

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("PALIGEMMA_WEIGHTS", raising=False)
    repo = cache / "models--google--paligemma-3b-pt-224"
    (repo / "refs").mkdir(parents=True)
    snapshots = {}
    for branch, commit in {"main": "1" * 40, "bfloat16": "2" * 40}.items():
        snapshots[branch] = repo / "snapshots" / commit
        snapshots[branch].mkdir(parents=True)
        (snapshots[branch] / "config.json").write_text("{}")
        (snapshots[branch] / "tokenizer.model").write_bytes(b"")
        (repo / "refs" / branch).write_text(commit)
    assert find_real_checkpoint() is None  # no weights anywhere
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (snapshots["main"] / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}})
    )
    (snapshots["main"] / shards[0]).write_bytes(b"")
    assert find_real_checkpoint() is None  # one shard of two
    (snapshots["main"] / shards[1]).write_bytes(b"")
    # the bfloat16 snapshot, preferred, has no weights: main's is taken
    assert cached_snapshots(cache) == [snapshots["main"]]
    assert find_real_checkpoint() == snapshots["main"]
    (snapshots["bfloat16"] / "model.safetensors").write_bytes(b"")
    assert find_real_checkpoint() == snapshots["bfloat16"]


def chapter_cell(cell_id, notebook="book/09_loading_real_weights.ipynb"):
    "The source of one code cell of a chapter, to run the chapter's own code here"
    root = Path(__file__).resolve().parents[1]
    cells = json.loads((root / notebook).read_text())["cells"]
    return "".join(next(c["source"] for c in cells if c.get("id") == cell_id))


def test_finder_and_comparison_on_a_fake_hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("PALIGEMMA_WEIGHTS", raising=False)
    assert find_real_checkpoint() is None
    snapshots = make_hub_cache(cache)
    assert find_real_checkpoint() == snapshots["bfloat16"]  # refs/bfloat16 first
    (snapshots["bfloat16"] / "tokenizer.model").unlink()  # an incomplete download
    assert find_real_checkpoint() == snapshots["main"]
    monkeypatch.setenv("PALIGEMMA_WEIGHTS", str(snapshots["main"]))
    assert find_real_checkpoint() == snapshots["main"]

    namespace = {}
    exec(chapter_cell("c046c"), namespace)  # the chapter's comparison, as it is
    compare = namespace["compare_with_transformers"]
    ours, theirs, our_tokens, their_tokens, near_tie = compare(
        find_real_checkpoint(), max_new_tokens=4
    )
    # float32 at full size: as the chapter's TOLERANCE (cell c046c) says
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(our_tokens, their_tokens) and our_tokens.shape[0] == 2
    assert near_tie.shape == our_tokens.shape and near_tie.dtype == torch.bool


def test_near_ties_marks_the_steps_whose_two_best_logits_may_swap():
    """The chapter's near_ties (cell c046c): step t's logits are those at position
    S - 1 + t; a tie is a top-2 gap within 2 tolerance (1 + |best|)"""
    from types import SimpleNamespace

    namespace = {}
    exec(chapter_cell("c046c"), namespace)
    S, T = 3, 3
    logits = torch.zeros(1, S + T, 4)
    logits[0, S - 1 :, 0] = 10.0  # the best logit of each step
    # gaps 1.0, 0.1, 0.3 to the second best; the bound is 2 x 0.01 x 11 = 0.22
    logits[0, S - 1 : S - 1 + T, 1] = torch.tensor([9.0, 9.9, 9.7])

    def model(**kwargs):
        assert kwargs["input_ids"].shape == (1, S + T)
        return SimpleNamespace(logits=logits)

    inputs = {
        name: torch.zeros(1, S, dtype=torch.long)
        for name in ("input_ids", "attention_mask", "token_type_ids")
    }
    inputs["pixel_values"] = None
    tokens = torch.zeros(1, T, dtype=torch.long)
    # a made-up tolerance: the bound above, 2 x 0.01 x (1 + 10) = 0.22
    near_tie = namespace["near_ties"](model, inputs, tokens, tolerance=0.01)
    assert near_tie.tolist() == [[False, True, False]]


@pytest.mark.parametrize(
    "capability, stored, asked, expected",
    [
        ((7, 5), "BF16", None, torch.float32),  # T4: no native bf16
        ((7, 0), "BF16", None, torch.float32),  # V100
        ((8, 0), "BF16", None, torch.bfloat16),  # A100 and later
        ((7, 5), "BF16", "bf16", torch.bfloat16),  # asked for: as asked
        ((7, 5), "BF16", "fp16", torch.float16),
        ((7, 5), "F32", None, torch.float32),
        ((7, 5), "F16", None, torch.float16),
    ],
)
def test_default_dtype_on_a_gpu_without_native_bf16(
    monkeypatch, capability, stored, asked, expected
):
    from paligemma_lib.weights import has_native_bf16, resolve_dtype

    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device=None: capability
    )
    cuda = torch.device("cuda")
    assert has_native_bf16(cuda) == (capability >= (8, 0))
    assert resolve_dtype(asked, stored, cuda) == expected
    assert resolve_dtype(None, "BF16", torch.device("cpu")) == torch.bfloat16


def test_saved_files_share_one_mode(tmp_path):
    """Every file of a saved model and of a saved adapter has the mode open() gives a
    new file; safetensors' save_file alone left the weights at 0600 (seen: the two
    .safetensors files 0600 beside 0644 files, before write_safetensors)."""
    import os
    import stat

    from paligemma_lib.adapters import save_adapter
    from paligemma_lib.lora import LoraConfig, add_lora

    # a fixed umask: the expected mode does not depend on the host's
    umask = os.umask(0o022)
    try:
        expected = 0o666 & ~0o022
        torch.manual_seed(0)
        model = PaliGemmaForConditionalGeneration(tiny_config())
        save_pretrained(model, tmp_path / "model")
        add_lora(model, LoraConfig(r=2))
        save_adapter(model, tmp_path / "adapter")
        (tmp_path / "plain").write_text("")  # what open() gives
        modes = {
            p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
            for p in tmp_path.rglob("*")
            if p.is_file()
        }
    finally:
        os.umask(umask)
    assert (
        "model/model.safetensors" in modes
        and "adapter/adapter_model.safetensors" in modes
    )
    assert modes == dict.fromkeys(modes, expected), modes


def test_finder_takes_paligemma2_snapshots_and_the_comparison_runs_on_one(
    tmp_path, monkeypatch
):
    """find_real_checkpoint also finds google/paligemma2-* downloads (3B first), after
    PaliGemma 1's 3B; the chapter's comparison cell runs on a PaliGemma 2 snapshot"""
    from test_gemma2 import CONFIGS, with_tokenizer

    from paligemma_lib.processing import PaliGemmaProcessor
    from paligemma_lib.tokenization import GemmaTokenizer, default_tokenizer_path

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("PALIGEMMA_WEIGHTS", raising=False)
    tokenizer = GemmaTokenizer.from_file(default_tokenizer_path())
    config = with_tokenizer(CONFIGS["gqa"], tokenizer)  # Gemma 2, window 5
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration(
        transformers.PaliGemmaConfig(**config.to_hf())
    ).eval()
    snapshots = {}
    for name in ("paligemma2-10b-pt-224", "paligemma2-3b-mix-448"):
        repo = cache / f"models--google--{name}"
        snapshots[name] = repo / "snapshots" / ("3" * 40)
        model.save_pretrained(snapshots[name])
        PaliGemmaProcessor(
            tokenizer, image_size=28, num_image_tokens=config.num_image_tokens
        ).save_pretrained(snapshots[name])
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("3" * 40)
    assert find_real_checkpoint() == snapshots["paligemma2-3b-mix-448"]  # 3B first
    (snapshots["paligemma2-3b-mix-448"] / "tokenizer.model").unlink()  # incomplete
    assert find_real_checkpoint() == snapshots["paligemma2-10b-pt-224"]
    paligemma_1 = make_hub_cache(cache)
    assert find_real_checkpoint() == paligemma_1["bfloat16"]  # PaliGemma 1's 3B first

    folder = snapshots["paligemma2-10b-pt-224"]
    hf = json.loads((folder / "config.json").read_text())
    assert hf["text_config"]["model_type"] == "gemma2"
    namespace = {}
    exec(chapter_cell("c046c"), namespace)  # the chapter's comparison, as it is
    compare = namespace["compare_with_transformers"]
    ours, theirs, our_tokens, their_tokens, near_tie = compare(folder, max_new_tokens=4)
    # float32 at full size: as the chapter's TOLERANCE (cell c046c) says
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert torch.equal(our_tokens, their_tokens) and our_tokens.shape[0] == 2
