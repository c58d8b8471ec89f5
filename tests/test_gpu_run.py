"""tools/gpu_run.py's own logic (issue 38): what a GPU run returns and how it is put in
place. The whole script runs in CI as `tools/gpu_run.py --rehearse` (.ci/run); these
check the pieces that decide what is kept."""

import ast
import inspect
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_real  # noqa: E402
import gpu_run  # noqa: E402


def test_the_parts_fit_nine_minutes_and_eight_files():
    assert list(gpu_run.BUDGETS) == list(gpu_run.PARTS)
    # a call: the install, then the default parts together, or `real` alone
    assert gpu_run.CALL == 9 * 60
    default = sum(gpu_run.BUDGETS[p] for p in gpu_run.DEFAULT_PARTS)
    assert gpu_run.INSTALL + default <= gpu_run.CALL
    for part in gpu_run.ALONE:
        assert gpu_run.INSTALL + gpu_run.BUDGETS[part] <= gpu_run.CALL, part


def test_the_files_of_the_parts_one_call_runs_are_at_most_eight():
    "A plain call (with profile in the rest of it), or each of ALONE in its own"
    assert gpu_run.RETURNED == 8
    assert set(gpu_run.PART_FILES) == set(gpu_run.PARTS)
    calls = [[*gpu_run.DEFAULT_PARTS, "profile"], *([p] for p in gpu_run.ALONE)]
    for parts in calls:
        assert len(gpu_run.call_files(parts)) <= 8, parts
    assert gpu_run.call_groups(list(gpu_run.PARTS)) == [
        [p for p in gpu_run.PARTS if p not in gpu_run.ALONE],
        *([p] for p in gpu_run.ALONE),
    ]
    assert len(set(gpu_run.FILES)) == len(gpu_run.FILES)  # no name shared


def test_a_rehearsal_of_every_part_counts_each_calls_files(tmp_path):
    "Every part in one folder: 11 files, no call's more than 8; a GPU call's are"
    parts = list(gpu_run.PARTS)
    files = [n for n in gpu_run.FILES if not n.endswith(".3") and n != "run.json"]
    record = {p: {} for p in parts} | {"t4": {"receipts recipe": {"metrics": {}}}}
    write_run(tmp_path, record, files)
    assert len(list(tmp_path.iterdir())) > 8
    assert gpu_run.check_output(tmp_path, parts, rehearse=True) == []
    problems = gpu_run.check_output(tmp_path, parts)
    assert any("at most 8 come back" in p for p in problems), problems


def test_a_part_gets_no_more_than_the_call_has_left(tmp_path, monkeypatch):
    "The call's deadline bounds every part's budget; past it, a part is not started"
    given = {}

    def part(name, spend):
        def run_part(run, budget):
            given[name] = budget
            run.deadline -= spend  # as if the part had taken `spend` seconds
            return {}

        return run_part

    monkeypatch.setattr(gpu_run, "REHEARSAL_CALL", 100)
    monkeypatch.setattr(gpu_run, "check_output", lambda out, parts, rehearse=False: [])
    monkeypatch.setattr(
        gpu_run, "PART_FUNCTIONS", {"t4": part("t4", 95), "speed": part("speed", 0)}
    )
    import time

    # a call whose clock started at the module's import, long before (the script's
    # main passes STARTED): the deadline counts from then, less SLACK
    started = time.time() - 50
    gpu_run.run_parts(tmp_path, ["t4", "speed"], rehearse=True, started=started)
    assert given["t4"] <= 100 - 50 - gpu_run.SLACK and "speed" not in given
    record = json.loads((tmp_path / "run.json").read_text())
    assert "not started" in record["parts"]["speed"]["error"]


def test_calibration_ends_at_its_budget_when_a_run_hangs(tmp_path, monkeypatch):
    "A probe that prints nothing and never ends is killed when the budget ends"
    import subprocess

    from gpu_driver import Driver

    def hang(self, steps, extra, folder, pipe=False):
        return subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"],
            stdout=subprocess.PIPE if pipe else subprocess.DEVNULL, text=True,
        )  # fmt: skip

    monkeypatch.setattr(Driver, "train", hang)
    driver = Driver(tmp_path, tmp_path, [])
    # 3 s of budget: the probes are killed then (without the timer the call would
    # wait out the children's sleep, and the log would not say they were killed)
    assert driver.calibrate({"a": [], "b": []}, 4, 1, probe=3, floor=2) is None
    assert "killed at the budget's end" in (tmp_path / "log.txt").read_text()


def test_a_second_calibration_in_the_same_folder_works(tmp_path, monkeypatch):
    """Stage 2 calibrates its run again when the control does not fit: the first
    probe's folder, which `train` refuses to start in, is cleared first"""
    import subprocess

    from gpu_driver import Driver

    def probe(self, steps, extra, folder, pipe=False):
        refused = folder.exists() and any(folder.iterdir())  # as train refuses
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "checkpoint").write_text("a finished probe")
        code = "import sys; sys.exit(1)" if refused else "print('step 1:\\nstep 3:')"
        return subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE if pipe else subprocess.DEVNULL, text=True,
        )  # fmt: skip

    monkeypatch.setattr(Driver, "train", probe)
    driver = Driver(tmp_path, tmp_path, [])
    assert driver.calibrate({"448": []}, 60, 1, probe=3, floor=2) is not None
    assert driver.calibrate({"448": []}, 60, 1, probe=3, floor=2) is not None


def test_bars_are_three_standard_errors_below_and_never_zero():
    metrics = {"examples": 96, "exact match": 0.0, "store accuracy": 0.3125,
               "date accuracy": 1.0}  # fmt: skip
    bars = gpu_run.bars(metrics, 96)
    assert bars["store accuracy"] == round(
        0.3125 - 3 * (0.3125 * 0.6875 / 96) ** 0.5, 3
    )
    # a perfect score counts one miss in n, so its bar sits below 1
    assert bars["date accuracy"] == round(1 - 3 * ((1 - 1 / 96) / 96 / 96) ** 0.5, 3)
    assert "exact match" not in bars  # a bar of 0 would assert nothing


def test_the_bars_go_into_chapter_12s_line(tmp_path):
    chapter = tmp_path / "12.ipynb"
    shutil.copyfile(gpu_run.CHAPTER_12, chapter)
    recipe = {"metrics": {"examples": 96, "store accuracy": 0.5}}
    gpu_run.set_chapter_bars(recipe, "benchmarks/results/x.json", chapter)
    cells = json.loads(chapter.read_text())["cells"]
    [cell] = [c for c in cells if any("GPU_BARS = " in x for x in c["source"])]
    source = "".join(cell["source"])
    ast.parse(source)  # still Python, indentation kept
    line = next(x for x in source.splitlines() if "GPU_BARS = " in x)
    # 0.5 - 3 (0.5 x 0.5 / 96)^0.5 = 0.3469
    assert line.strip() == 'GPU_BARS = {"store accuracy": 0.347}'
    assert "x.json" in source


def write_run(out: Path, parts: dict, files=("book.json", "speed.json")):
    out.mkdir(exist_ok=True)
    record = {"environment": {"commit": "abc"}, "started": "2026-11-26T00:00:00",
              "finished": "2026-11-26T00:09:00", "parts": parts}  # fmt: skip
    (out / "run.json").write_text(json.dumps(record))
    for name in files:
        (out / name).write_text("{}")


def test_check_output_accepts_a_whole_run(tmp_path):
    parts = {"branches": {}, "speed": {}}
    write_run(tmp_path, parts)
    assert gpu_run.check_output(tmp_path, ["branches", "speed"]) == []


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda out: (out / "speed.json").unlink(), "speed wrote no speed.json"),
        (lambda out: (out / "core.dump").write_text(""), "unexpected file core.dump"),
        (
            lambda out: [(out / f"log{i}.txt").write_text("") for i in range(4)],
            "9 files",
        ),
    ],
)
def test_check_output_names_what_would_not_come_back(tmp_path, change, problem):
    write_run(tmp_path, {"branches": {}, "speed": {"error": "x"}})
    (tmp_path / "log.txt").write_text("")
    (tmp_path / "segment-adapter.tar").write_text("")
    change(tmp_path)
    problems = gpu_run.check_output(tmp_path, ["branches", "speed"])
    assert any(problem in p for p in problems), problems
    assert "speed: x" in problems  # a part's error is a problem too


def test_junit_results_read_each_outcome(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase name="a"/>'
        '<testcase name="b"><failure message="assert 1 == 2"/></testcase>'
        '<testcase name="c"><skipped message="needs CUDA"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert gpu_run.junit_results(xml) == {
        "a": "passed", "b": "failure: assert 1 == 2", "c": "skipped: needs CUDA"
    }  # fmt: skip
    assert "error" in gpu_run.junit_results(tmp_path / "none.xml")


def test_ingest_refuses_a_rehearsal(tmp_path):
    write_run(tmp_path, {})
    record = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "run.json").write_text(json.dumps(record | {"rehearsal": True}))
    with pytest.raises(SystemExit, match="rehearsal"):
        gpu_run.ingest(tmp_path)


def test_parts_added_later_keep_the_call_they_came_from(tmp_path, monkeypatch):
    write_run(tmp_path, {"speed": {"decode": 1.0}})
    monkeypatch.setattr(gpu_run, "environment", lambda: {"commit": "new"})
    run = gpu_run.Run(tmp_path, rehearse=True)
    assert run.record["parts"]["speed"] == {
        "commit": "abc", "started": "2026-11-26T00:00:00", "decode": 1.0
    }  # fmt: skip


def test_chapter_12_quotes_the_ingested_run():
    "The numbers chapter 12 quotes from the GPU runs are the records'"
    results = ROOT / "benchmarks" / "results"
    name, fresh = "gpu-run-20261126-1021.json", "t4-3b-lora-fresh-20261126-1031.json"
    recipe = json.loads((results / name).read_text())["parts"]["t4"]["receipts recipe"]
    text = (ROOT / "book" / "12_fine_tuning.ipynb").read_text()
    assert name in text and fresh in text
    records = ROOT / "paligemma_lib" / "assets" / "records"  # what the chapter reads
    for row in json.loads((records / fresh).read_text())["results"][:2]:
        assert f"{row['peak_memory_bytes'] / 2**30:.2f} GiB" in text, row["dtype"]
    assert (
        f"ran it in {recipe['seconds']:.0f} s, {recipe['examples_per_s']:.0f}" in text
    )
    store = recipe["metrics"]["store accuracy"]
    assert f"right on {100 * store:.0f}% of the test" in text
    assert recipe["metrics"]["exact match"] == 0  # "no receipt was right whole"


def test_the_bandwidth_limit_uses_the_devices_own_data_sheet():
    "benchmarks/gpu.py once assumed an H100's 3.35 TB/s on an H200 (4.8)"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bandwidth import nominal_bandwidth

    assert nominal_bandwidth("NVIDIA H200") == 4.8e12
    assert nominal_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert nominal_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert nominal_bandwidth("Tesla T4") == 0.32e12
    with pytest.raises(SystemExit, match="--bandwidth"):
        nominal_bandwidth("NVIDIA B200")


def test_the_speed_page_takes_each_part_from_its_newest_run(tmp_path, monkeypatch):
    "A call with --only some parts does not hide the parts of an earlier call"
    import speed_page

    environment = {"device": "NVIDIA H200", "torch": "2.11", "transformers": "5.17",
                   "cpus": 16}  # fmt: skip
    older = {"branches": {"tests": {"a": "passed"}, "chapters": {"08_x": "passed"},
                          "started": "2026-01-01T00:00", "commit": "aaa"}}  # fmt: skip
    newer = {"speed": {"started": "2026-01-02T00:00", "commit": "bbb"}}
    for stamp, parts in (("20260101-0000", older), ("20260102-0000", newer)):
        record = {"environment": environment, "parts": parts}
        (tmp_path / f"gpu-run-{stamp}.json").write_text(json.dumps(record))
    monkeypatch.setattr(speed_page, "RESULTS", tmp_path)
    page = speed_page.gpu_run()
    assert "`tests/gpu`: 1 of 1 passed" in page  # from the older call
    assert "(commit aaa)" in page and "(commit bbb)" in page


def test_the_segment_part_trains_the_recipe_chapter_12_1_chose():
    """12.1's comparison chose LoRA with the <seg> rows; going on from the shipped
    adapter, the GPU trains at a quarter of the rate by default, with and without
    the boxes world"""
    start = ["--from-adapter", "segment"]  # each call goes on from the shipped one
    runs = gpu_run.segment_runs({})
    assert set(runs) == {"low", "boxes"}
    assert runs["low"] == [*gpu_run.SEGMENT_LORA[:-1], "5e-4", *start]
    runs = gpu_run.segment_runs({"GPU_SEGMENT_RUNS": "lora,rows"})
    assert runs["lora"] == [*gpu_run.SEGMENT_LORA, *start]
    assert runs["rows"] == [*gpu_run.SEGMENT_LORA, "--lora-tokens", "seg", *start]
    record = json.loads(
        (ROOT / "paligemma_lib/assets/segment_recipes.json").read_text()
    )
    chosen = record["recipes"]["seg rows"]
    assert chosen["recipe"] == {"lora": True, "rows": ["seg"], "loc_weight": 1.0,
                                "lr": 2e-3}  # fmt: skip
    flags = runs["rows"]
    assert float(flags[flags.index("--lr") + 1]) == chosen["recipe"]["lr"]


def test_the_segment_part_runs_the_recipes_asked_for_from_the_adapter_asked_for():
    env = {"GPU_SEGMENT_RUNS": "lora,loc", "GPU_SEGMENT_FROM": "none"}
    runs = gpu_run.segment_runs(env)
    loc = [*gpu_run.SEGMENT_LORA, "--lora-tokens", "seg,loc"]
    assert runs == {"lora": gpu_run.SEGMENT_LORA, "loc": loc}
    with pytest.raises(ValueError, match="choose among lora, rows, loc, low, boxes"):
        gpu_run.segment_runs({"GPU_SEGMENT_RUNS": "lora,sails"})


def test_the_shipped_segment_adapter_has_the_shape_the_part_trains():
    "--from-adapter segment with SEGMENT_LORA's flags: the same r, alpha, targets"
    from paligemma_lib.adapters import check_adapter

    _, saved = check_adapter("segment")
    flags = gpu_run.SEGMENT_LORA
    assert saved.r == int(flags[flags.index("--lora-r") + 1])
    assert saved.alpha == float(flags[flags.index("--lora-alpha") + 1])
    assert saved.target_modules == "all-linear"
    assert flags[flags.index("--lora-targets") + 1] == "all"  # all-linear's shorthand


# --- the part `profile` (issue 49 section 2) ---


def test_profile_is_a_part_a_plain_run_leaves_out():
    assert "profile" in gpu_run.PARTS and "profile" not in gpu_run.DEFAULT_PARTS
    assert "profile.json" in gpu_run.FILES
    assert gpu_run.INSTALL + gpu_run.BUDGETS["profile"] <= gpu_run.CALL


def test_the_profile_reads_a_recipe_as_the_train_command_does():
    import gpu_profile

    segment = gpu_profile.recipes({})["segment"]
    args = gpu_profile.parsed(segment, 100, batch_size=4)
    assert (args.model, args.batch_size, args.lr, args.lora) == ("nano", 4, 5e-4, True)
    assert (args.lora_r, args.lora_alpha, args.worlds) == (16, 32, "segments=1")
    assert args.from_adapter == "segment"  # the part goes on from the shipped adapter
    real = gpu_profile.parsed(gpu_profile.recipes({})["real"], 100, None)
    assert real.batch_size == 128  # the GPU's batch, as tools/gpu_real.py runs it


def test_the_profile_measures_the_runs_the_parts_train():
    """The segment part's first run and the real part's recipe, as the same
    variables choose them (the profile once timed a recipe no part ran)"""
    import gpu_profile

    env = {"GPU_SEGMENT_RUNS": "boxes,low", "GPU_REAL_RECIPE": "pen",
           "GPU_REAL_FROM": "nano-real", "GPU_TRAIN_COMPILE": "1"}  # fmt: skip
    found = gpu_profile.recipes(env)
    runs = gpu_run.segment_runs(env)
    assert list(found) == ["segment", "real"]  # the segment recipe first
    assert found["segment"] == [
        *gpu_run.SEGMENT_BASE,
        *(f for f in runs["boxes"] if f != "--compile"),
    ]
    real = gpu_profile.parsed(found["real"], 100, None)
    assert real.model == "nano-real" and real.compile is False
    assert real.worlds == gpu_real.MIXES["pen"]


def test_the_data_rate_is_timed_past_the_batches_built_ahead(monkeypatch):
    "Workers build PREFETCH batches each while starting: those are not timed"
    import types

    import gpu_profile

    import paligemma_lib.batching

    taken = []

    def fake(batches, start, workers):
        def gen():
            while True:
                taken.append(1)
                yield []

        return gen()

    monkeypatch.setattr(paligemma_lib.batching, "step_batches", fake)
    batches = types.SimpleNamespace(config=types.SimpleNamespace(batch_size=8))
    gpu_profile.data_rate(batches, workers=3, steps=2, warm=1)
    ahead = (gpu_profile.PREFETCH + 1) * 3
    assert len(taken) == 1 + ahead + 4 * 3  # warm, the queue, then 4 a worker
    monkeypatch.undo()
    source = inspect.getsource(paligemma_lib.batching.step_batches)
    assert f"prefetch_factor={gpu_profile.PREFETCH}" in source


def test_a_compiled_step_that_fails_keeps_the_eager_numbers(monkeypatch):
    "A GPU's minutes are few: Inductor failing there must not lose the eager profile"
    import types

    import gpu_profile

    import paligemma_lib.train

    batches = types.SimpleNamespace(config=types.SimpleNamespace(batch_size=8))
    monkeypatch.setattr(gpu_profile, "parsed", lambda *a: None)
    monkeypatch.setattr(gpu_profile, "pieces", lambda *a: ("model", batches, 1, 2, 3))
    monkeypatch.setattr(gpu_profile, "data_rate", lambda *a: 100.0)
    monkeypatch.setattr(gpu_profile, "doubled", lambda b: b)
    monkeypatch.setattr(gpu_profile, "step_rate", lambda *a: (90.0, [], 0.0))
    monkeypatch.setattr(paligemma_lib.train, "_step_model", lambda *a: "compiled")

    def rates(parts, *args):
        if parts[0] == "compiled":
            raise RuntimeError("Inductor says no")
        return {"step examples/s": 50.0}

    monkeypatch.setattr(gpu_profile, "rates", rates)
    result = gpu_profile.profile_recipe([], "cpu", workers=1, steps=2, warm=1)
    assert result["eager"] == {
        "step examples/s": 50.0,
        "step examples/s at twice the batch": 90.0,
    }
    assert result["compiled"] == {"error": "RuntimeError: Inductor says no"}
    assert result["data examples/s"] == 100.0


def test_the_profile_counts_each_kernels_device_time_once():
    "An operator's device time is its kernels': summing both would count it twice"
    import types

    import gpu_profile
    import torch

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(key, kind, host, device):
        return types.SimpleNamespace(key=key, device_type=kind, count=1,
                                     self_cpu_time_total=host,
                                     self_device_time_total=device)  # fmt: skip

    events = [
        event("aten::mm", cpu, 30, 500),
        event("nvjet_gemm", cuda, 0, 500),
        event("triton_poi_fused", cuda, 0, 200),
        event("aten::add", cpu, 9, 0),
    ]
    on_gpu = gpu_profile.own_times(events, on_device=True)
    assert [(e.key, us) for e, us in on_gpu] == [
        ("nvjet_gemm", 500),
        ("triton_poi_fused", 200),
    ]
    on_cpu = gpu_profile.own_times(events, on_device=False)
    assert [(e.key, us) for e, us in on_cpu] == [("aten::mm", 30), ("aten::add", 9)]


def test_the_training_parts_compile_only_when_asked():
    "GPU_TRAIN_COMPILE=1 adds train --compile to every run; eager by default"
    from gpu_driver import compile_flags

    assert compile_flags({}) == compile_flags({"GPU_TRAIN_COMPILE": "0"}) == []
    env = {"GPU_SEGMENT_RUNS": "lora,boxes", "GPU_TRAIN_COMPILE": "1"}
    for flags in gpu_run.segment_runs(env).values():
        assert flags[-1] == "--compile" and flags.count("--compile") == 1
    assert all("--compile" not in f for f in gpu_run.segment_runs({}).values())
    with pytest.raises(ValueError, match="GPU_TRAIN_COMPILE=yes: use 1"):
        compile_flags({"GPU_TRAIN_COMPILE": "yes"})


def test_a_run_leaves_no_temporary_files(tmp_path, monkeypatch):
    "What a part and its children put in the temporary folder is gone after the run"
    made = []

    def part(run, budget):
        made.append(Path(tempfile.mkdtemp()))
        child = "import tempfile; print(tempfile.mkdtemp())"
        made.append(
            Path(
                subprocess.check_output(
                    [sys.executable, "-c", child], text=True
                ).strip()
            )
        )
        assert all(p.is_dir() for p in made)
        return {}

    monkeypatch.setitem(gpu_run.PART_FUNCTIONS, "speed", part)
    before = tempfile.gettempdir()
    gpu_run.main(["--rehearse", "--only", "speed", "--out", str(tmp_path / "out")])
    assert len(made) == 2 and made[0].parent == made[1].parent  # the child's is ours
    assert not made[0].parent.exists()
    assert tempfile.gettempdir() == before
    assert (tmp_path / "out" / "run.json").exists()  # what comes back is not scratch


def test_ingest_puts_the_resolution_part_where_the_speed_page_reads_it(
    tmp_path, monkeypatch
):
    "Issue 52: the part's record becomes benchmarks/results/resolution-cuda-<start>"
    import speed_page

    run = tmp_path / "run"
    run.mkdir()
    record = {"environment": {"device": "NVIDIA H100 80GB HBM3", "commit": "abc"},
              "started": "2026-12-01T09:00:00", "finished": "2026-12-01T09:08:00",
              "parts": {"resolution": {"started": "2026-11-30T10:05:00"}}}  # fmt: skip
    (run / "run.json").write_text(json.dumps(record))
    (run / "resolution.json").write_text('{"rows": {}}')
    root = tmp_path / "root"
    (root / "benchmarks" / "results").mkdir(parents=True)
    monkeypatch.setattr(gpu_run, "ROOT", root)
    pages = []
    monkeypatch.setattr(gpu_run.subprocess, "run", lambda *a, **k: pages.append(a))
    assert gpu_run.ingest(run) == 0
    copied = root / "benchmarks" / "results" / "resolution-cuda-20261130-1005.json"
    assert copied.read_text() == '{"rows": {}}'  # from the call that ran the part
    assert speed_page.gpu_resolutions(copied.parent) == [copied]
    assert pages  # the speed page is made again


def test_the_profile_checks_the_codes_written_on_the_device(monkeypatch):
    "The segment recipe's codes from `finish` against the world's, and a wrong one seen"
    import gpu_profile
    import torch

    from paligemma_lib import PaliGemmaProcessor
    from paligemma_lib.batching import StepBatches, training_data
    from paligemma_lib.data import Collator, SyntheticDataset
    from paligemma_lib.segment_batches import SegmentCollator
    from paligemma_lib.train import TrainConfig

    processor = PaliGemmaProcessor.from_pretrained("nano")
    data = SyntheticDataset({"segments": 0.5, "shapes": 0.5}, "train", size=64)
    plain = Collator(processor, pixels="uint8")
    batches = StepBatches(*training_data(data, plain), TrainConfig(batch_size=4))
    codes = gpu_profile.device_codes(batches, torch.device("cpu"), n=6)
    assert codes["examples"] == 6 and codes["codes"] >= 6 * 16
    assert codes["all near ties"] and codes["differing"] <= codes["codes"] // 10
    assert (
        gpu_profile.device_codes(StepBatches(data, plain, TrainConfig()), "cpu") == {}
    )
    finish = SegmentCollator.finish

    def shifted(self, micro_batches, device):  # every code one along
        done = finish(self, micro_batches, device)
        for batch in done:
            at = torch.isin(batch.input_ids, self.seg_ids())
            ids = self.seg_ids()
            position = {int(t): c for c, t in enumerate(ids)}
            batch.input_ids[at] = ids[
                [(position[int(t)] + 1) % 128 for t in batch.input_ids[at]]
            ]
        return done

    monkeypatch.setattr(SegmentCollator, "finish", shifted)
    wrong = gpu_profile.device_codes(batches, torch.device("cpu"), n=6)
    assert wrong["differing"] == wrong["codes"] and not wrong["all near ties"]
