"""Chapter 11b: the training loop (paligemma_lib/train.py), its metrics, and the
`train` and `evaluate` commands. A toy task (name the colour of a solid image) and a
tiny model keep every run to a few seconds."""

import copy
import gc
import json
import math
import os
import pickle
import random
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from paligemma_lib.batching import epoch_order, global_batch, shard
from paligemma_lib.evaluation import (
    box_iou,
    character_error_rate,
    compute_metrics,
    detection_metrics,
    levenshtein,
    match_boxes,
    parse_receipt,
    receipt_metrics,
)
from paligemma_lib.optimization import (
    make_optimizer,
    make_scheduler,
    param_groups,
    warmup_cosine,
)
from paligemma_lib.processing import PaliGemmaProcessor
from paligemma_lib.resume import CHECKPOINTS, latest_checkpoint
from paligemma_lib.tokenization import GemmaTokenizer, default_tokenizer_path
from paligemma_lib.train import (
    TrainConfig,
    autocast_dtype,
    grad_scaler,
    set_gradient_checkpointing,
    token_loss_sum,
    train,
    training_step,
)

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = GemmaTokenizer.from_file(default_tokenizer_path())
PROCESSOR = PaliGemmaProcessor(TOKENIZER, image_size=28, num_image_tokens=4)
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "yellow": (230, 190, 30)}

# The toy task and model, also written into the DDP script below.
TOY = """
import numpy as np
import torch
from PIL import Image

from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration


class ColourDataset:
    "Solid-colour images with noise; prompt 'colour?', answer the colour's name"

    def __init__(self, size, offset=0):
        self.size, self.offset = size, offset

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        rng = np.random.default_rng(self.offset + i)
        name = list(COLOURS)[rng.integers(len(COLOURS))]
        noise = rng.integers(-20, 21, (28, 28, 3))
        pixels = (np.array(COLOURS[name]) + noise).clip(0, 255).astype(np.uint8)
        return Image.fromarray(pixels), "colour?", name


def collate(examples):
    images, prompts, answers = zip(*examples)
    return PROCESSOR(list(images), list(prompts), suffixes=list(answers))


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
    )
    return PaliGemmaForConditionalGeneration(config)
"""
_toy = dict(globals())
exec(TOY, _toy)
ColourDataset, collate, toy_model = (
    _toy[name] for name in ("ColourDataset", "collate", "toy_model")
)
DATA = ColourDataset(64)


def grads_after_step(accumulation, examples, max_grad_norm=float("inf")):
    model = toy_model()
    optimizer = make_optimizer(model, lr=1e-2)
    scheduler = make_scheduler(optimizer, 1, 10)
    grads = {}
    optimizer.register_step_pre_hook(
        lambda *_: grads.update(
            {n: p.grad.clone() for n, p in model.named_parameters()}
        )
    )
    size = len(examples) // accumulation
    parts = [collate(examples[i * size : (i + 1) * size]) for i in range(accumulation)]
    loss, norm = training_step(model, parts, optimizer, scheduler, max_grad_norm)
    return model, grads, loss, norm


# --- the pieces ---


def test_schedule_warms_up_then_follows_a_cosine():
    curve = [warmup_cosine(s, 10, 101, min_ratio=0.1) for s in range(101)]
    assert curve[:3] == [0.1, 0.2, 0.3] and curve[9] == curve[10] == 1.0
    assert math.isclose(curve[55], 0.55)  # half way down: (1 + 0.1) / 2
    assert math.isclose(curve[100], 0.1)
    assert all(a >= b for a, b in zip(curve[10:], curve[11:]))
    assert warmup_cosine(500, 10, 101) == pytest.approx(0.1)  # stays at the floor
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler(optimizer, 10, 101)
    for step in range(5):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(curve[step])
        optimizer.step()
        scheduler.step()


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = toy_model()
    names = {id(p): n for n, p in model.named_parameters()}
    decay, keep = (
        {names[id(p)] for p in g["params"]} for g in param_groups(model, 0.1)
    )
    assert "language_model.model.embed_tokens.weight" in keep
    assert "language_model.model.layers.0.input_layernorm.weight" in keep
    assert "multi_modal_projector.linear.bias" in keep
    assert "language_model.model.layers.0.mlp.up_proj.weight" in decay
    assert len(decay) + len(keep) == len(names)
    model.vision_tower.requires_grad_(False)  # frozen parameters are left out
    assert not any(
        n.startswith("vision_tower")
        for g in param_groups(model, 0.1)
        for n in (names[id(p)] for p in g["params"])
    )


def test_data_order_depends_on_seed_and_step_only():
    assert sorted(epoch_order(10, 0, 0)) == list(range(10))
    batches = [global_batch(10, 4, s, seed=3) for s in range(5)]
    assert sorted(sum(batches[:2], []) + batches[2][:2]) == list(range(10))
    assert batches[4] == global_batch(10, 4, 4, seed=3)  # no state but the step
    parts = [shard(list(range(8)), r, 2, 2) for r in range(2)]
    assert parts == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]


def test_accumulation_equals_one_larger_batch():
    examples = [DATA[i] for i in range(8)]
    lengths = {len(TOKENIZER.encode(e[2], add_bos=False)) for e in examples}
    assert (
        len(lengths) > 1
    )  # answers of different lengths: a mean of means would differ
    big, big_grads, big_loss, _ = grads_after_step(1, examples)
    small, small_grads, small_loss, _ = grads_after_step(4, examples)
    # fp32 token losses summed in another grouping (<= 4 parts of <= 32 tokens): a few
    # roundings of 2^-24 each, ~1e-7 relative; 1e-6 leaves a factor of 10
    assert small_loss == pytest.approx(big_loss, rel=1e-6)
    for name, g in big_grads.items():
        # fp32 gradients summed in another grouping (<= 4 parts of <= 32 tokens) and
        # width-16 products: ~100 x 2^-24 ~ 6e-6 relative; atol for entries cancelling
        # to ~0
        torch.testing.assert_close(small_grads[name], g, rtol=1e-5, atol=1e-7)
    for p, q in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)  # Adam: lr 1e-2 x 1e-3


def test_loss_is_the_mean_over_answer_tokens():
    batch = collate([DATA[i] for i in range(4)])
    model = toy_model()
    out = model(**{k: batch[k] for k in batch.keys()})
    logits = out.logits
    n = int((batch.token_type_ids == 1).sum())
    torch.testing.assert_close(token_loss_sum(logits, batch.labels) / n, out.loss)


def test_clipping_rescales_the_global_norm():
    examples = [DATA[i] for i in range(8)]
    _, free, _, norm = grads_after_step(1, examples)
    _, clipped, _, same_norm = grads_after_step(1, examples, max_grad_norm=1e-3)
    assert same_norm == pytest.approx(norm) and norm > 1e-3
    flat = torch.cat([g.flatten() for g in clipped.values()])
    # clipping multiplies by 1e-3 / norm in fp32 (one rounding each) and the norm of
    # the result sums ~1e4 squares in fp32: well below 1e-5 relative; 1e-4 to spare
    assert flat.norm().item() == pytest.approx(1e-3, rel=1e-4)
    torch.testing.assert_close(
        flat, torch.cat([g.flatten() for g in free.values()]) * (1e-3 / norm)
    )


def test_autocast_dtype_follows_the_gpu():
    # decided from what the GPU has, so it is tested on a CPU-only machine
    assert autocast_dtype("cuda", native_bf16=True) == torch.bfloat16  # Ampere+
    assert autocast_dtype("cuda", native_bf16=False) == torch.float16  # e.g. a T4
    assert autocast_dtype("cpu") is None
    assert not grad_scaler("cpu").is_enabled()  # fp32 on the CPU: nothing to scale


def test_a_scaled_step_equals_an_unscaled_one():
    """The gradient scaler's path, on the CPU: scaling by 2^16 and unscaling by 2^-16
    are exact in binary floating point, so weights and norm are bit for bit those of
    an unscaled step. Seen to catch: `scaler.unscale_(optimizer)` removed (the norm
    is then 2^16 times too large and clipping shrinks the step)."""
    examples = [DATA[i] for i in range(8)]

    def step(scaler):
        model = toy_model()
        optimizer = make_optimizer(model, lr=1e-2)
        scheduler = make_scheduler(optimizer, 1, 10)
        _, norm = training_step(
            model, [collate(examples)], optimizer, scheduler, scaler=scaler
        )
        return model, norm

    (plain, plain_norm) = step(None)
    (scaled, scaled_norm) = step(torch.amp.GradScaler("cpu", init_scale=2.0**16))
    assert scaled_norm == plain_norm
    for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
        assert torch.equal(p, q), name


def test_gradient_checkpointing_gives_the_same_gradients():
    batch = collate([DATA[i] for i in range(4)])
    grads = []
    for checkpointed in (False, True):
        model = set_gradient_checkpointing(toy_model(), checkpointed)
        model(**{k: batch[k] for k in batch.keys()}).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        # recomputation repeats the same fp32 kernels; gradient sums in another order:
        # ~6e-6
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7)
    layer = model.language_model.model.layers[0]
    assert "forward" in layer.__dict__
    set_gradient_checkpointing(model, False)
    assert "forward" not in layer.__dict__


def test_a_checkpointed_model_is_freed_without_the_garbage_collector():
    # the GPU script's 3B LoRA steps: a float32 model's layers outlived it (a layer
    # whose forward held the layer is a cycle) and the float16 step ran out of memory
    gc.disable()
    try:
        model = set_gradient_checkpointing(toy_model())
        layer = weakref.ref(model.language_model.model.layers[0])
        twin = copy.deepcopy(model)
        pickled = pickle.loads(pickle.dumps(model))
        del model
        assert layer() is None
    finally:
        gc.enable()
    batch = collate([DATA[i] for i in range(2)])
    for copied in (twin, pickled):  # each copy's forward runs its own layers
        first = copied.language_model.model.layers[0]
        assert first.forward.layer() is first
        copied(**{k: batch[k] for k in batch.keys()}).loss.backward()
        assert first.mlp.down_proj.weight.grad is not None


def test_train_config_refuses_impossible_settings():
    for bad in ({"steps": 0}, {"lr": float("nan")}, {"min_lr_ratio": 2.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TrainConfig(**bad)
    with pytest.raises(ValueError, match="multiple of 4"):
        TrainConfig(batch_size=6, accumulation=2).micro_batch_size(world_size=2)


# --- checkpoints and resume ---

SMALL = TrainConfig(steps=6, batch_size=4, lr=1e-2, warmup_steps=1, save_every=2)


def flipping_collate(examples):
    """collate after a random left-right flip of each image (torch's generator): the
    batches depend on the random state, so a resume that forgot it changes them"""
    images, prompts, answers = zip(*examples)
    flip = Image.Transpose.FLIP_LEFT_RIGHT
    images = [im.transpose(flip) if torch.rand(()) < 0.5 else im for im in images]
    return collate(list(zip(images, prompts, answers)))


def stopped_and_resumed(tmp_path, **train_kw):
    """The SMALL run on flipping_collate twice: uninterrupted, and stopped after step 5
    then resumed from its step-4 checkpoint into other initial weights ->
    (uninterrupted model, its history, resumed model, its history)"""
    uninterrupted = toy_model()
    expected = train(uninterrupted, DATA, flipping_collate, SMALL, progress=False,
                     **train_kw)  # fmt: skip

    def stop(step, loss):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(toy_model(), DATA, flipping_collate, SMALL, out_dir=tmp_path,
              progress=False, on_step=stop, **train_kw)  # fmt: skip
    assert latest_checkpoint(tmp_path).name == "step-0000004"
    resumed = toy_model(seed=1)  # the checkpoint replaces these weights
    history = train(resumed, DATA, flipping_collate, SMALL, out_dir=tmp_path,
                    resume=True, progress=False, **train_kw)  # fmt: skip
    return uninterrupted, expected, resumed, history


def test_a_resumed_run_ends_bit_for_bit_equal(tmp_path):
    """Bit for bit: the same fp32 operations in the same order on the same CPU. Seen
    to catch: `set_rng_states` made a no-op (the random flips differ after resume)."""
    uninterrupted, _, resumed, history = stopped_and_resumed(tmp_path)
    assert history["step"] == [1, 2, 3, 4, 5, 6]
    # the start's steps up to the checkpoint it left, then the resume's
    segments = [{"steps": [0, 4], "processes": 1}, {"steps": [4, 6], "processes": 1}]
    assert history["segments"] == segments
    for (name, p), q in zip(uninterrupted.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    names = sorted(p.name for p in (tmp_path / CHECKPOINTS).iterdir())
    assert names == ["step-0000004", "step-0000006"]  # the last two, no stray folder


class FakeGpus:
    """torch.cuda's generator calls on a machine of `count` GPUs, on the CPU: each
    GPU's state a distinct tensor; an index past the last GPU raises IndexError, as
    torch/cuda/random.py does"""

    def __init__(self, monkeypatch, count: int, current: int = 0):
        self.count, self.current = count, current
        self.states = {
            i: torch.full((8,), 10 * count + i, dtype=torch.uint8) for i in range(count)
        }
        calls = ["get_rng_state", "set_rng_state", "current_device", "device_count"]
        for name in [*calls, "get_rng_state_all", "set_rng_state_all"]:
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def index(self, device) -> int:
        if not isinstance(device, int):
            device = torch.device(device).index
            device = self.current if device is None else device
        if not 0 <= device < self.count:
            raise IndexError("list index out of range")
        return device

    def get_rng_state(self, device="cuda"):
        return self.states[self.index(device)].clone()

    def set_rng_state(self, new_state, device="cuda"):
        self.states[self.index(device)] = new_state.clone()

    def get_rng_state_all(self):
        return [self.get_rng_state(i) for i in range(self.count)]

    def set_rng_state_all(self, new_states):
        for i, state in enumerate(new_states):
            self.set_rng_state(state, i)

    def current_device(self):
        return self.current

    def device_count(self):
        return self.count


def test_a_checkpoint_of_more_gpus_resumes_on_fewer(tmp_path, monkeypatch):
    """A process on GPU 1 of 2 saves a plain checkpoint; it resumes on a machine of one
    GPU (the sharded path shares rng_states and set_rng_states): the state that
    process drew from goes onto the GPU this process draws from, and no GPU that is
    not there is asked for. A checkpoint that held every GPU's states (a list) puts
    back the states of the GPUs there are. Seen to catch: every GPU's states saved and
    set_rng_state_all'ed (IndexError)."""
    from paligemma_lib.resume import load_checkpoint, save_checkpoint, set_rng_states

    model = toy_model()
    optimizer = make_optimizer(model, lr=1e-2)
    scheduler = make_scheduler(optimizer, 1, 10)
    two = FakeGpus(monkeypatch, count=2, current=1)
    drawn = two.states[1]
    folder = save_checkpoint(tmp_path, model, optimizer, scheduler, {"step": 1})
    one = FakeGpus(monkeypatch, count=1)
    assert load_checkpoint(folder, model, optimizer, scheduler) == {"step": 1}
    assert torch.equal(one.states[0], drawn)
    every = {"python": random.getstate(), "torch": torch.get_rng_state()}
    set_rng_states({**every, "cuda": [drawn, drawn + 1]})  # an older checkpoint
    assert torch.equal(one.states[0], drawn)


def test_the_collator_draws_no_random_numbers():
    # what makes batches built by DataLoader workers (their own generators) the
    # loop's: the library's Collator leaves every generator as it found it
    from paligemma_lib.data import Collator

    states = random.getstate(), torch.get_rng_state(), np.random.get_state()[1]
    batch = Collator(PROCESSOR)([DATA[i] for i in range(4)])
    assert batch.input_ids.shape[0] == 4
    assert random.getstate() == states[0]
    assert torch.equal(torch.get_rng_state(), states[1])
    assert (np.random.get_state()[1] == states[2]).all()


def test_worker_processes_give_the_same_weights():
    # batches built ahead by 2 DataLoader workers are the batches built in the loop
    inline, ahead = toy_model(), toy_model()
    train(inline, DATA, collate, SMALL, progress=False)
    history = train(ahead, DATA, collate, SMALL, progress=False, workers=2)
    assert history["step"] == [1, 2, 3, 4, 5, 6]
    for (name, p), q in zip(inline.named_parameters(), ahead.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="workers=-1"):
        train(toy_model(), DATA, collate, SMALL, progress=False, workers=-1)


def test_resume_refuses_other_settings_or_nothing_to_resume(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(toy_model(), DATA, collate, SMALL, out_dir=tmp_path, resume=True)
    train(toy_model(), DATA, collate, SMALL, out_dir=tmp_path, progress=False)
    other = TrainConfig(**{**SMALL.__dict__, "lr": 1e-3})
    with pytest.raises(ValueError, match="lr"):
        train(toy_model(), DATA, collate, other, out_dir=tmp_path, resume=True)


# --- DDP: 2 gloo processes = 1 process ---

# The start of a torchrun worker's script (also tests/test_fsdp.py's): the toy task
WORKER = """
import json
import sys
import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from paligemma_lib.config import PaliGemmaConfig, TextConfig, VisionConfig
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.processing import PaliGemmaProcessor
from paligemma_lib.tokenization import GemmaTokenizer, default_tokenizer_path
from paligemma_lib.train import TrainConfig, init_distributed, train

torch.set_num_threads(1)
TOKENIZER = GemmaTokenizer.from_file(default_tokenizer_path())
PROCESSOR = PaliGemmaProcessor(TOKENIZER, image_size=28, num_image_tokens=4)
COLOURS = {COLOURS}
{TOY}
"""


def worker_script(body: str) -> str:
    "WORKER with the toy task written in, then `body`"
    toy = WORKER.replace("{COLOURS}", repr(COLOURS))
    return toy.replace("{TOY}", textwrap.dedent(TOY)) + textwrap.dedent(body)


DDP_SCRIPT = """
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

rank, world_size = init_distributed("cpu")
model = toy_model()
names = {id(p): n for n, p in model.named_parameters()}
step1 = {}  # the gradients the first step used, and the weights it made


def keep(optimizer, prefix, read):
    if not any(k.startswith(prefix) for k in step1):
        for group in optimizer.param_groups:
            for p in group["params"]:
                step1[prefix + names[id(p)]] = read(p).detach().clone()


register_optimizer_step_pre_hook(lambda o, *_: keep(o, "grad.", lambda p: p.grad))
register_optimizer_step_post_hook(lambda o, *_: keep(o, "weight.", lambda p: p))
config = TrainConfig(steps=4, batch_size=8, accumulation=2, lr=1e-2, warmup_steps=1)
history = train(model, ColourDataset(32), collate, config, progress=False)
if rank == 0:
    save_file(dict(model.named_parameters()), sys.argv[1])
    save_file(step1, sys.argv[1] + ".step1")
    with open(sys.argv[1] + ".json", "w") as f:
        json.dump(history["grad_norm"], f)
"""


def run_worker(tmp_path, script: str, processes: int, *args, timeout=120, **env):
    "`script` run by torchrun in `processes` gloo processes; its stderr if it fails"
    path = tmp_path / "worker.py"
    path.write_text(script)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
            str(path),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]


def torchrun(tmp_path, processes: int) -> tuple:
    out = tmp_path / f"weights-{processes}.safetensors"
    run_worker(tmp_path, worker_script(DDP_SCRIPT), processes, out)
    from safetensors.torch import load_file

    norms = json.loads(Path(f"{out}.json").read_text())
    return load_file(out), norms, load_file(f"{out}.step1")


def adam_step_apart(g1, g2, w, lr, eps=1e-8):
    """The most one AdamW step from the same weights moves an entry apart in two runs
    whose gradients are g1 and g2 (w: the larger |weight|), as chapter 11b derives.
    The first step moves an entry by lr g / (|g| + eps) (moments from 0, the bias
    corrections cancel); f(g) = g / (|g| + eps) has slope eps / (|g| + eps)^2, largest
    at the smaller |g| on [g1, g2] (0 if the signs differ); |f| < 1 caps it at 2 lr"""
    g1, g2, w = g1.double(), g2.double(), w.double()
    same_sign = torch.sign(g1) == torch.sign(g2)
    m = torch.where(same_sign, torch.minimum(g1.abs(), g2.abs()), 0.0)
    apart = (g1 - g2).abs() * eps / (m + eps) ** 2
    # each run rounds f (~8 fp32 operations, 8 x 2^-24 of |f| <= 1) and the new
    # weight (2^-24 of it); the weight decay is the same in both
    rounding = lr * 16 * 2**-24 + 2 * 2**-24 * w
    return lr * apart.clamp(max=2) + rounding


def adam_update_bound(t: int, betas=(0.9, 0.95)) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam can reach at step t, any gradients: by
    Cauchy-Schwarz, |sum b1^k g| <= sqrt(sum (b1^2 / b2)^k) sqrt(sum b2^k g^2)"""
    b1, b2 = betas
    spread = math.sqrt(sum((b1 * b1 / b2) ** k for k in range(t)))
    return (1 - b1) / math.sqrt(1 - b2) * spread * math.sqrt(1 - b2**t) / (1 - b1**t)


def test_ddp_two_processes_equal_one(tmp_path):
    """Same global batch (8 = 2 processes x 2 micro-batches x 2). Seen to catch:
    `(loss * world_size).backward()` written `loss.backward()` (DDP's average then
    halves the gradient; Adam and clipping hide that in the weights, not in the norm
    of the first step's gradient)."""
    (one, one_norms, one_1), (two, two_norms, two_1) = (
        torchrun(tmp_path, 1),
        torchrun(tmp_path, 2),
    )
    # step 1's gradient, before any optimiser step: the same weights, the same sums in
    # another order. Each entry sums ~10^3 fp32 terms (tokens x width), so its rounding
    # is below 10^3 x eps32 ~ 1.2e-4 of the sum of magnitudes; the norm, dominated by
    # its large entries, moves less. A factor of 2 (the mutation) is far outside.
    assert math.isclose(two_norms[0], one_norms[0], rel_tol=1e-4), (
        one_norms,
        two_norms,
    )
    assert one.keys() == two.keys()
    # After step 1, from the same weights: apart by at most what Adam makes of the
    # two measured gradients, entry by entry
    for name in one:
        g1, g2 = one_1[f"grad.{name}"], two_1[f"grad.{name}"]
        w1, w2 = one_1[f"weight.{name}"], two_1[f"weight.{name}"]
        bound = adam_step_apart(g1, g2, torch.maximum(w1.abs(), w2.abs()), lr=1e-2)
        assert ((w2 - w1).double().abs() <= bound).all(), name
    # After 4 steps the gradients differ by the weights' differences too, which no
    # record bounds: only Adam's own bound holds, each step moving an entry by at most
    # lr x adam_update_bound(t) in either run (weight decay shrinks differences)
    apart = sum(2 * 1e-2 * adam_update_bound(t) for t in range(1, 5))
    for name in one:
        # Adam's bound above, absolute: rtol 0
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=apart)
    moved = toy_model().state_dict()
    assert not torch.equal(
        one["multi_modal_projector.linear.weight"],
        moved["multi_modal_projector.linear.weight"],
    )


class Joined(Exception):
    "Raised by the faked init_process_group: the test stops there"


@pytest.fixture
def gpu_machine(monkeypatch):
    """A machine PyTorch says has CUDA, under torchrun (WORLD_SIZE, LOCAL_RANK 1):
    -> the backends init_process_group was asked for and the GPUs set_device chose"""
    asked = {"backend": [], "gpu": []}

    def init_process_group(backend=None, **kw):
        asked["backend"].append(backend)
        raise Joined

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", asked["gpu"].append)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    return asked


@pytest.mark.parametrize(
    "device, backend, gpus",
    [("cpu", "gloo", []), ("cpu:0", "gloo", []), ("cuda", "nccl", [1])],
)
def test_the_process_group_follows_the_training_device(gpu_machine, device, backend,
                                                       gpus):  # fmt: skip
    """NCCL and a GPU per process only for a run on CUDA; a run on the CPU joins a
    gloo group on a machine with a GPU too (FSDP's and DDP's CPU tensors need it)"""
    from paligemma_lib.train import init_distributed

    assert not torch.distributed.is_initialized()
    with pytest.raises(Joined):
        init_distributed(device)
    assert gpu_machine == {"backend": [backend], "gpu": gpus}


def test_train_device_cpu_joins_gloo_on_a_gpu_machine(gpu_machine, tmp_path):
    "The command passes its --device: `torchrun ... train --device cpu` is gloo"
    from paligemma_lib.cli.main import main

    args = ["train", "--config", "tiny", "--out", tmp_path / "run", "--steps", "1"]
    with pytest.raises(Joined):
        main([*map(str, args), "--device", "cpu", "--fsdp"])
    assert gpu_machine == {"backend": ["gloo"], "gpu": []}


# --- metrics on hand-made predictions ---


def loc(y0, x0, y1, x1):
    return "".join(f"<loc{v:04d}>" for v in (y0, x0, y1, x1))


def test_levenshtein_and_character_error_rate():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "") == 0 and levenshtein("AB", "") == 2
    assert levenshtein("A1B2", "A1B2") == 0 and levenshtein("AB12", "BA12") == 2
    assert character_error_rate(["AB1Z", "HELL"], ["AB12", "HELLO."]) == 0.3
    assert character_error_rate(["XXXXXX"], ["AB"]) == 3.0  # can exceed 1
    with pytest.raises(ValueError):
        character_error_rate(["A"], [""])


def test_box_matching_and_detection_metrics():
    assert box_iou((0, 0, 2, 2), (1, 0, 3, 2)) == pytest.approx(1 / 3)
    assert box_iou((0, 0, 1, 1), (2, 2, 3, 3)) == 0.0
    a, b = (0, 0, 10, 10), (20, 20, 30, 30)
    assert match_boxes([(b, "x"), (a, "x")], [(a, "x"), (b, "x")]) == [1.0, 1.0]
    assert match_boxes([(a, "x")], [(a, "y")]) == [0.0, 0.0]  # labels must agree
    assert match_boxes([(a, "x"), (b, "x")], [(a, "x")]) == [1.0, 0.0]  # spurious
    truth = f"{loc(0, 0, 100, 100)} circle ; {loc(0, 500, 100, 600)} circle"
    # one exact box, one missed: IoUs 1 and 0
    m = detection_metrics([f"{loc(0, 500, 100, 600)} circle"], [truth])
    assert m == {"mean IoU": 0.5, "IoU >= 0.5": 0.5}
    # a box 60% as wide: IoU 0.6; one 40% as wide: 0.4, under the threshold
    m = detection_metrics(
        [f"{loc(0, 0, 100, 60)} square", f"{loc(0, 0, 100, 40)} square"],
        [f"{loc(0, 0, 100, 100)} square"] * 2,
    )
    assert m["mean IoU"] == pytest.approx(0.5) and m["IoU >= 0.5"] == 0.5
    assert (
        detection_metrics(["no boxes"], [f"{loc(0, 0, 10, 10)} square"])["mean IoU"]
        == 0
    )


def test_receipt_metrics_parse_leniently():
    truth = '{"store":"ACME MART","date":"2024-03-15","total":"12.40"}'
    assert parse_receipt("not json") == {}
    assert parse_receipt("[1, 2]") == {}
    assert parse_receipt('answer: {"store": "X"} end') == {"store": "X"}
    m = receipt_metrics(
        [
            truth,
            '{ "total":"12.40", "store":"ACME MART", "date":"2024-03-15" }',
            '{"store":"ACME MART","date":"2024-03-15","total":12.4}',
            '{"store":"ACME',
        ],
        [truth] * 4,
    )
    assert m["store accuracy"] == 0.75 and m["date accuracy"] == 0.75
    assert m["total accuracy"] == 0.5 and m["all fields"] == 0.5
    assert m["exact match"] == 0.25


def test_metrics_table_per_task():
    rows = [
        {
            "prompt": "caption en",
            "answer": "a red circle",
            "prediction": "a red circle ",
        },
        {"prompt": "caption en", "answer": "a red circle", "prediction": "a circle"},
        {
            "prompt": "answer en what color is the square?",
            "answer": "red",
            "prediction": "blue",
        },
        {"prompt": "ocr", "answer": "AB12", "prediction": "AB12"},
    ]
    m = compute_metrics(rows)
    assert m["caption"] == {"examples": 2, "exact match": 0.5}
    assert m["colour"]["exact match"] == 0.0
    assert m["ocr"]["character error rate"] == 0.0


# --- the command line ---


def cli(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "paligemma_lib", *map(str, args)],
        capture_output=True,
        text=True,
        **kw,
    )


def one_error_line(run, *words):
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--steps", "0"], ["--steps"]),
        (["--config", "huge"], ["--config huge", "nano"]),
        (["--worlds", "shapes=0.5,moon=1"], ["moon"]),
        (["--worlds", "shapes=-1"], ["positive"]),
        (["--batch-size", "6", "--accumulation", "4"], ["multiple of 4"]),
        (["--lr", "0"], ["lr"]),
        (["--device", "meta"], ["--device meta"]),
        (["--resume"], ["--resume", "no checkpoint"]),
        (["--workers", "-2"], ["--workers", "0 or more"]),
    ],
)
def test_train_bad_flags_are_one_line(tmp_path, flags, words):
    args = {"--config": "tiny", "--out": tmp_path / "run", "--steps": "2"}
    for flag, value in zip(flags[::2], flags[1::2]):
        args[flag] = value
    extra = [f for f in flags if f == "--resume"]
    run = cli("train", *[x for kv in args.items() for x in kv], *extra)
    one_error_line(run, *words)


def test_train_refuses_an_output_folder_with_a_run(tmp_path):
    (tmp_path / CHECKPOINTS / "step-0000002").mkdir(parents=True)
    run = cli("train", "--config", "tiny", "--out", tmp_path, "--steps", "2")
    one_error_line(run, "--resume")


def test_evaluate_bad_input_is_one_line(tmp_path):
    one_error_line(
        cli("evaluate", "--model", tmp_path, "--world", "shapes"), "config.json"
    )
    run = cli("evaluate", "--model", tmp_path, "--world", "moon")
    assert run.returncode == 2 and "invalid choice" in run.stderr  # argparse's usage


def test_train_then_evaluate_on_the_worlds(tmp_path):
    pytest.importorskip("paligemma_lib.data")
    out = tmp_path / "run"
    run = cli(
        "train",
        "--config",
        "tiny",
        "--out",
        out,
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--eval-size",
        "2",
        "--train-size",
        "8",
        "--no-progress",
    )
    assert run.returncode == 0, run.stderr
    record = json.loads((out / "training_record.json").read_text())
    assert record["steps"] == 2 and record["command"].startswith(
        "python -m paligemma_lib"
    )
    assert (
        len(record["history"]["loss"]) == 2
        and "validation loss" in record["final_metrics"]
    )
    for name in ("config.json", "model.safetensors", "tokenizer.model"):
        assert (out / name).is_file()
    run = cli(
        "evaluate",
        "--model",
        out,
        "--world",
        "ocr",
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
    )
    assert run.returncode == 0, run.stderr
    assert "character error rate" in run.stdout
    assert "evaluations" not in json.loads((out / "training_record.json").read_text())
    run = cli(
        "evaluate",
        "--model",
        out,
        "--world",
        "ocr",
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
        "--record",
    )
    assert run.returncode == 0, run.stderr
    record = json.loads((out / "training_record.json").read_text())
    added = record["evaluations"]["ocr/validation"]  # evaluate's default split
    assert added["examples"] == 2
    assert "character error rate" in added["metrics"]["ocr"]
    assert added["command"].endswith("--record") and record["steps"] == 2  # kept
    (out / "training_record.json").unlink()
    one_error_line(
        cli("evaluate", "--model", out, "--world", "ocr", "--record"),
        "training_record.json does not exist",
    )


# --- fine-tuning: train --model, --lora, --adapter (chapter 12) ---


def adapter_only(name: str) -> bool:
    "A LoRA weight or the trained token rows"
    return "lora" in name or "token_adapter" in name


@pytest.mark.parametrize("rows", [None, [5, 6, 7]], ids=["lora", "lora+rows"])
def test_a_resumed_lora_run_ends_bit_for_bit_equal(tmp_path, rows):
    """Bit for bit (same fp32 operations, same order). LoRA dropout 0.5 draws from
    torch's generator at every step. Seen to catch: `set_rng_states` made a no-op.
    With trained token rows (issue 40), the checkpoint holds and restores them too."""
    from paligemma_lib.lora import LoraConfig, add_lora, lora_state_dict

    def adapted(seed=0):
        model = toy_model()  # the same base weights every time
        torch.manual_seed(seed)  # the adapter's own initialisation
        add_lora(model, LoraConfig(r=2, dropout=0.5, trainable_token_indices=rows))
        if seed:  # rows other than the checkpoint's, which must replace them
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "token_adapter" in name:
                        p.add_(1.0)
        return model

    uninterrupted = adapted()
    base = {
        k: v.clone()
        for k, v in uninterrupted.state_dict().items()
        if not adapter_only(k)
    }
    train(uninterrupted, DATA, collate, SMALL, progress=False)

    def stop(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(adapted(), DATA, collate, SMALL, out_dir=tmp_path, progress=False,
              on_step=stop)  # fmt: skip
    folder = latest_checkpoint(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_state.pt",
    ]  # the adapter alone: the base is frozen
    resumed = adapted(seed=1)  # other adapter weights: the checkpoint replaces them
    train(resumed, DATA, collate, SMALL, out_dir=tmp_path, resume=True, progress=False)
    ours, theirs = lora_state_dict(uninterrupted), lora_state_dict(resumed)
    assert ours.keys() == theirs.keys() and len(ours) > 0
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    for name, value in uninterrupted.state_dict().items():  # the base never moved
        if not adapter_only(name):
            assert torch.equal(value, base[name]), name


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--config", "tiny", "--model", "nano"], ["--config", "--model", "not both"]),
        ([], ["--config", "--model"]),
        (["--config", "tiny", "--lora"], ["--lora needs --model"]),
        (["--config", "tiny", "--eval-data", "x"], ["--eval-data goes with --data"]),
        (["--model", "nano", "--data", "nowhere"], ["nowhere"]),
        (["--model", "nano", "--lora", "--lora-targets", "nope"], ["nope"]),
        (["--model", "nano", "--lora-tokens", "seg"], ["--lora-tokens", "add --lora"]),
        (["--model", "nano", "--lora", "--lora-tokens", "seg,nope"], ["seg,loc"]),
        (["--model", "nano", "--lora", "--lora-tokens", "seg", "--fsdp"], ["--fsdp"]),
    ],
)
def test_fine_tuning_bad_flags_are_one_line(tmp_path, flags, words):
    run = cli("train", "--out", tmp_path / "run", "--steps", "2", *flags)
    one_error_line(run, *words)


def trained_tiny_model(folder: Path) -> Path:
    "A model folder from one step of `train --config tiny`: a base to fine-tune"
    run = cli("train", "--config", "tiny", "--out", folder, "--steps", "1",
              "--batch-size", "2", "--eval-size", "1", "--no-progress")  # fmt: skip
    assert run.returncode == 0, run.stderr
    return folder


def test_train_lora_then_evaluate_with_the_adapter(tmp_path):
    from paligemma_lib.weights import load_pretrained

    base = trained_tiny_model(tmp_path / "base")
    out = tmp_path / "adapter"
    run = cli("train", "--model", base, "--lora", "--lora-targets", "all",
              "--worlds", "receipts=1", "--out", out, "--steps", "2",
              "--batch-size", "2", "--eval-size", "1", "--lr", "0.05",
              "--no-progress")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_record.json",
    ]
    record = json.loads((out / "training_record.json").read_text())
    assert record["fine-tuned from"] == str(base) and record["lora"]["r"] == 8
    trainable, total = record["parameters"]["trainable"], record["parameters"]["total"]
    assert 0 < trainable < total
    # the base folder is untouched; the adapter changes the model's output
    from paligemma_lib.adapters import load_adapter

    model = load_pretrained(base).eval()
    ids = torch.tensor([[5] * model.config.num_image_tokens + [2, 7, 8]])
    pixels = torch.randn(1, 3, 224, 224)
    before = model(input_ids=ids, pixel_values=pixels)
    load_adapter(model, out)
    after = model(input_ids=ids, pixel_values=pixels)
    before, after = (getattr(x, "logits", x) for x in (before, after))
    assert not torch.allclose(before, after)
    run = cli("evaluate", "--model", base, "--adapter", out, "--world", "receipts",
              "--limit", "1", "--max-new-tokens", "2")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "store accuracy" in run.stdout
    run = cli("evaluate", "--model", base, "--adapter", tmp_path, "--world", "ocr")
    one_error_line(run, "--adapter", "adapter_config.json")


def test_train_lora_with_token_rows(tmp_path):
    """--lora-tokens seg: the 128 <seg> rows train with the adapter, are saved as
    PEFT saves them, and the record says which (issue 40)"""
    from paligemma_lib.adapters import ADAPTER_CONFIG, load_adapter
    from paligemma_lib.tokenization import SEG_TOKENS
    from paligemma_lib.weights import load_pretrained

    base = trained_tiny_model(tmp_path / "base")
    out = tmp_path / "adapter"
    run = cli("train", "--model", base, "--lora", "--lora-tokens", "seg",
              "--out", out, "--steps", "2", "--batch-size", "2", "--eval-size", "1",
              "--no-progress")  # fmt: skip
    assert run.returncode == 0, run.stderr
    record = json.loads((out / "training_record.json").read_text())
    assert record["lora"]["trainable_tokens"] == {"seg": 128}
    tokenizer = PaliGemmaProcessor.from_pretrained(base).tokenizer
    seg_ids = [tokenizer.piece_to_id(p) for p in SEG_TOKENS]
    saved = json.loads((out / ADAPTER_CONFIG).read_text())
    assert saved["trainable_token_indices"] == seg_ids
    model = load_pretrained(base)
    table = model.language_model.model.embed_tokens.weight.detach().clone()
    load_adapter(model, out)
    hidden = model.config.text.hidden_size
    rows = model.language_model.model.embed_tokens.token_adapter.trainable_tokens_delta
    assert list(rows.shape) == [128, hidden] and not torch.equal(rows, table[seg_ids])
    trainable = record["parameters"]["trainable"]
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_the_shipped_receipts_adapter_reads_a_validation_receipt():
    from paligemma_lib.adapters import load_adapter
    from paligemma_lib.data import SyntheticDataset
    from paligemma_lib.generation import answer
    from paligemma_lib.weights import load_pretrained

    model = load_pretrained("nano").eval()
    processor = PaliGemmaProcessor.from_pretrained("nano")
    receipts = SyntheticDataset({"receipts": 1}, "validation", size=1)
    image, prompt, truth = receipts[0]
    assert answer(model, processor, image, prompt, max_new_tokens=48) != truth
    names = load_adapter(model, "receipts")
    assert any("vision" in n for n in names) and any("language" in n for n in names)
    assert answer(model, processor, image, prompt, max_new_tokens=48) == truth


def test_train_lora_on_a_jsonl_folder(tmp_path):
    from paligemma_lib.data import SyntheticDataset
    from paligemma_lib.finetune import write_jsonl

    receipts = SyntheticDataset({"receipts": 1}, "train", size=2)
    write_jsonl([receipts[0], receipts[1]], tmp_path / "mine")
    base, out = trained_tiny_model(tmp_path / "base"), tmp_path / "adapter"
    run = cli("train", "--model", base, "--lora", "--data", tmp_path / "mine",
              "--eval-data", tmp_path / "mine", "--out", out, "--steps", "2",
              "--batch-size", "2", "--no-progress")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "receipt exact match" in run.stdout  # evaluated on --eval-data
    record = json.loads((out / "training_record.json").read_text())
    assert record["data"] == str(tmp_path / "mine") and record["worlds"] is None
    assert (out / "adapter_model.safetensors").is_file()
