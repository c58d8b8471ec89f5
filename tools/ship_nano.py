# Hand-written, not exported from a notebook.
"""Ship a trained nano model in the package: copy the model files of a training output
folder into paligemma_lib/assets/nano/, which `load_pretrained("nano")` and
`PaliGemmaProcessor.from_pretrained("nano")` read.

    python tools/ship_nano.py /work/nano-run
    python tools/ship_nano.py /work/real-run nano-real   # chapter 12.2's model

SRC is the --out folder of `python -m paligemma_lib train --config nano ...`; NAME,
a key of model_files.SHIPPED (default nano), the folder under paligemma_lib/assets/.
Exactly the six model files are copied (never checkpoints/, the optimiser states).
The files must total at most 25 MB and load (model and processor) from SRC and again
from the copy; otherwise nothing in the package changes, and the reason is printed on
one line."""

import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the library of this repository, which the model ships in
sys.path.insert(0, str(ROOT))

FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.model",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "training_record.json",
)
RECORD_KEYS = ("command", "device", "steps", "seconds")
LIMIT = 25_000_000  # bytes: 25 MB
DEST = ROOT / "paligemma_lib" / "assets" / "nano"


class Refused(Exception):
    pass


def check_loads(folder: Path) -> str:
    "Load the model and the processor from `folder`; a one-line summary"
    from paligemma_lib.processing import PaliGemmaProcessor
    from paligemma_lib.weights import load_pretrained

    try:
        model = load_pretrained(folder)
        processor = PaliGemmaProcessor.from_pretrained(folder)
    except (ValueError, OSError) as e:
        raise Refused(f"{folder} does not load: {' '.join(str(e).split())}") from None
    params = sum(p.numel() for p in model.parameters())
    return f"{params / 1e6:.1f}M parameters, {processor}"


def check_source(src: Path) -> int:
    "The six files are there, total at most LIMIT, and the record is complete"
    if not src.is_dir():
        raise Refused(f"{src} is not a folder; give the --out folder of a training run")
    missing = [name for name in FILES if not (src / name).is_file()]
    if missing:
        raise Refused(f"{src} has no {', '.join(missing)}; is the training run done?")
    total = sum((src / name).stat().st_size for name in FILES)
    if total > LIMIT:
        raise Refused(
            f"the model files of {src} total {total / 1e6:.1f} MB, over the "
            f"{LIMIT / 1e6:.0f} MB the package may ship; train a smaller model"
        )
    try:
        record = json.loads((src / "training_record.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(f"{src / 'training_record.json'} is not JSON: {e}") from None
    absent = [k for k in RECORD_KEYS if not isinstance(record, dict) or k not in record]
    if absent:
        raise Refused(
            f"{src / 'training_record.json'} lacks {', '.join(absent)}; "
            "ship the record the train command writes"
        )
    return total


def ship(src: Path, dest: Path = DEST) -> str:
    total = check_source(src)
    check_loads(src)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # copy next to the destination, check the copy, then swap it in: a failure leaves
    # the shipped folder as it was
    staging = Path(tempfile.mkdtemp(prefix=".nano-", dir=dest.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the package's folders are not
    old = dest.parent / (staging.name + "-old")
    try:
        for name in FILES:
            shutil.copyfile(src / name, staging / name)
        summary = check_loads(staging)
        if dest.exists():
            dest.rename(old)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    size = f"{len(FILES)} files, {total / 1e6:.1f} MB"
    return f"shipped {src} -> {dest}: {size}, {summary}"


def main(argv=None) -> int:
    from paligemma_lib.model_files import SHIPPED

    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2 or argv[0].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    name = argv[1] if len(argv) == 2 else "nano"
    if name not in SHIPPED:
        print(f"error: {name} is no shipped model's name ({', '.join(SHIPPED)})")
        return 2
    try:
        print(ship(Path(argv[0]), DEST.parent / name))
    except Refused as e:
        print(f"error: refused: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
