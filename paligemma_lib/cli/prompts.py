# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""The prompts a model was trained on, read from its training records, and the
notes when one asked is not among them; the checks of --prompt and of the picture."""

import sys

from ..model_files import read_json, resolve_model_path
from .options import WORLDS, import_data


def taught_worlds(model, adapter=None) -> set | None:
    """The worlds the model (and adapter) were trained on, by their training
    records; None when a record is missing (real PaliGemma has none)"""
    from ..adapters import resolve_adapter_path

    folders = [resolve_model_path(model)]
    if adapter is not None:
        folders.append(resolve_adapter_path(adapter))
    worlds = set()
    for folder in folders:
        record = read_json(folder / "training_record.json", missing_ok=True)
        if not isinstance(record.get("worlds"), dict):
            return None
        worlds |= set(record["worlds"])
    return worlds


def check_segment_taught(args) -> None:
    """Refuse `segment` where the training records show the model (and its
    adapter) never learned it: the answer would hold no mask, yet be drawn or
    graded as one"""
    taught = taught_worlds(args.model, args.adapter)
    if taught is None or "segments" in taught:
        return
    adapter = f" with adapter {args.adapter}" if args.adapter is not None else ""
    raise ValueError(
        f"{args.model}{adapter} was not taught `segment` (its training records "
        f"list {', '.join(sorted(taught))}), so it answers no masks; add "
        "--adapter segment, the shipped adapter that teaches it (chapter 12.1), "
        "or an adapter trained on the segments world"
    )


def world_prompts(world: str) -> dict:
    """The prompts the examples of `world` ask (chapters 11, 12.1 and 12.2), by
    task: the tasks' templates, filled with the kinds of things it draws"""
    from ..data import KINDS, PROMPTS, TASKS

    if world not in TASKS:  # a world of chapter 12.1 or 12.2, added on import
        import_data()
    kinds, templates = KINDS, dict(PROMPTS)
    if world == "clothing":
        from ..real_images import COUNT_PROMPT, ITEMS

        kinds, templates["count"] = ITEMS, COUNT_PROMPT
    return {
        task: [templates[task].format(kind=kind) for kind in kinds]
        for task in TASKS[world]
    }


def taught_prompts(model, adapter=None) -> dict | None:
    """The prompts the model (and adapter) were trained on, by task, from the
    worlds of their training records; None when a record lists no worlds"""
    worlds = taught_worlds(model, adapter)
    if worlds is None:
        return None
    taught = {}
    for world in sorted(worlds & set(WORLDS)):
        for task, prompts in world_prompts(world).items():
            taught[task] = sorted({*taught.get(task, []), *prompts})
    return taught


def prompt_as_taught(args) -> str:
    """--prompt as the model is asked it: with the spaces of a prompt it was
    trained on when it differs from one only in spaces (the tokenizer reads
    every space), said in one line; one line, too, when the training records
    list no such prompt"""
    taught = taught_prompts(args.model, args.adapter)
    prompt = args.prompt
    every = {p for prompts in (taught or {}).values() for p in prompts}
    if taught is None or prompt in every:
        return prompt
    model = args.model + (f" with adapter {args.adapter}" if args.adapter else "")
    spaced = " ".join(prompt.split())
    if spaced in every:
        print(
            f"note: asked {spaced!r}, the prompt {model} was trained on, for "
            f"{prompt!r} (its spaces differ, and the tokenizer reads every space)",
            file=sys.stderr,
        )
        return spaced
    alike = sorted(p for p in every if p.split()[0] == spaced.split()[0])
    if not alike:  # one of each task's
        alike = [prompts[0] for prompts in taught.values()]
    shown = ", ".join(repr(p) for p in alike[:12]) + (", ..." if alike[12:] else "")
    print(
        f"note: {model} was not trained on the prompt {prompt!r}, so the answer "
        f"may mean nothing; its training records' prompts include {shown}",
        file=sys.stderr,
    )
    return prompt


def check_prompt_text(prompt: str) -> None:
    "--prompt as text: bytes that are not UTF-8 are refused, not tokenised"
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(prompt[e.start]) - 0xDC00  # os.fsdecode's escape of a byte
        what = f"byte 0x{byte:02x}" if 0x80 <= byte <= 0xFF else "a character"
        raise ValueError(
            f"--prompt is not valid UTF-8 text ({what} at character {e.start}); "
            "give the prompt as UTF-8 text (check the terminal's encoding)"
        ) from None


def fully_transparent(path) -> bool:
    "Whether every pixel of the image file is fully transparent (alpha 0)"
    from PIL import Image

    with Image.open(path) as image:
        if "A" not in image.getbands() and "transparency" not in image.info:
            return False
        return image.convert("RGBA").getchannel("A").getextrema()[1] == 0
