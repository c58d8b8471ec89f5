# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""--adapter's checks: the folder it names, the model it was trained on, and the
note when a folder here has a shipped name."""

import sys
from pathlib import Path

from ..adapters import SHIPPED_ADAPTERS
from ..model_files import read_json, resolve_model_path


def note_shadowed(name, shipped_names, flag: str, what: str, used=()) -> None:
    """One line when `name` is a shipped name and a folder here has it too: the
    shipped one is used, and the line says what the folder is and how to give
    it; nothing when the command gives that folder already (in `used`)"""
    if not (isinstance(name, str) and name in shipped_names and Path(name).is_dir()):
        return
    here = Path(name).resolve()
    if any(u is not None and Path(u).resolve() == here for u in used):
        return
    if (here / "adapter_config.json").is_file():
        kind = f"a LoRA adapter: give it as --adapter ./{name}"
    elif (here / "config.json").is_file():
        kind = f"a model: give it as {flag} ./{name}"
    else:
        kind = f"no {what} (no config.json)"
    print(
        f"note: {name} means the shipped {what}; the folder {name} here is {kind}",
        file=sys.stderr,
    )


def base_source(adapter: Path) -> str:
    "Which file of an adapter folder names its base model"
    if read_json(adapter / "training_record.json", missing_ok=True).get(
        "fine-tuned from"
    ):
        return "training_record.json ('fine-tuned from')"
    return "adapter_config.json (base_model_name_or_path)"


def adapter_base(adapter: Path) -> str | None:
    """The model an adapter folder was trained on, as its training record (or
    else its adapter_config.json) names it; None if neither does"""
    from ..adapters import ADAPTER_CONFIG

    record = read_json(adapter / "training_record.json", missing_ok=True)
    base = record.get("fine-tuned from") or read_json(
        adapter / ADAPTER_CONFIG, missing_ok=True
    ).get("base_model_name_or_path")
    return base if isinstance(base, str) and base else None


def same_model(a: Path, b: Path) -> bool:
    "Two checkpoint folders: the same folder, or the same weights' bytes"
    if a.resolve() == b.resolve():
        return True
    weights = [sorted(f.glob("*.safetensors")) for f in (a, b)]
    if [f.name for f in weights[0]] != [f.name for f in weights[1]]:
        return False
    for x, y in zip(*weights):
        if x.stat().st_size != y.stat().st_size:
            return False
    return all(x.read_bytes() == y.read_bytes() for x, y in zip(*weights))


def check_adapter_base(model, adapter, flag: str = "--adapter") -> None:
    """Refuse an adapter whose files name the model it was trained on when
    --model is another: its updates fit that model's weights only. Nothing is
    said where the base is not named, or not found here"""
    from ..adapters import resolve_adapter_path

    folder = resolve_adapter_path(adapter)
    base = adapter_base(folder)
    if base is None:
        return
    try:
        base_folder = resolve_model_path(base)
    except FileNotFoundError:
        return
    if same_model(base_folder, resolve_model_path(model)):
        return
    raise ValueError(
        f"{flag} {adapter} was trained on the model {base} (its "
        f"{base_source(folder)} says so), and --model {model} is another model, "
        f"whose weights its updates were not trained with; give --model {base}, or "
        f"an adapter trained on {model}"
    )


def adapter_folder(name_or_path, flag: str = "--adapter") -> Path:
    """The adapter folder --adapter names, its files checked before any model
    loads"""
    from ..adapters import check_adapter

    note_shadowed(name_or_path, SHIPPED_ADAPTERS, flag, "adapter")
    try:
        folder, _ = check_adapter(name_or_path)
    except (OSError, ValueError) as e:  # the same kind, the flag named first
        raise type(e)(f"{flag} {name_or_path}: {e}") from None
    return folder
