# Hand-written CLI wiring, not exported from a notebook: it parses, then calls the lib.
"""`python -m paligemma_lib evaluate`: a model's (and adapter's) metrics on a world's
split (chapter 11.3), optionally added to its training record."""

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from ..adapters import resolve_adapter_path
from ..model_files import resolve_model_path
from ..processing import PaliGemmaProcessor
from ..weights import load_pretrained, resolve_device
from .adapter_checks import adapter_folder, check_adapter_base
from .options import (
    DEFAULT_MAX_NEW_TOKENS,
    DEVICE_HELP,
    WORLDS,
    add_model_arguments,
    add_quantize_argument,
    at_least,
    check_device,
    check_model,
    check_quantize,
    check_split_size,
    command_parser,
    import_data,
    warning_note,
    with_adapter,
)
from .out_folders import shipped
from .prompts import check_segment_taught


def add_evaluate_parser(commands) -> None:
    ev = command_parser(
        commands,
        "evaluate",
        "the metrics table of a model on a world (segments: mask mIoU and two "
        "baselines, chapter 12.1)",
    )
    add_model_arguments(ev)
    ev.add_argument(
        "--world",
        required=True,
        choices=WORLDS,
        help="the synthetic world whose examples are asked (chapter 11)",
    )
    ev.add_argument(
        "--split",
        default="validation",
        choices=("train", "validation", "test"),
        help="which seeds (default: validation, where choices are made); test "
        "was never trained on: grade it once, after choosing, with --start past "
        "every earlier grade",
    )
    ev.add_argument(
        "--start",
        type=int,
        default=0,
        help="the split's first index evaluated (default: 0)",
    )
    ev.add_argument("--limit", type=int, default=200, help="examples to evaluate")
    ev.add_argument("--batch-size", type=int, default=16, help="examples at a time")
    ev.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="the longest answer generated",
    )
    ev.add_argument("--device", default="auto", help=DEVICE_HELP)
    add_quantize_argument(ev)
    ev.add_argument(
        "--record",
        action="store_true",
        help="also write the metrics into the training_record.json of the folder "
        "evaluated: --adapter's, else --model's (under 'evaluations', with this "
        "command); not into a shipped one, which the commands only read",
    )
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")


def evaluate_command(args: argparse.Namespace, argv) -> int:
    from ..evaluation import compute_metrics, format_metrics, predict
    from ..generation import TruncatedAnswerWarning

    at_least(args, limit=1, batch_size=1, max_new_tokens=1)
    check_split_size("--limit", args.limit, args.split)
    check_split_size("--start", args.start, args.split)
    if args.start < 0 or args.start + args.limit > len(data_splits()[args.split]):
        raise ValueError(
            f"--start {args.start} --limit {args.limit}: the {args.split} split's "
            f"indices run from 0 to {len(data_splits()[args.split]) - 1:,}; give a "
            "--start of 0 or more and a window within them"
        )
    check_device(args.device)
    check_model(args.model, used=[args.adapter])
    check_quantize(args)
    if args.adapter is not None:
        adapter_folder(args.adapter)
        check_adapter_base(args.model, args.adapter)
    if args.record:
        record_path(args)  # before the slow part
    if args.world == "segments":
        check_segment_taught(args)
    processor = PaliGemmaProcessor.from_pretrained(args.model)
    data = import_data()
    device = resolve_device(args.device)
    model = load_pretrained(args.model, device=device, quantize=args.quantize)
    model = with_adapter(model, args, device)
    dataset = data.SyntheticDataset(
        worlds={args.world: 1.0}, split=args.split, size=args.limit, start=args.start
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TruncatedAnswerWarning)
        rows = predict(
            model,
            processor,
            dataset,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            progress=not args.no_progress,
            warn_truncated=True,
        )
    for warning in caught:
        if issubclass(warning.category, TruncatedAnswerWarning):
            print(
                f"note: answers stopped at --max-new-tokens {args.max_new_tokens} "
                "before their end (<eos>) are graded as they stand, cut short; "
                "raise --max-new-tokens",
                file=sys.stderr,
            )
        else:
            warning_note(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    metrics = compute_metrics(rows)
    if args.world == "segments":  # masks against the scenes' exact masks
        from ..segment_eval import segment_metrics

        examples = [dataset.example(i) for i in range(len(rows))]
        predictions = [row["prediction"] for row in rows]
        metrics["segment"] |= segment_metrics(examples, predictions)
    adapter = f" with adapter {args.adapter}" if args.adapter is not None else ""
    where = f"{args.split}, {len(rows)} examples"
    if args.start:
        where += f" from index {args.start}"
    print(f"{args.model}{adapter} on {args.world} ({where})")
    print(format_metrics(metrics))
    if args.record:
        where = add_evaluation(args, argv, len(rows), metrics)
        print(f"metrics added to {where}")
    return 0


def data_splits() -> dict:
    from ..data import SPLITS

    return SPLITS


def record_path(args) -> Path:
    """The training record --record adds to: the adapter's when there is one (the
    folder `train --lora` wrote), else the model's; never a shipped one"""
    flag, name = "--model", args.model
    folder = resolve_model_path(name)
    if args.adapter is not None:
        flag, name = "--adapter", args.adapter
        folder = resolve_adapter_path(name)
    record_file = folder / "training_record.json"
    if shipped(record_file):
        raise ValueError(
            f"--record: {flag} {name} is shipped with the package, and the commands "
            f"never change its files ({record_file}); copy the folder (cp -r "
            f"{folder} my-{folder.name}) and give {flag} my-{folder.name} --record"
        )
    if not record_file.is_file():
        raise FileNotFoundError(
            f"--record: {record_file} does not exist; --record adds to the record "
            f"that `train` writes into its output folder"
        )
    return record_file


def add_evaluation(args, argv, examples: int, metrics: dict) -> Path:
    "Add this evaluation to the model folder's training record, atomically"
    record_file = record_path(args)
    record = json.loads(record_file.read_text())
    command = " ".join(["python -m paligemma_lib", *map(str, argv)])
    evaluations = record.setdefault("evaluations", {})
    key = f"{args.world}/{args.split}"
    if args.start:  # another window of the split: a key of its own
        key += f" {args.start}-{args.start + examples - 1}"
    evaluations[key] = {
        "command": command,
        "indices": [args.start, args.start + examples - 1],
        "examples": examples,
        "metrics": metrics,
    }
    partial = record_file.with_name(f".{record_file.name}.partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(partial, record_file)
    return record_file
