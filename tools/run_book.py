"""Execute every chapter of the book in order on a chosen device, and record the result.

    python tools/run_book.py --device cuda            # every chapter, on the GPU
    python tools/run_book.py --device cpu 01 06       # chapters 01 and 06, GPUs hidden
    python tools/run_book.py --device cuda --parallel 4 08 12  # side by side

Each chapter runs top to bottom in a fresh Jupyter kernel (nbclient), from book/ as the
chapters expect, within --timeout seconds. `--device cpu` hides the GPUs from the
kernels (CUDA_VISIBLE_DEVICES=""), so the chapters take their CPU branch; `--device
cuda` requires a visible CUDA GPU. The JSON (default benchmarks/results/book-DEVICE-
DATE.json) holds the environment (Python, torch, transformers, ..., the device's name)
and, per chapter, whether it passed, the failing cell's id and the error's last line
where it did not, and the seconds it took. The exit status is 1 when a chapter failed.
"""

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [
    "torch",
    "torchvision",
    "transformers",
    "peft",
    "sentencepiece",
    "numpy",
    "pillow",
    "safetensors",
    "gradio",
    "nbclient",
]


def chapters(book: Path, wanted: list[str]) -> list[Path]:
    "The chapters of `book` in order; `wanted` keeps those whose name starts with one"
    found = sorted(book.glob("[0-9][0-9]*_*.ipynb"))
    if not found:
        raise SystemExit(f"no chapters (NN_name.ipynb) in {book}")
    if not wanted:
        return found
    unknown = [w for w in wanted if not any(p.name.startswith(w) for p in found)]
    if unknown:
        names = ", ".join(p.name for p in found)
        raise SystemExit(
            f"no chapter starts with {', '.join(unknown)}; there are {names}"
        )
    return [p for p in found if any(p.name.startswith(w) for w in wanted)]


def environment(device: str) -> dict:
    "What the chapters ran with: versions, the device, the threads"
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name(0)
    else:
        name = cpu_name()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "device_name": name,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "versions": versions,
        "commit": git_commit(),
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() or None


def execute_one(chapter: Path, progress: Path, timeout: float) -> dict:
    """Run `chapter` in a fresh kernel; the cell being run is written to `progress` as
    it starts, so that a caller that kills this process on time-out can name it"""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, DeadKernelError

    nb = nbformat.read(chapter, as_version=4)

    def started(cell, cell_index, **_):
        progress.write_text(cell.get("id", str(cell_index)))

    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(chapter.parent)}},
        on_cell_execute=started,
    )
    try:
        client.execute()
    except (CellExecutionError, DeadKernelError) as e:
        cell_id = progress.read_text() if progress.exists() else None
        for cell in nb.cells:
            if cell.get("id") == cell_id:
                errors = [
                    o for o in cell.get("outputs", []) if o.output_type == "error"
                ]
                if errors:
                    return {
                        "failed_cell": cell_id,
                        "error": f"{errors[0].ename}: {errors[0].evalue}",
                    }
        lines = str(e).strip().splitlines() or [""]
        return {"failed_cell": cell_id, "error": f"{type(e).__name__}: {lines[-1]}"}
    return {"failed_cell": None, "error": None}


def run_chapter(chapter: Path, device: str, timeout: float, env: dict) -> dict:
    "One chapter in a child process, killed with its kernel after `timeout` seconds"
    with tempfile.TemporaryDirectory() as tmp:
        progress, result = Path(tmp) / "cell", Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--execute-one", str(chapter)]
        command += ["--progress", str(progress), "--result", str(result)]
        command += ["--device", device, "--timeout", str(timeout)]
        start = time.perf_counter()
        child = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # the child; its kernel (a session of its own) exits when it sees it gone
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            cell = progress.read_text() if progress.exists() else None
            outcome = {"failed_cell": cell, "error": f"timed out after {timeout:g} s"}
        else:
            if result.exists():
                outcome = json.loads(result.read_text())
            else:
                outcome = {
                    "failed_cell": progress.read_text() if progress.exists() else None,
                    "error": f"the runner exited with status {child.returncode}",
                }
        seconds = time.perf_counter() - start
    return {
        "chapter": chapter.name,
        "passed": outcome["error"] is None,
        **outcome,
        "seconds": round(seconds, 1),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Execute the book's chapters on a device and record the result."
    )
    parser.add_argument(
        "chapters",
        nargs="*",
        help="name prefixes, e.g. 01 11b (default: every chapter)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds per chapter (1800)"
    )
    parser.add_argument(
        "--parallel", type=int, default=1, help="chapters run side by side (1)"
    )
    parser.add_argument("--book", type=Path, default=ROOT / "book")
    parser.add_argument(
        "--output",
        type=Path,
        help="the JSON (benchmarks/results/book-DEVICE-DATE.json)",
    )
    parser.add_argument("--execute-one", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--progress", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout:g}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.execute_one:
        outcome = execute_one(args.execute_one, args.progress, args.timeout)
        args.result.write_text(json.dumps(outcome))
        return 0
    selected = chapters(args.book, args.chapters)
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the kernels see no GPU
    else:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(
                "--device cuda: torch sees no CUDA GPU here (torch "
                f"{torch.__version__}, CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use --device cpu"
            )
    started = datetime.now(UTC)
    output = args.output or (
        ROOT / "benchmarks" / "results" / f"book-{args.device}-{started:%Y%m%d}.json"
    )
    record = {
        "command": " ".join(["python tools/run_book.py", *(argv or sys.argv[1:])]),
        "started": started.isoformat(timespec="seconds"),
        "environment": environment(args.device),
        "timeout_s": args.timeout,
        "chapters": [],
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        rows = [
            pool.submit(run_chapter, chapter, args.device, args.timeout, env)
            for chapter in selected
        ]
        for future in as_completed(rows):
            row = future.result()
            record["chapters"].append(row)
            where = "" if row["passed"] else f" at {row['failed_cell']}: {row['error']}"
            print(
                f"{row['chapter']:<40} {'passed' if row['passed'] else 'FAILED'}"
                f" {row['seconds']:8.1f} s{where}",
                flush=True,
            )
            output.write_text(json.dumps(record, indent=1) + "\n")  # as far as it got
    record["chapters"].sort(key=lambda row: row["chapter"])
    record["passed"] = all(row["passed"] for row in record["chapters"])
    record["seconds"] = round(sum(row["seconds"] for row in record["chapters"]), 1)
    output.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'every chapter passed' if record['passed'] else 'FAILED'}; wrote {output}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
