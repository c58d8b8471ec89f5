# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""Where the commands write: never among the package's shipped files, never over a
run without --resume or --overwrite, and only where they can."""

import shutil
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # the shipped files


def shipped(folder) -> bool:
    "Whether `folder` is one the package ships (a model or an adapter)"
    return Path(folder).resolve().is_relative_to(ASSETS)


def refuse_shipped(path, flag: str) -> None:
    """Refuse a path a command would write when it lies among the package's
    shipped files (paligemma_lib/assets, symbolic links followed): the commands
    only read those"""
    if shipped(path):
        raise ValueError(
            f"{flag} {path} is inside the files shipped with the package "
            f"({ASSETS}), which the commands never change; give a path outside it"
        )


# what a run writes into --out: a model (save_pretrained) or an adapter
# (save_adapter), its record, its checkpoints; --overwrite removes these only
RUN_FILES = (
    "training_record.json",
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "preprocessor_config.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "adapter_config.json",
    "adapter_model.safetensors",
)


def check_out_folder(
    out: Path, resume: bool, overwrite: bool = False, lora: bool = True
) -> Path:
    """--out: a folder outside the shipped files, holding a run's checkpoints
    exactly when --resume is given, and a run's files only with --resume or
    --overwrite"""
    from ..resume import CHECKPOINTS, latest_checkpoint

    refuse_shipped(out, "--out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if resume and overwrite:
        raise ValueError(
            "--resume continues the run in --out, --overwrite starts it over: "
            "give one of the two"
        )
    if resume and latest_checkpoint(out) is None:
        raise ValueError(f"--resume: {out} holds no checkpoint to continue from")
    held = [name for name in (*RUN_FILES, CHECKPOINTS) if (out / name).exists()]
    if held and not (resume or overwrite):
        what = "the checkpoints" if CHECKPOINTS in held else f"the {held[0]}"
        # --resume continues from a checkpoint; a finished model alone has none
        go_on = (
            "add --resume to continue it, "
            if latest_checkpoint(out) is not None
            else ""
        )
        raise ValueError(
            f"--out {out} holds {what} of a run: {go_on}add --overwrite to start "
            "over there (its model, record and checkpoints are removed), or choose "
            "another folder"
        )
    adapter_run = latest_checkpoint(out) is not None and (
        (latest_checkpoint(out) / "adapter_config.json").is_file()
    )
    if resume and adapter_run and not lora:
        raise ValueError(
            f"--resume: {out} holds a LoRA run's checkpoints; give the --lora flags "
            "it was started with"
        )
    return out


def check_writable(out: Path, flag: str = "--out") -> None:
    "Create --out if needed and write a file there, before any training step"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(
            f"{flag} {out} cannot be written ({e.strerror or e}); give a folder "
            "you can write to"
        ) from None


def start_over(out: Path) -> None:
    "--overwrite: remove the files and checkpoints an earlier run wrote in --out"
    from ..resume import CHECKPOINTS

    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    names = [*RUN_FILES, *(f.name for f in out.glob("model-*.safetensors"))]
    for name in names:
        (out / name).unlink(missing_ok=True)
