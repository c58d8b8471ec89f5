"""`train --lora --from-adapter`: a GPU run goes on from a shipped adapter (issue 49
section 4) instead of a new one; what it starts from, and what it refuses."""

import json

import pytest
import torch
from safetensors.torch import load_file
from test_train import cli, one_error_line

from paligemma_lib.adapters import resolve_adapter_path

BASE = ["train", "--model", "nano", "--lora", "--worlds", "receipts=1",
        "--train-size", "10", "--eval-size", "2", "--batch-size", "2",
        "--device", "cpu", "--no-progress"]  # fmt: skip
LR, STEPS = 1e-6, 2


def test_training_goes_on_from_the_shipped_adapter(tmp_path):
    out = tmp_path / "run"
    run = cli(*BASE, "--from-adapter", "receipts", "--lora-tokens", "loc",
              "--steps", STEPS, "--lr", LR, "--out", out)  # fmt: skip
    assert run.returncode == 0, run.stderr
    shipped = resolve_adapter_path("receipts")
    before = load_file(shipped / "adapter_model.safetensors")
    after = load_file(out / "adapter_model.safetensors")
    rows = [k for k in after if k not in before]
    assert len(rows) == 1 and "trainable_tokens_delta" in rows[0]  # the <loc> rows
    for key, tensor in before.items():
        # AdamW moves an entry by at most lr (1 - beta1) / sqrt(1 - beta2), about
        # 3.2 lr, a step (plus lr x decay x |w|, far less); a new adapter's lora_B
        # starts at 0, where the shipped one's entries reach about 0.1
        bound = STEPS * 3.3 * LR  # AdamW's largest move, lr x 0.1 / sqrt(0.001)
        torch.testing.assert_close(after[key], tensor, rtol=0, atol=bound)  # AdamW
    config = json.loads((out / "adapter_config.json").read_text())
    saved = json.loads((shipped / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (saved["r"], saved["lora_alpha"])
    assert config["target_modules"] == saved["target_modules"]
    assert len(config["trainable_token_indices"]) == 1024
    record = json.loads((out / "training_record.json").read_text())
    assert record["lora"]["from adapter"] == "receipts"


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--from-adapter", "receipts", "--lora-r", "16"], ["r=8", "alpha=16"]),
        (["--from-adapter", "no-such-adapter"], ["--from-adapter no-such-adapter"]),
    ],
)
def test_a_mismatched_or_missing_adapter_is_refused(tmp_path, flags, words):
    one_error_line(cli(*BASE, *flags, "--steps", 1, "--out", tmp_path / "r"), *words)


def test_from_adapter_needs_lora(tmp_path):
    base = [f for f in BASE if f != "--lora"]
    run = cli(*base, "--from-adapter", "receipts", "--steps", 1, "--out", tmp_path)
    one_error_line(run, "--from-adapter", "add --lora")
