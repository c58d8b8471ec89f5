"""Issue 39, the command line as a newcomer meets it: nothing shipped is written, a
task the model was not taught is refused, and every refusal names its file."""

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
from PIL import Image
from scripted import scripted_checkpoint

from paligemma_lib.__main__ import main
from paligemma_lib.adapters import load_adapter, shipped_adapter_path
from paligemma_lib.generation import answer
from paligemma_lib.model_files import shipped_model_path
from paligemma_lib.processing import PaliGemmaProcessor
from paligemma_lib.weights import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
SEGMENT_SCENE = ROOT / "book" / "figures" / "segment_scene.png"


class Run(NamedTuple):
    code: int
    out: str
    err: str


@pytest.fixture
def run(capsys):
    "main() in this process, its status and output"

    def run(*args):
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return Run(code, out.out, out.err)

    return run


def one_error_line(run: Run, *words) -> str:
    "Status 1, a single `error:` line on stderr naming `words`"
    assert run.code == 1, run
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    "The scripted tiny checkpoint (no training record) and its adapter"
    root = tmp_path_factory.mktemp("scripted")
    model, adapter = scripted_checkpoint(root)
    Image.new("RGB", (64, 48), "teal").save(root / "image.png")
    return {"model": model, "adapter": adapter, "image": root / "image.png"}


def contents(*folders) -> dict:
    return {f: f.read_bytes() for folder in folders for f in Path(folder).iterdir()}


# 1. evaluate --record writes only the record of the folder evaluated, never a
# shipped one


@pytest.mark.parametrize("adapter", [[], ["--adapter", "receipts"]])
def test_record_refuses_the_shipped_folders(run, adapter):
    shipped = [shipped_model_path("nano"), shipped_adapter_path("receipts")]
    before = contents(*shipped)
    try:
        result = run("evaluate", *adapter, "--world", "shapes", "--limit", "1",
                     "--max-new-tokens", "2", "--record")  # fmt: skip
        after = contents(*shipped)
    finally:  # what a command wrote into the package, put back
        for file, data in before.items():
            if file.read_bytes() != data:
                file.write_bytes(data)
    flag = "--adapter receipts" if adapter else "--model nano"
    one_error_line(result, "--record", flag, "shipped", "cp -r")
    assert after == before


def test_record_goes_into_the_adapters_record(run, scripted, tmp_path):
    model = shutil.copytree(scripted["model"], tmp_path / "model")
    adapter = shutil.copytree(scripted["adapter"], tmp_path / "adapter")
    for folder in (model, adapter):
        (folder / "training_record.json").write_text('{"steps": 1}\n')
    result = run("evaluate", "--model", model, "--adapter", adapter, "--record",
                 "--world", "ocr", "--limit", "2", "--max-new-tokens", "2")  # fmt: skip
    assert result.code == 0, result
    assert result.out.splitlines()[-1] == (
        f"metrics added to {adapter / 'training_record.json'}"
    )
    added = json.loads((adapter / "training_record.json").read_text())
    assert added["evaluations"]["ocr/test"]["examples"] == 2
    assert (model / "training_record.json").read_text() == '{"steps": 1}\n'


# 3. a segment prompt, or the segments world, without an adapter that taught it


def test_segment_without_the_segment_adapter_is_refused(run, tmp_path):
    out = tmp_path / "x.png"
    result = run("generate", "--image", SEGMENT_SCENE, "--prompt", "segment circle",
                 "--draw", out)  # fmt: skip
    one_error_line(result, "nano was not taught `segment`", "--adapter segment")
    assert not out.exists()
    result = run("generate", "--image", SEGMENT_SCENE, "--prompt", "segment circle",
                 "--adapter", "receipts")  # fmt: skip
    one_error_line(result, "with adapter receipts was not taught", "--adapter segment")
    result = run("evaluate", "--world", "segments", "--limit", "1")
    one_error_line(result, "nano was not taught `segment`", "--adapter segment")


# 5. a broken adapter folder: the file named, and what to do


def broken_adapter(scripted, tmp_path, name: str, content: bytes) -> Path:
    folder = shutil.copytree(scripted["adapter"], tmp_path / "broken")
    if content is None:  # cut short, as by an interrupted copy
        data = (folder / name).read_bytes()
        content = data[: len(data) // 2]
    (folder / name).write_bytes(content)
    return folder


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("adapter_config.json", b'{"r": 8,\n', ("is not valid JSON",)),
        ("adapter_config.json", b'{"peft_type": "LORA"}', ("has no 'r'",)),
        ("adapter_model.safetensors", None, ("truncated", "download")),
        ("adapter_model.safetensors", b"\xff" * 100, ("damaged",)),
    ],
)
def test_a_broken_adapter_names_its_file(run, scripted, tmp_path, name, content, words):
    folder = broken_adapter(scripted, tmp_path, name, content)
    result = run("generate", "--model", scripted["model"], "--adapter", folder,
                 "--image", scripted["image"], "--prompt", "caption en")  # fmt: skip
    line = one_error_line(result, f"--adapter {folder}", str(folder / name), *words)
    assert "Error while deserializing" not in line
    model = load_pretrained(scripted["model"])
    with pytest.raises(ValueError, match=str(folder / name)):
        load_adapter(model, folder)
    # the demo checks its adapters before it loads anything or imports Gradio
    result = run("demo", "--model", scripted["model"], "--segment-adapter", folder)
    one_error_line(result, f"--segment-adapter {folder}", str(folder / name))


# 6. --seg-vae that is not an .npz of the VAE's arrays


@pytest.mark.parametrize("kind", ["png", "text"])
def test_seg_vae_that_is_no_npz(run, scripted, tmp_path, kind):
    vae = tmp_path / f"vae.{kind}"
    if kind == "png":
        Image.new("RGB", (8, 8)).save(vae, format="PNG")
    else:
        vae.write_text("not arrays\n")
    result = run("generate", "--model", scripted["model"], "--image",
                 scripted["image"], "--prompt", "segment circle", "--seg-vae",
                 vae)  # fmt: skip
    line = one_error_line(result, str(vae), "is not an .npz file of the mask VAE")
    assert "pickle" not in line


# 8. the Python API: no prompt, a URL


def test_answer_without_a_prompt_or_with_a_url(scripted):
    model = load_pretrained(scripted["model"])
    processor = PaliGemmaProcessor.from_pretrained(scripted["model"])
    with pytest.raises(TypeError, match=r"prompts is NoneType: pass a str"):
        answer(model, processor, scripted["image"], None)
    with pytest.raises(ValueError, match=r"^https://x\.org/a\.png is a URL"):
        answer(model, processor, "https://x.org/a.png", "caption en")


# 10. --data with --worlds; evaluate's answers cut at --max-new-tokens


def test_data_with_worlds_is_refused(run, scripted, tmp_path):
    data = tmp_path / "mine"
    data.mkdir()
    shutil.copy(scripted["image"], data / "image.png")
    line = {"image": "image.png", "prefix": "caption en", "suffix": "teal"}
    (data / "data.jsonl").write_text(json.dumps(line) + "\n")
    out = tmp_path / "out"
    result = run("train", "--model", scripted["model"], "--data", data, "--worlds",
                 "ocr=1", "--out", out, "--steps", "1", "--no-progress")  # fmt: skip
    one_error_line(result, "--worlds ocr=1 with --data", "leave out one")
    assert not out.exists()


def test_evaluate_says_when_answers_were_cut(run, scripted):
    result = run("evaluate", "--model", scripted["model"], "--world", "shapes",
                 "--limit", "2", "--max-new-tokens", "1")  # fmt: skip
    assert result.code == 0, result
    notes = [line for line in result.err.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: answers stopped at --max-new-tokens 1 before their end (<eos>) are "
        "graded as they stand, cut short; raise --max-new-tokens"
    ]


# 11. an empty folder named like a shipped model or adapter


def test_an_empty_folder_named_like_a_shipped_one(run, scripted, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("nano").mkdir()
    result = run("generate", "--image", scripted["image"], "--prompt", "caption en")
    one_error_line(result, "a folder nano here was found before the shipped model",
                   str(shipped_model_path("nano")))  # fmt: skip
    Path("receipts").mkdir()
    result = run("generate", "--model", scripted["model"], "--adapter", "receipts",
                 "--image", scripted["image"], "--prompt", "caption en")  # fmt: skip
    one_error_line(result, "a folder receipts here was found before the shipped "
                   "adapter", str(shipped_adapter_path("receipts")))  # fmt: skip


# 12. evaluate's progress bar, as train's: on unless --no-progress


def test_evaluate_shows_its_progress(run, scripted):
    args = ["evaluate", "--model", scripted["model"], "--world", "shapes",
            "--limit", "3", "--batch-size", "2", "--max-new-tokens", "3"]  # fmt: skip
    shown = run(*args)
    assert shown.code == 0, shown
    assert "evaluating" in shown.err and "3/3" in shown.err
    quiet = run(*args, "--no-progress")
    assert quiet.code == 0 and "evaluating" not in quiet.err
    assert quiet.out == shown.out


# 13. the docs and --help agree with the commands


def test_docs_and_help_agree_with_the_commands(run, tmp_path):
    from paligemma_lib.adapters import SHIPPED_ADAPTERS
    from paligemma_lib.cli.main import build_parser
    from paligemma_lib.cli.options import DEFAULT_MAX_NEW_TOKENS

    a1 = " ".join((ROOT / "book" / "a1_using_the_library.md").read_text().split())
    assert f"stop after {DEFAULT_MAX_NEW_TOKENS} new tokens" in a1
    assert "stops after 64" not in a1
    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    help_text = " ".join(generate.format_help().split())
    assert f"shipped adapter ({', '.join(SHIPPED_ADAPTERS)};" in help_text
    model_help = help_text[help_text.index("--model MODEL checkpoint") :]
    model_help = model_help[: model_help.index("--adapter ADAPTER a LoRA")]
    assert model_help.lower().count("default") == 1, model_help
    # demo --adapter takes a shipped adapter's name, as generate does: the command
    # goes on to the model (which does not exist here)
    result = run("demo", "--adapter", "receipts", "--model", tmp_path / "none")
    one_error_line(result, "no checkpoint folder at")
