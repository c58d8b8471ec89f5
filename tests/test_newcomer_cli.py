"""Issues 39 and 51, the command line as a newcomer meets it: nothing shipped is
written, a task the model was not taught is refused or noted, and every refusal names
its file."""

import json
import os
import re
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
    assert added["evaluations"]["ocr/validation"]["examples"] == 2
    assert added["evaluations"]["ocr/validation"]["indices"] == [0, 1]
    assert (model / "training_record.json").read_text() == '{"steps": 1}\n'


def test_evaluate_grades_validation_unless_told_and_start_picks_the_window(
    run, scripted, tmp_path
):
    "A grade on test is asked for, and says which indices it read"
    model = shutil.copytree(scripted["model"], tmp_path / "model")
    (model / "training_record.json").write_text('{"steps": 1}\n')
    result = run("evaluate", "--model", model, "--record", "--world", "ocr",
                 "--split", "test", "--start", "5", "--limit", "2",
                 "--max-new-tokens", "2")  # fmt: skip
    assert result.code == 0, result
    assert "(test, 2 examples from index 5)" in result.out
    added = json.loads((model / "training_record.json").read_text())
    assert added["evaluations"]["ocr/test 5-6"]["indices"] == [5, 6]
    one_error_line(
        run(
            "evaluate",
            "--model",
            model,
            "--world",
            "ocr",
            "--start",
            "9999",
            "--limit",
            "2",
        ),  # fmt: skip
        "--start 9999 --limit 2: the validation split's indices run from 0 to 9,999",
    )


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


# 11. an empty folder named like a shipped model or adapter: the shipped one is
# used (issue 51 §5), and a note says the folder is ./NAME


def test_an_empty_folder_named_like_a_shipped_one(run, scripted, tmp_path, monkeypatch):
    image = ["--image", ROOT / "book" / "figures" / "nano_scene.png", "--prompt",
             "caption en"]  # fmt: skip
    expected = run("generate", *image)
    monkeypatch.chdir(tmp_path)
    Path("nano").mkdir()
    result = run("generate", *image)
    assert result.code == 0 and result.out == expected.out, result
    assert notes(result) == [
        "note: nano means the shipped model; the folder nano here is no model (no "
        "config.json)"
    ]
    result = run("generate", "--model", "./nano", *image)
    one_error_line(result, "nano is not a PaliGemma checkpoint: it has no config.json")
    Path("receipts").mkdir()
    result = run("generate", "--model", scripted["model"], "--adapter", "./receipts",
                 *image)  # fmt: skip
    one_error_line(result, "receipts holds no adapter_config.json")


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


# Issue 51: what the commands write, which folder a name means, and the notes on
# prompts, pictures and adapters the model was not trained for

NANO_SCENE = ROOT / "book" / "figures" / "nano_scene.png"


def notes(result: Run) -> list:
    return [line for line in result.err.splitlines() if line.startswith("note:")]


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--model", "nano", "--out", "{assets}/nano"],
        ["train", "--model", "nano", "--lora", "--out", "{assets}/receipts"],
        ["train", "--config", "tiny", "--out", "{link}/new-run"],  # a link into it
        ["generate", "--prompt", "detect circle", "--draw", "{assets}/{picture}"],
    ],
)
def test_nothing_is_written_among_the_shipped_files(run, tmp_path, command):
    """§1, §2: --out and --draw refuse every path among the package's assets, also
    through a symbolic link, before anything is read or written"""
    from paligemma_lib.cli.out_folders import ASSETS

    (tmp_path / "link").symlink_to(ASSETS)
    before = {f: f.read_bytes() for f in ASSETS.rglob("*") if f.is_file()}
    picture = "real/example-clothing.png"
    args = [
        str(a).format(assets=ASSETS, link=tmp_path / "link", picture=picture)
        for a in command
    ]
    if command[0] == "generate":
        args += ["--image", NANO_SCENE]
    if command[0] == "train":
        args += ["--steps", "1", "--batch-size", "2", "--eval-size", "1",
                 "--no-progress"]  # fmt: skip
    try:
        result = run(*args)
        after = {f for f in ASSETS.rglob("*") if f.is_file()}
    finally:  # what a command wrote into the package, put back
        for file, data in before.items():
            if file.read_bytes() != data:
                file.write_bytes(data)
        for file in {f for f in ASSETS.rglob("*") if f.is_file()} - set(before):
            file.unlink()
        shutil.rmtree(ASSETS / "nano" / "checkpoints", ignore_errors=True)
        shutil.rmtree(ASSETS / "receipts" / "checkpoints", ignore_errors=True)
        shutil.rmtree(ASSETS / "new-run", ignore_errors=True)
    flag = "--out" if command[0] == "train" else "--draw"
    one_error_line(result, flag, "inside the files shipped with the package")
    assert after == set(before)


def tiny_train(run, out, *extra) -> Run:
    sizes = ["--steps", "1", "--batch-size", "2", "--eval-size", "1"]
    return run("train", "--config", "tiny", "--out", out, *sizes, "--no-progress",
               *extra)  # fmt: skip


def test_an_out_that_holds_a_run_needs_resume_or_overwrite(run, tmp_path):
    """§3: a second run into a run's folder is refused, naming --resume and
    --overwrite; --overwrite starts over, removing that run's files only"""
    out = tmp_path / "run"
    assert tiny_train(run, out).code == 0
    one_error_line(tiny_train(run, out), f"--out {out} holds the checkpoints",
                   "add --resume to continue it", "--overwrite")  # fmt: skip
    shutil.rmtree(out / "checkpoints")  # the model and its record kept, as shipped
    config = (out / "config.json").read_bytes()
    line = one_error_line(tiny_train(run, out),
                          f"--out {out} holds the training_record.json",
                          "add --overwrite to start over")  # fmt: skip
    assert "--resume" not in line  # nothing to resume from: not offered
    assert (out / "config.json").read_bytes() == config
    one_error_line(tiny_train(run, out, "--resume", "--overwrite"), "give one")
    (out / "checkpoints" / "step-0000099").mkdir(parents=True)  # an older run's
    (out / "notes.txt").write_text("mine")
    result = tiny_train(run, out, "--overwrite")
    assert result.code == 0, result
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000001"]
    assert (out / "notes.txt").read_text() == "mine"
    record = json.loads((out / "training_record.json").read_text())
    assert record["command"].endswith("--overwrite")
    from paligemma_lib.cli.main import build_parser

    train = build_parser("train")._subparsers._group_actions[0].choices["train"]
    help_text = " ".join(train.format_help().split())
    assert "--overwrite start over in an --out that holds a run" in help_text


def test_resuming_a_lora_run_without_lora_says_so(run, tmp_path):
    "The trial of issue 51: not 'the checkpoint has no config.json'"
    out = tmp_path / "lora-run"
    sizes = ["--steps", "1", "--batch-size", "2", "--eval-size", "1", "--no-progress"]
    result = run("train", "--model", "nano", "--lora", "--out", out, *sizes)
    assert result.code == 0, result
    sizes[1] = "2"
    one_error_line(run("train", "--model", "nano", "--out", out, "--resume", *sizes),
                   "holds a LoRA run's checkpoints; give the --lora flags")  # fmt: skip


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_an_out_that_cannot_be_written_is_refused_before_training(
    run, tmp_path, monkeypatch, where
):
    "§4: the folder is written to before the first step, not after the last"
    import paligemma_lib.training_run

    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(paligemma_lib.training_run, "run_training", no_training)
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run" if where == "under-a-file" else Path("/proc/run")
    if where == "proc" and not Path("/proc/self").exists():
        pytest.skip("no /proc here")
    one_error_line(tiny_train(run, out), f"--out {out} cannot be written",
                   "give a folder you can write to")  # fmt: skip


def adapter_copy(folder: Path, record: dict | None) -> Path:
    "The shipped receipts adapter's files in `folder`, with `record` as its record"
    shutil.copytree(shipped_adapter_path("receipts"), folder)
    (folder / "training_record.json").unlink()
    if record is not None:
        (folder / "training_record.json").write_text(json.dumps(record))
    return folder


def test_a_folder_named_nano_here_is_not_the_default_model(run, tmp_path, monkeypatch):
    """§5: after `train --model nano --lora --out nano`, the commands run there still
    use the shipped nano (one note says so); the folder is ./nano, and what is said
    of it is true of its files"""
    scene = ["--image", NANO_SCENE, "--prompt", "caption en"]
    expected = run("generate", *scene)
    monkeypatch.chdir(tmp_path)
    adapter_copy(Path("nano"), {"fine-tuned from": "nano", "worlds": {"shapes": 1}})
    result = run("generate", *scene)
    assert (result.code, result.out) == (0, expected.out), result
    assert notes(result) == [  # true of the folder: an adapter, and how to give it
        "note: nano means the shipped model; the folder nano here is a LoRA adapter: "
        "give it as --adapter ./nano"
    ]
    line = one_error_line(run("generate", "--model", "./nano", *scene))
    assert line == (
        "error: --model ./nano is a LoRA adapter, not a model: give it as --adapter "
        "./nano, with --model nano, the model it was trained on (its "
        "training_record.json ('fine-tuned from') names it)"
    )
    adapter_copy(Path("peft-made"), None)  # base_model_name_or_path: null
    line = one_error_line(run("generate", "--model", "peft-made", *scene))
    assert "(its files do not name it)" in line and "names it" not in line
    result = run("generate", "--adapter", "./nano", *scene)  # nano's adapter
    assert result.code == 0 and not notes(result)  # given as it should be: no note


@pytest.mark.parametrize("command", ["generate", "evaluate"])
def test_an_adapter_on_another_model_is_refused(run, tmp_path, command):
    """§6: an adapter whose record names its model is refused on another; a copy
    of that model (the same weights) is accepted"""
    args = ["--image", NANO_SCENE, "--prompt", "extract json"]
    if command == "evaluate":
        args = ["--world", "receipts", "--limit", "1", "--max-new-tokens", "2"]
    result = run(command, "--model", "nano-real", "--adapter", "receipts", *args)
    one_error_line(result, "--adapter receipts was trained on the model nano",
                   "training_record.json", "--model nano-real is another model",
                   "give --model nano")  # fmt: skip
    shutil.copytree(shipped_model_path("nano"), tmp_path / "my-nano")
    quiet = ["--no-progress"] if command == "evaluate" else []
    result = run(command, "--model", tmp_path / "my-nano", "--adapter", "receipts",
                 *args, *quiet)  # fmt: skip
    assert result.code == 0, result


@pytest.mark.parametrize("flag", ["--adapter", "--segment-adapter"])
def test_the_demo_refuses_an_adapter_of_another_model_before_serving(run, flag):
    "§6 for the demo too: the same check, before Gradio is imported or a port bound"
    adapter = "receipts" if flag == "--adapter" else "segment"
    result = run("demo", "--model", "nano-real", flag, adapter, "--port", "7999")
    one_error_line(result, f"{flag} {adapter} was trained on the model nano",
                   "--model nano-real is another model")  # fmt: skip


def test_adapter_none_is_no_adapter_for_generate_too(run, scripted):
    "§7: `--adapter none` means no adapter, for generate as for demo"
    args = ["generate", "--model", scripted["model"], "--image", scripted["image"],
            "--prompt", "caption en", "--max-new-tokens", "3"]  # fmt: skip
    without = run(*args)
    assert without.code == 0, without
    assert run(*args, "--adapter", "none") == without


@pytest.mark.parametrize(
    "prompt, known",
    [
        ("classify shapes", "'caption en', 'answer en how many shapes are there?'"),
        ("detect dog", "'detect circle', 'detect square', 'detect triangle'"),
    ],
)
def test_a_prompt_the_model_was_not_trained_on_gets_a_note(
    run, tmp_path, prompt, known
):
    "§8: one line names the prompt and those of its kind the records list"
    draw = ["--draw", tmp_path / "boxes.png"] if prompt.startswith("detect") else []
    result = run("generate", "--image", NANO_SCENE, "--prompt", prompt, *draw)
    assert result.code == 0, result
    [note] = notes(result)
    assert note.startswith(
        f"note: nano was not trained on the prompt {prompt!r}, so the answer may "
        "mean nothing; its training records' prompts include"
    )
    assert known in note
    trained = run("generate", "--image", NANO_SCENE, "--prompt", "detect circle")
    assert trained.code == 0 and notes(trained) == []


def test_a_prompt_with_other_spaces_is_asked_as_trained(run):
    "§8: the tokenizer reads spaces; the trained form is asked, and a note says so"
    trained = run("generate", "--image", NANO_SCENE, "--prompt", "caption en")
    result = run("generate", "--image", NANO_SCENE, "--prompt", "  caption  en ")
    assert (result.code, result.out) == (0, trained.out), result
    assert notes(result) == [
        "note: asked 'caption en', the prompt nano was trained on, for '  caption  "
        "en ' (its spaces differ, and the tokenizer reads every space)"
    ]


def test_a_prompt_that_is_not_utf8_is_refused(run, scripted):
    "§9: bytes that are not UTF-8 (as Python passes them on: escaped) are refused"
    prompt = os.fsdecode(b"caption en \xff\xfe")
    result = run("generate", "--model", scripted["model"], "--image",
                 scripted["image"], "--prompt", prompt)  # fmt: skip
    one_error_line(result, "--prompt is not valid UTF-8 text (byte 0xff at "
                   "character 11)")  # fmt: skip


@pytest.mark.parametrize("alpha, noted", [(0, True), (255, False)])
def test_a_fully_transparent_picture_gets_a_note(run, scripted, tmp_path, alpha, noted):
    "§10: every pixel transparent: the model sees white, and a note says so"
    picture = tmp_path / "picture.png"
    Image.new("RGBA", (64, 64), (200, 30, 30, alpha)).save(picture)
    result = run("generate", "--model", scripted["model"], "--image", picture,
                 "--prompt", "caption en", "--max-new-tokens", "2")  # fmt: skip
    assert result.code == 0, result
    transparent = [n for n in notes(result) if "fully transparent" in n]
    assert transparent == noted * [
        f"note: every pixel of {picture} is fully transparent, so the model sees a "
        "plain white picture"
    ]


def test_a_size_beyond_the_split_names_its_flag(run):
    "§12: evaluate --limit (and train's sizes) beyond a split's seeds"
    one_error_line(run("evaluate", "--world", "shapes", "--limit", "100000000"),
                   "--limit 100000000: the validation split has 10,000 seeds",
                   "give --limit 10000 or less")  # fmt: skip


@pytest.mark.parametrize("page", ["README.md", "book/a1_using_the_library.md"])
def test_the_readme_draws_outside_the_repository(page):
    "§18: the README's and A.1's --draw write where none is taken for a project file"
    text = (ROOT / page).read_text()
    drawn = re.findall(r"--draw (\S+)", text)
    assert drawn or page == "README.md", f"{page} shows --draw"
    for path in drawn:
        assert Path(path).is_absolute() and not Path(path).is_relative_to(ROOT), path


@pytest.mark.parametrize("host", ["::", "::1"])
def test_the_demo_refuses_an_ipv6_host_before_serving(run, host):
    "Gradio's server cannot be told an IPv6 address: one error line, nothing served"
    one_error_line(run("demo", "--host", host, "--port", "7998"),
                   f"--host {host}: the demo's server takes an IPv4 address",
                   "0.0.0.0 for every interface")  # fmt: skip


def test_draw_into_a_folder_says_it_is_a_folder(run, tmp_path):
    "The trial of issue 51: not 'no extension is not an image format'"
    (tmp_path / "pictures").mkdir()
    args = ["--image", NANO_SCENE, "--prompt", "detect circle"]
    line = one_error_line(run("generate", *args, "--draw", tmp_path / "pictures"),
                          "is a folder; give a file name")  # fmt: skip
    assert "extension" not in line


@pytest.mark.parametrize("model", [["--model", "nano", "--lora"], ["--config", "nano"]])
def test_train_data_refuses_a_line_longer_than_the_models_positions(
    run, tmp_path, model
):
    "A 2,000-character answer makes 2,204 of nano's 512 positions: refused"
    from paligemma_lib.data import SyntheticDataset
    from paligemma_lib.finetune import write_jsonl

    image, prompt, _ = SyntheticDataset({"receipts": 1}, "train", size=1)[0]
    write_jsonl([(image, prompt, "x" * 2000)], tmp_path / "mine")
    result = run("train", *model, "--data", tmp_path / "mine", "--steps", "1",
                 "--out", tmp_path / "out", "--no-progress")  # fmt: skip
    one_error_line(result, "line 1: 2204 tokens, 1692 over the model's 512 positions",
                   "196 image tokens")  # fmt: skip
