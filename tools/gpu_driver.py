# Hand-written, not exported from a notebook.
"""The driver that tools/train_nano_gpu.py and tools/train_receipts_gpu.py share: launch
runs of `python -m paligemma_lib train` side by side, measure their steps per second,
evaluate, and choose.

The rule (issue 22 section 1): every choice, the learning rate, the LoRA targets, the
run to ship, is made on the VALIDATION split. `choose` asks `evaluate` for the
validation split only, and `Driver.evaluate` grades no other split: test is graded
once, on the dev machine, on a range the ledger has never seen (tools/ship_rules.py).
"""

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SELECTION_SPLIT = "validation"  # the only split a choice may read


def compile_flags(env) -> list[str]:
    """GPU_TRAIN_COMPILE=1: the GPU parts train with `train --compile` (chapter 11.2),
    once the `profile` part has shown that it pays; unset or 0: eagerly, as the
    shipped models trained"""
    value = env.get("GPU_TRAIN_COMPILE", "0")
    if value not in ("0", "1"):
        raise ValueError(f"GPU_TRAIN_COMPILE={value}: use 1 (compile) or 0 (eager)")
    return ["--compile"] if value == "1" else []


class Driver:
    "One tool's launcher, log and output folder"

    def __init__(self, out: Path, work: Path, base: list[str]):
        # base: the train flags every run shares (model or config, batch, worlds, ...)
        self.out, self.work, self.base = out, work, base
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "log.txt", "w")
        self.begin = time.time()

    def say(self, *words):
        line = " ".join(str(w) for w in words)
        print(line, flush=True)
        print(line, file=self.log, flush=True)

    def train(self, steps: int, extra: list[str], folder: Path, pipe: bool = False):
        command = [
            sys.executable, "-m", "paligemma_lib", "train", *self.base,
            "--out", str(folder), "--steps", str(steps), "--no-progress", *extra,
        ]  # fmt: skip
        self.say("$", " ".join(command[1:]))
        return subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE if pipe else self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def calibrate(
        self,
        runs: dict,
        budget: float,
        reserve: float,
        probe: int = 90,
        floor: int = 100,
        eval_size: int = 16,
    ) -> int | None:
        """Run every configuration `probe` steps side by side (discarded); the time
        between the first run's evaluations at steps probe/3 and probe gives the
        rate. The step count that fits what is left of `budget` less `reserve`, a
        multiple of `floor` and at least `floor` (None if calibration fails, or
        has not finished when only `reserve` is left of `budget`)"""
        stamps, procs, marks = {}, [], (f"step {probe // 3}:", f"step {probe}:")
        for i, (name, extra) in enumerate(runs.items()):
            small = [*extra, "--eval-size", str(eval_size)]
            small += ["--eval-every", str(probe // 3)]
            folder = self.work / f"cal-{name}"  # discarded: an earlier probe's too,
            shutil.rmtree(folder, ignore_errors=True)  # which train would refuse
            procs.append(self.train(probe, small, folder, i == 0))
        # the budget's end less the reserve: the probes are killed there, so a run
        # that hangs or prints nothing cannot hold the part past its budget
        deadline = self.begin + budget - reserve
        timer = threading.Timer(
            max(0.0, deadline - time.time()), lambda: [p.kill() for p in procs]
        )
        timer.start()
        try:
            for line in procs[0].stdout:
                self.log.write(line)
                if line.startswith(marks):
                    stamps[line.split(":")[0]] = time.time()
            codes = [p.wait() for p in procs]
        finally:
            timer.cancel()
        if any(codes) or len(stamps) != 2:
            late = " (killed at the budget's end)" if time.time() >= deadline else ""
            self.say(f"calibration failed{late}; see the log")
            return None
        per_step = (stamps[marks[1][:-1]] - stamps[marks[0][:-1]]) / (
            probe - probe // 3
        )
        left = budget - (time.time() - self.begin) - reserve
        # 0.7: the runs' start (a model, its workers) and the slower of them
        steps = max(floor, int(left / per_step * 0.7) // floor * floor)
        self.say(
            f"calibration: {per_step:.3f} s a step ({len(runs)} runs); {steps} fit"
        )
        return steps

    def run_all(
        self, runs: dict, steps: int, extra: list[str], timeout: float | None = None
    ) -> list[str]:
        """Train every run side by side; the names of those that finished (within
        `timeout` seconds, if given: a run still going then is killed)"""
        procs = {
            n: self.train(steps, [*e, *extra], self.work / n) for n, e in runs.items()
        }
        end = None if timeout is None else time.time() + timeout
        codes = {}
        for n, p in procs.items():
            try:
                codes[n] = p.wait(None if end is None else max(1, end - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                codes[n] = f"killed after {timeout:.0f} s"
        self.say("training exit codes:", codes, f"({time.time() - self.begin:.0f} s)")
        return [n for n, code in codes.items() if code == 0]

    def evaluate(
        self, folder, world: str, split: str, limit: int, adapter=None
    ) -> dict:
        """The metrics {task: {metric: value}} of the model in `folder` (plus the LoRA
        `adapter` folder, if any) on the first `limit` examples of `split`, greedy,
        64 new tokens at most (a receipt's JSON is about 35), as `evaluate` grades"""
        from paligemma_lib import PaliGemmaProcessor, load_pretrained
        from paligemma_lib.adapters import load_adapter
        from paligemma_lib.data import SyntheticDataset
        from paligemma_lib.devices import pick_device
        from paligemma_lib.evaluation import compute_metrics, predict

        if split != SELECTION_SPLIT:  # test is the ledger's, graded on the dev machine
            raise ValueError(
                f"the GPU tools grade {SELECTION_SPLIT} only, not {split!r}: test is "
                "graded once, from the ledger's fresh range (tools/evaluate_fresh.py)"
            )
        device, _ = pick_device()  # float32 weights: the grade, not the speed, counts
        model = load_pretrained(folder, device=device).eval()
        if adapter is not None:
            load_adapter(model, adapter)
            model.to(device)
        processor = PaliGemmaProcessor.from_pretrained(folder)
        dataset = SyntheticDataset(world, split, size=limit)
        rows = predict(model, processor, dataset, batch_size=64, max_new_tokens=64)
        metrics = compute_metrics(rows)
        self.say(f"{folder} {adapter or ''} on {world} {split} ({limit}):", metrics)
        return metrics


def choose(names: list[str], evaluate, score) -> tuple[str, dict]:
    """The run to ship: the best `score(metrics)` of `evaluate(name, split)` over
    `names`, where split is always SELECTION_SPLIT. Returns the name and every run's
    validation metrics. `evaluate` is never asked for another split."""
    if not names:
        raise ValueError("no run finished: nothing to choose from")
    metrics = {name: evaluate(name, SELECTION_SPLIT) for name in names}
    best = max(names, key=lambda name: score(metrics[name]))
    return best, metrics
