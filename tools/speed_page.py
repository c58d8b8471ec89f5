"""Write the book's appendix page "Speed and memory" from the benchmark records,
and its chart of the decoding table, book/figures/a2_decoding.png.

Every number on book/a2_speed_and_memory.md comes from a JSON file in
benchmarks/results/ (or the shipped models' training records), each table with its
machine, date and command; none is typed by hand. tests/test_speed_page.py checks
that the committed page is what this script writes. After a new benchmark run:

    python tools/speed_page.py            # rewrite the page and draw the chart
    python tools/speed_page.py --check    # exit 1 if the page is out of date

--check compares the page's text and that the chart exists; the chart is drawn
from the same records with no date or version in the file, so the same matplotlib
draws the same bytes, but it is not compared byte for byte (another matplotlib
draws other pixels).

Records taken on a machine that was busy with other work are not published (the
controlled `--busy 1` runs of benchmarks/generate.py are: their load is the
experiment).
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_calls  # noqa: E402  (tools/, this script's folder)
from bandwidth import nominal_bandwidth  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
# the records a chapter quotes ship with the package, so its asserts always run
RECORDS = ROOT / "paligemma_lib" / "assets" / "records"
PAGE = ROOT / "book" / "a2_speed_and_memory.md"
CHART = ROOT / "book" / "figures" / "a2_decoding.png"

GPU_DECODE = "gpu-cuda-3b-20261122-2119.json"  # chapters 8, 10 and 12 cite it
GPU_DECODES = (  # benchmarks/gpu.py did not yet write its command into the record
    (GPU_DECODE, "python benchmarks/gpu.py --out benchmarks/results"),
    (
        "gpu-cuda-3b-20261126-0445.json",
        "PYTHONPATH=. python benchmarks/gpu.py --budget 230 --out DIR",
    ),
)
INT8_GPU = "gpu-cuda-3b-short-20261126-0447.json"
INT8_PROFILE = "int8-profile-h200-20261126-0527.json"
INT8_SHIPPED = "gpu-cuda-3b-short-20261126-1029.json"  # the reduction route, shipped
INT8_SHIPPED_COMMAND = (
    "PYTHONPATH=. python benchmarks/gpu.py --short --budget 190 --out DIR"
)
# the T4 part's 3B LoRA step again, each dtype after the last was freed
T4_LORA_FRESH = "t4-3b-lora-fresh-20261126-1031.json"
INT8_PROFILE_COMMAND = "PYTHONPATH=. python benchmarks/int8_gpu_profile.py --out DIR"
INT8_GPU_COMMAND = (
    "PYTHONPATH=. python benchmarks/gpu.py --short --budget 150 --out DIR"
)
CPU_QUIET = "cpu-mid-20261123-1925.json"
CPU_BUSY = "cpu-mid-busy1-20261123-1926.json"
INT8_FP32 = "cpu-mid-20261123-2000.json"
INT8_BF16 = "cpu-mid-bf16-20261123-2000.json"
MID = "mid (vision 256x4 @112px, text 512x4, vocab 8192)"  # the int8 records' config
DATA_PIPELINE = "train-cpu-20261123-1958.json"
RESOLUTION_CPU = (
    "resolution-cpu-20261127-1214.json"  # benchmarks/resolution.py, chapter 11.4
)
NANO_CPU = "nano-cpu-run-f901a61.json"
NANO_GPU = ROOT / "paligemma_lib" / "assets" / "nano" / "training_record.json"
NANO_REAL = ROOT / "paligemma_lib" / "assets" / "nano-real" / "training_record.json"
NANO_REAL_CPU = "nano-real-cpu-run-2026-11-26.json"  # its CPU hour, not shipped
# benchmarks/gpu.py did not yet write its command into the record
GPU_COMMAND = "python benchmarks/gpu.py --out benchmarks/results"
GIB = 2**30


def folder_of(name: str) -> Path:
    "benchmarks/results/, or the package's records for those a chapter quotes"
    return RECORDS if (RECORDS / name).is_file() else RESULTS


def place(name: str) -> str:
    "A record's path in the repository, as the page prints it"
    path = folder_of(name) / name
    if not path.is_relative_to(ROOT):  # RESULTS elsewhere (the tests' folders)
        return f"benchmarks/results/{name}"
    return str(path.relative_to(ROOT))


def record(name: str | Path) -> dict:
    path = name if isinstance(name, Path) else folder_of(name) / name
    return json.loads(path.read_text())


def date_of(name: str) -> str:
    "cpu-mid-20261123-1925.json -> 2026-11-23 19:25"
    stamp = [part for part in name[:-5].split("-") if part.isdigit()]
    day, time = stamp[-2], stamp[-1]
    return f"{day[:4]}-{day[4:6]}-{day[6:]} {time[:2]}:{time[2:]}"


def source(name: str, machine: str, command: str) -> str:
    return (
        f"*Machine:* {machine}. *Date:* {date_of(name)}. "
        f"*Record:* `{place(name)}`. *Command:* `{command}`"
    )


def shell(*commands: str, width: int = 76) -> str:
    "A code block of commands, each folded with backslashes to fit the column"
    lines = []
    for command in commands:
        line, words = "", []
        for word in command.split():  # an option stays with its value
            if words and words[-1].startswith("-") and not word.startswith("-"):
                words[-1] += " " + word
            else:
                words.append(word)
        for word in words:
            if line and len(line) + 1 + len(word) > width:
                lines.append(line + " \\")
                line = "  " + word
            else:
                line = f"{line} {word}" if line else word
        lines.append(line)
    return "```\n" + "\n".join(lines) + "\n```"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# the decoding table's ways: the label a reader sees, the record's key
DECODING_WAYS = {
    "ours, eager": "ours eager",
    "ours, compiled (CUDA graphs)": "ours compiled",
    "`transformers`, eager": "transformers eager",
    "`transformers`, static cache, compiled": "transformers static compiled",
}


def decoding_ms() -> dict[str, dict[int, dict[str, float]]]:
    "device -> batch -> way's label -> ms a decoding step, from GPU_DECODES' records"
    found = {}
    for name, _ in GPU_DECODES:
        gpu = record(name)
        found[gpu["device"]] = {
            batch: {
                label: gpu["sections"][f"decode {key}, batch {batch}"]["ms_per_step"]
                for label, key in DECODING_WAYS.items()
            }
            for batch in (1, 8)
        }
    return found


def draw_decoding_chart(path: Path = CHART) -> None:
    """The decoding table as bars: ms a step for each way, at batch 1 and 8, one
    bar per GPU. Deterministic: no date or software version in the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = decoding_ms()
    devices = list(ms)
    labels = [label.replace("`", "") for label in DECODING_WAYS]
    colours = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
    figure, axes = plt.subplots(1, 2, figsize=(6.8, 4.0), dpi=100, sharey=True)
    height = 0.8 / len(devices)
    for ax, batch in zip(axes, (1, 8)):
        top = max(v for d in devices for v in ms[d][batch].values())
        for i, device in enumerate(devices):
            values = list(ms[device][batch].values())
            ys = [row + (i - (len(devices) - 1) / 2) * height for row in range(4)]
            ax.barh(ys, values, height=height * 0.92, color=colours[i], label=device)
            for y, value in zip(ys, values):
                ax.text(value + top * 0.02, y, f"{value:.1f}", va="center", fontsize=8)
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.set_xlim(0, top * 1.22)
        ax.tick_params(labelsize=8)
        ax.spines[["top", "right"]].set_visible(False)
    wrapped = [x.replace(" (", "\n(").replace("static cache,", "static\ncache,")
               for x in labels]  # fmt: skip
    axes[0].set_yticks(range(4), wrapped)
    axes[0].invert_yaxis()
    figure.supxlabel("ms a decoding step (shorter is faster)", fontsize=9)
    handles, names = axes[0].get_legend_handles_labels()
    figure.legend(handles, names, fontsize=8, frameon=False, ncol=len(devices),
                  loc="upper center")  # fmt: skip
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, metadata={"Software": None})
    plt.close(figure)


def fastest_sentence() -> str:
    "Which way was fastest, as the records say"
    ms = decoding_ms()
    best = {
        (device, batch): min(ways, key=ways.get)
        for device, batches in ms.items()
        for batch, ways in batches.items()
    }
    if len(set(best.values())) == 1:
        way = next(iter(best.values())).replace("`", "")
        return f"The fastest way at both batch sizes on both GPUs: {way}."
    return "Which way is fastest depends on the GPU and the batch size."


def gpu_decoding() -> str:
    first = record(GPU_DECODES[0][0])
    sections = [
        "## Decoding PaliGemma-3B on a GPU",
        "Greedy decoding at PaliGemma-3B's shapes (random weights, "
        f"{first['dtype'].replace('torch.', '')}, {first['new_tokens']} new tokens): "
        "milliseconds per decoding step, the prompt's prefill left out, and the "
        "share of the bandwidth limit, the time to read the language model's "
        "weights and the KV cache once at the GPU's nominal bandwidth. Every way "
        "gave the same tokens (with random weights one token repeated, a weak "
        "check). Chapter 8 explains both ways.",
        f"```{{figure}} figures/{CHART.name}\n:alt: Milliseconds a decoding step, "
        "by way, at batch 1 and 8, on each GPU\n\nThe tables below as bars: "
        "milliseconds a decoding step (shorter is faster), at batch 1 and at batch "
        f"8, one bar per GPU. {fastest_sentence()}\n```",
    ]
    for name, command in GPU_DECODES:
        sections += gpu_decoding_table(name, command)
    return "\n\n".join(sections)


def gpu_decoding_table(name: str, command: str) -> list[str]:
    gpu = record(name)
    parts = gpu["sections"]
    # records before benchmarks/bandwidth.py assumed an H100's 3.35 TB/s for
    # every GPU: the limit scales inversely with the bandwidth
    bandwidth = nominal_bandwidth(gpu["device"])
    rescale = gpu["bandwidth_bytes_per_s"] / bandwidth
    rows = []
    for label, key in DECODING_WAYS.items():
        one, eight = parts[f"decode {key}, batch 1"], parts[f"decode {key}, batch 8"]
        rows.append(
            [
                label,
                f"{one['ms_per_step']:.2f}",
                f"{one['fraction_of_bandwidth_limit'] * rescale:.1%}",
                f"{eight['ms_per_step']:.2f}",
                f"{eight['tokens_per_s']:.0f}",
            ]
        )
    ours = parts["decode ours compiled, batch 1"]["ms_per_step"]
    theirs = parts["decode transformers static compiled, batch 1"]["ms_per_step"]
    limit = parts["decode ours compiled, batch 1"]["bandwidth_limit_ms"] * rescale
    machine = (
        f"{gpu['device']}, PyTorch {gpu['torch']}, transformers {gpu['transformers']}"
    )
    return [
        f"**{gpu['device']}** ({bandwidth / 1e12:.2f} TB/s: "
        f"a limit of {limit:.2f} ms at batch 1)",
        table(
            ["way", "batch 1: ms/step", "of limit", "batch 8: ms/step", "tokens/s"],
            rows,
        ),
        f"Compiled, ours is {theirs / ours:.2f} times as fast as `transformers`' "
        "best at batch 1.",
        source(name, machine, command),
    ]


def gpu_lora() -> str:
    gpu = record(GPU_DECODE)
    lora = gpu["sections"]["lora"]
    rows = [
        ["adapted layers", str(lora["targets"])],
        ["trainable parameters", f"{lora['trainable_parameters'] / 1e6:.1f} M"],
        ["batch x tokens", f"{lora['batch_size']} x {lora['sequence_length']}"],
        ["seconds a step (median)", f"{lora['step_s_median']:.3f}"],
        [
            "peak memory above the models",
            f"{lora['peak_above_baseline_bytes'] / GIB:.2f} GiB",
        ],
        ["peak memory in all", f"{lora['peak_memory_bytes'] / GIB:.2f} GiB"],
    ]
    machine = f"{gpu['device']}, PyTorch {gpu['torch']}"
    return "\n\n".join(
        [
            "## LoRA at PaliGemma-3B's shapes",
            "One training step of chapter 10's LoRA (rank 8 on its targets, gradient "
            "checkpointing), with the two decoding models of the section above "
            "still held on the GPU.",
            table(["", "value"], rows),
            source(GPU_DECODE, machine, GPU_COMMAND),
        ]
    )


def int8_rows(gpu: dict) -> list[list[str]]:
    "bfloat16 beside int8 weights, eager and compiled, batch 1: ms a step"
    ms = {k: v["ms_per_step"] for k, v in gpu["sections"].items() if "ms_per_step" in v}
    return [
        [way, f"{ms[f'decode ours {way}, batch 1']:.2f}",
         f"{ms[f'decode ours int8 {way}, batch 1']:.2f}"]
        for way in ("eager", "compiled")
    ]  # fmt: skip


def gpu_int8() -> str:
    gpu, shipped = record(INT8_GPU), record(INT8_SHIPPED)
    rows = int8_rows(gpu)
    profile = record(INT8_PROFILE)["results"]
    profiled = [[way, f"{r['ms_per_step']:.2f}"] for way, r in profile.items()]
    return "\n\n".join(
        [
            "## int8 weights on a GPU",
            "Chapter 8.1's int8 decoder weights at PaliGemma-3B's shapes, batch 1, "
            "against the same model in bfloat16 (ms a step). On a GPU the int8 "
            "layers took the cast route, and compiled that was nine times slower "
            "than bfloat16:",
            table(["way", "bfloat16", "int8 weights"], rows),
            source(
                INT8_GPU, f"{gpu['device']}, PyTorch {gpu['torch']}", INT8_GPU_COMMAND
            ),
            "The compiler hands the cast's product to `torch._weight_int8pack_mm`, "
            "whose CUDA kernel took most of the step. Written as a multiply and a sum "
            "(`sum_product`, what a compiled decoding step now takes), it fuses into "
            "one kernel that reads each code once. Compiled, batch 1, ms a step:",
            table(["way", "ms/step"], profiled),
            source(
                INT8_PROFILE,
                f"{gpu['device']}, PyTorch {gpu['torch']}",
                INT8_PROFILE_COMMAND,
            ),  # fmt: skip
            "The library as shipped, the reduction route in its compiled steps, "
            "measured by the same benchmark on another GPU (ms a step):",
            table(["way", "bfloat16", "int8 weights"], int8_rows(shipped)),
            source(
                INT8_SHIPPED,
                f"{shipped['device']}, PyTorch {shipped['torch']}",
                INT8_SHIPPED_COMMAND,
            ),
        ]
    )


def nano_training() -> str:
    gpu, cpu = record(NANO_GPU), record(NANO_CPU)
    rows = []
    for label, run in (("one GPU", gpu), ("two CPU cores", cpu)):
        examples = run["steps"] * run["train_config"]["batch_size"]
        rows.append(
            [
                label,
                run["device"].split(": ", 1)[-1],
                f"{run['steps']:,} x {run['train_config']['batch_size']}",
                f"{run['seconds']:,.1f}",
                f"{examples / run['seconds']:,.1f}",
            ]
        )
    real = record(NANO_REAL)  # the shipped nano-real: one run on a GPU
    rows.append(training_row("`nano-real` (12.2), shipped", real, *real_steps(real)))
    hour = record(RESULTS / NANO_REAL_CPU)  # resumed: seconds of the last process
    first, last = real_steps(hour)
    label = f"its CPU hour before, its last {last - first:,} steps"
    rows.append(training_row(label, hour, first, last))
    gpu_rate = gpu["steps"] * gpu["train_config"]["batch_size"] / gpu["seconds"]
    cpu_rate = cpu["steps"] * cpu["train_config"]["batch_size"] / cpu["seconds"]
    return "\n\n".join(
        [
            "## Training the nano model",
            "The shipped `nano` model's run and the first run on a CPU, from their "
            "training records (evaluations included in the time), and chapter 12.2's "
            "fine-tunes of every weight of nano on real pictures: the shipped one, "
            "on a GPU, and the CPU hour before it, from the step it resumed at (its "
            "first 800 steps ran beside another run).",
            table(["run", "device", "steps x batch", "seconds", "examples/s"], rows),
            f"The GPU run went about {gpu_rate / cpu_rate:.0f} times faster. "
            "*Records:* `paligemma_lib/assets/nano/training_record.json`, "
            "`paligemma_lib/assets/nano-real/training_record.json`, "
            f"`{place(NANO_CPU)}` and `{place(NANO_REAL_CPU)}`."
            " *Commands:*",
            shell(gpu["command"], cpu["command"], real["command"], hour["command"]),
        ]
    )


def real_steps(run: dict) -> tuple[int, int]:
    "The steps a run's seconds cover: from the step its last process resumed at"
    segments = run.get("segments")
    return tuple(segments[-1]["steps"]) if segments else (0, run["steps"])


def training_row(label: str, run: dict, first: int, last: int) -> list:
    batch = run["train_config"]["batch_size"]
    return [
        label,
        run["device"].split(": ", 1)[-1],
        f"{last - first:,} x {batch}",
        f"{run['seconds']:,.1f}",
        f"{(last - first) * batch / run['seconds']:,.1f}",
    ]


def cpu_threads() -> str:
    quiet, busy = record(CPU_QUIET), record(CPU_BUSY)
    ways = {
        'ours, `threads="auto"`': "ours",
        "ours, all threads": "ours, all threads",
        "`transformers`": "transformers",
    }
    rows = []
    for label, key in ways.items():
        row = [label]
        for run in (quiet, busy):
            for part in run["rows"]:
                row.append(f"{part['tokens_per_s'][key]:.1f}")
        rows.append(row)
    same = all(all(part["same_tokens_as_ours"].values()) for part in quiet["rows"])
    machine = f"2-core CPU ({quiet['threads']} threads), PyTorch {quiet['torch']}"
    return "\n\n".join(
        [
            "## Decoding on a CPU, quiet and beside another process",
            "Tokens per second of greedy decoding, float32, on the benchmark's "
            f"{quiet['rows'][0]['config'].replace(' (', ' configuration (')}. "
            "The second pair of columns "
            "was measured with one other busy process on the machine "
            "(`--busy 1`): the load is the experiment. On a loaded CPU "
            '`generate(threads="auto")` times its first steps with each thread '
            "count and keeps the fastest (chapter 8); the default keeps torch's "
            "count, for the same outputs on every run. "
            f"{'Every way gave the same tokens.' if same else ''}",
            table(
                ["way", "quiet, batch 1", "batch 8", "busy, batch 1", "batch 8"],
                rows,
            ),
            source(CPU_QUIET, machine, quiet["command"]),
            source(CPU_BUSY, machine, busy["command"]),
        ]
    )


def cpu_int8() -> str:
    fp32, bf16 = record(INT8_FP32), record(INT8_BF16)
    rows = []
    for label, run in (("float32", fp32), ("bfloat16", bf16)):
        for part in run["rows"]:
            rate = part["tokens_per_s"]
            rows.append(
                [
                    label,
                    str(part["batch"]),
                    f"{rate['ours']:.1f}",
                    f"{rate['ours, int8']:.1f}",
                    f"{rate['ours, int8'] / rate['ours']:.2f}",
                ]
            )
    machine = f"2-core CPU, PyTorch {fp32['torch']}"
    configs = {part["config"] for run in (fp32, bf16) for part in run["rows"]}
    assert configs == {MID}, configs  # the widths the text below names
    return "\n\n".join(
        [
            "## int8 weights on a CPU",
            "Chapter 8.1's weight-only int8 decoding against the same model in its "
            f"own dtype: tokens per second, at the mid configuration's widths only "
            f"(`{MID}`: the decoder 512 wide, its MLP 2048), where a layer's "
            "float32 weight is at most 4 MB and stays in the CPU's caches.",
            table(["activations", "batch", "ours", "ours, int8", "ratio"], rows),
            "These ratios are the mid widths'; at PaliGemma's (2048 wide, MLP "
            "16,384) they are unmeasured and need not hold. The float32 rows were "
            "measured with the route of the time, which cast the codes to a "
            "float32 copy of the weight on every call: at "
            "those widths that copy made int8 many times slower than float32. "
            "Float32 activations now go through the int8 kernel, rounded to "
            "bfloat16 (chapter 8.1).",
            source(INT8_FP32, machine, fp32["command"]),
            source(INT8_BF16, machine, bf16["command"]),
        ]
    )


def data_pipeline() -> str:
    run = record(DATA_PIPELINE)
    rates = run["examples_per_s"]
    rows = [[way, f"{rate:,.0f}"] for way, rate in rates["data"].items()]
    rows.append(["the training step alone", f"{rates['step']:,.1f}"])
    for workers, rate in rates["end_to_end"].items():
        rows.append([f"data and step, workers {workers}", f"{rate:,.1f}"])
    machine = f"2-core CPU, PyTorch {run['torch']}"
    args = run["args"]
    command = (
        "python benchmarks/train_throughput.py --device cpu --workers "
        + " ".join(map(str, args["workers"]))
    )
    return "\n\n".join(
        [
            "## Training's input pipeline on a CPU",
            "Examples per second for the nano recipe (batch of "
            f"{args['batch_size']}): building batches only, with images as 8-bit "
            "levels (`uint8`, normalised by the model on its device) or as "
            "normalised float32, in this process or through `DataLoader` workers; "
            "the training step only; and both.",
            table(["what", "examples/s"], rows),
            "On a CPU the step dominates; the data rates matter on a GPU.",
            source(DATA_PIPELINE, machine, command),
        ]
    )


def data_rates(results: Path = RESULTS) -> list[Path]:
    "benchmarks/data_rate.py's records: newest last"
    return sorted(results.glob("data-rate-cpu-*.json"), key=lambda p: date_of(p.name))


def gpu_recipe_runs(results: Path = RESULTS) -> list[list[str]]:
    """Each training run of the GPU script's segment and real parts: its call, its
    workers, its examples a second, and a worker's share of them"""
    rows = []
    for path in sorted(results.glob("gpu-run-*.json")):
        call = record(path)
        parts = call["parts"]
        segment, real = parts.get("segment", {}), parts.get("real", {})
        runs = [(f"segment {n}", segment["workers per run"], r["examples_per_s"])
                for n, r in segment.get("runs", {}).items()]  # fmt: skip
        if "examples_per_s" in real:
            runs.append(("real", real["workers"], real["examples_per_s"]))
        stamp = gpu_calls.day_and_time(call["started"])  # as A.2's calls table
        rows += [[stamp, name, str(w), f"{rate:,.0f}", f"{rate / w:,.0f}"]
                 for name, w, rate in runs]  # fmt: skip
    return rows


def recipe_data() -> str:
    "One worker's rate for the GPU recipes (benchmarks/data_rate.py, issue 49)"
    found = data_rates()
    if not found:
        return ""
    run = record(found[-1])
    ratio = "x the world's answers"  # benchmarks/data_rate.py's column
    rows = [[name, str(r["batch"]), f"{r['examples/s']:,.0f}",
             f"{r[ratio]:.2f}" if ratio in r else ""]
            for name, r in run["rows"].items()]  # fmt: skip
    gpu = gpu_recipe_runs()
    machine = f"{run['device']}, PyTorch {run['torch']}"
    old, new = (run["rows"][f"segment, {way}"]["examples/s"]
                for way in ("the world's answers", "codes on the device"))  # fmt: skip
    assert new > 2 * old, (old, new)  # what the prose says
    return "\n\n".join(
        [
            "## The GPU recipes' data, one worker",
            "A GPU run trains on batches that `DataLoader` workers draw on the GPU "
            "machine's CPU cores, so it cannot train faster than its workers build. "
            "Examples a second that one worker (one thread) builds here for each "
            "recipe of the GPU script: the segment part's, with each example's masks "
            "encoded in the worker as the world writes its answers, and with the "
            "codes left to the device (chapter 12.1, what `train` does now); the "
            "real part's, which has nothing to leave; and the stage2 part's, chapter "
            "11.4's detail world among chapter 11's at 448 pixels. On this shared "
            "machine a rate moves from one run to the next by tens of percent; the "
            "ways alternate within a run, so their ratio is the figure to read. "
            "`finish`, the loop's share, "
            f"took {run['finish ms a step, this CPU']} ms a step on this CPU, the "
            "encoder over a batch's masks; on a GPU, the profile part's step "
            "includes it (A.4).",
            table(["recipe", "batch", "examples/s", "x"], rows),
            "The GPU runs, as their records give them, and each run's examples a "
            "second for each of its workers (the segment parts ran up to two recipes "
            "side by side; they drew the world's answers, "
            "before 12.1's painting and its codes on the device):",
            table(["call (UTC)", "run", "workers", "examples/s", "a worker"], gpu),
            source(found[-1].name, machine, run["command"].strip()),
        ]
    )


RESOLUTION_HEADER = ["pixels", "image tokens", "prefill ms", "x 224", "FLOPs x 224",
                     "step ms", "x 224"]  # fmt: skip


def resolution_rows(run: dict) -> list[list[str]]:
    "benchmarks/resolution.py's rows, one a size"
    return [
        [size, f"{r['image tokens']:,}", f"{r['prefill ms']:,.1f}",
         f"{r['prefill x 224']:.2f}", f"{r['FLOPs x 224']:.2f}",
         f"{r['decode ms a step']:.2f}", f"{r['step x 224']:.2f}"]
        for size, r in run["rows"].items()
    ]  # fmt: skip


def gpu_resolutions(results: Path = RESULTS) -> list[Path]:
    "tools/gpu_run.py's part `resolution`, ingested: newest last"
    found = results.glob("resolution-cuda-*.json")
    return sorted(found, key=lambda p: date_of(p.name))


def cpu_resolution() -> str:
    run = record(RESOLUTION_CPU)
    machine = f"2-core CPU, PyTorch {run['torch']}"
    r448, r896 = run["rows"]["448"], run["rows"]["896"]
    # what the prose says, checked against the record it reads
    assert abs(r448["prefill x 224"] / r448["FLOPs x 224"] - 1) < 0.25
    assert r896["prefill x 224"] > 2 * r896["FLOPs x 224"]
    assert 1 < r896["step x 224"] < 2 < r896["image tokens"] / 196
    prose = (
        f"At 448 the prefill's time grows with its FLOPs ({r448['prefill x 224']:.1f} "
        f"times against {r448['FLOPs x 224']:.1f}); at 896 it grows more than twice "
        f"as fast ({r896['prefill x 224']:.1f} times against "
        f"{r896['FLOPs x 224']:.1f}): this CPU does the larger attention (the "
        f"{r896['image tokens']:,} image tokens attending to one another, in each "
        "layer) at a lower rate than the rest. A decoding step grows far less "
        f"than the image tokens ({r896['step x 224']:.1f} times at 896, for 16 "
        "times the tokens): "
        "it reads the weights once, and the cache's image tokens only in attention."
    )
    return "\n\n".join(
        [
            "## Resolution on a CPU",
            "Chapter 11.4 counts what 448 and 896 pixels cost; this is the time, for "
            "nano made to see each size by `at_resolution`: the prefill (the picture "
            "and a short prompt, the cache filled) and a decoding step after it, "
            "medians, each against 224, beside the prefill's FLOPs against 224.",
            table(RESOLUTION_HEADER, resolution_rows(run)),
            prose,
            source(RESOLUTION_CPU, machine, run["command"].strip()),
        ]
    )


def gpu_resolution(results: Path = RESULTS) -> str:
    """The same at PaliGemma-3B's shapes, from the newest record of the GPU script's
    part `resolution` (issue 52); '' before the first record"""
    found = gpu_resolutions(results)
    if not found:
        return ""
    run = json.loads(found[-1].read_text())
    machine = f"{run['device']}, PyTorch {run['torch']}"
    tokens = [r["image tokens"] for r in run["rows"].values()]
    assert tokens == [256, 1024, 4096], tokens  # what the prose says
    return "\n\n".join(
        [
            "## Resolution on a GPU",
            "The same measure at PaliGemma-3B's shapes (random weights in bfloat16, "
            "batch 1, eager), from the GPU script's `resolution` part (A.4): 256, "
            "1,024 and 4,096 image tokens.",
            table(RESOLUTION_HEADER, resolution_rows(run)),
            source(found[-1].name, machine, run["command"].strip()),
        ]
    )


def gpu_run() -> str:
    """The newest run of each part of tools/gpu_run.py (a call may run some parts
    only): what ran on CUDA, the T4's part, speed"""
    found = sorted(RESULTS.glob("gpu-run-*.json"), reverse=True)
    if not found:
        return ""
    env, parts, paths = record(found[0])["environment"], {}, []
    for path in found:  # newest first; one device
        run = record(path)
        new = {k: v for k, v in run["parts"].items() if k not in parts}
        if new and run["environment"]["device"] == env["device"]:
            parts.update(new)
            paths.append(path.name)
    machine = (
        f"{env['device']}, PyTorch {env['torch']}, transformers {env['transformers']}"
    )
    calls = sorted({(p["started"][:16].replace("T", " "), p["commit"])
                    for p in parts.values()})  # fmt: skip
    # each call's commit: tests/test_gpu_run.py checks with it that every part
    # comes from its own newest call
    when = "; ".join(f"{day} UTC (commit {commit})" for day, commit in calls)
    names = ", ".join(f"`{place(name)}`" for name in sorted(paths))
    sections = ["## The GPU script's newest run", (
        f"`tools/gpu_run.py` on {machine}, {env['cpus']} CPU cores, run on "
        f"{when}. *Records:* {names}."
    )]  # fmt: skip
    branches = parts.get("branches", {})
    if "tests" in branches:
        tests = branches["tests"]
        passed = sum(v == "passed" for v in tests.values())
        chapters = branches["chapters"]
        good = [c.split("_")[0] for c, v in chapters.items() if v == "passed"]
        bad = [f"{c.split('_')[0]} ({':'.join(v.split(':')[:2])[7:]})"
               for c, v in chapters.items() if v != "passed"]  # fmt: skip
        sections.append(
            f"**On CUDA.** `tests/gpu`: {passed} of {len(tests)} passed. Chapters "
            f"run on the GPU with their own checks: {', '.join(good)} passed"
            + (f"; failed: {'; '.join(bad)}." if bad else ".")
        )
    sections += [gpu_run_t4(parts.get("t4", {})), gpu_run_speed(parts, env)]
    return "\n\n".join(x for x in sections if x)


def gpu_calls_bought() -> str:
    "Every training part a GPU call ran, and the ship decision on what it sent back"
    found = gpu_calls.rows()
    if not found:
        return ""
    intro = (
        "Every training part that a call of `tools/gpu_run.py` ran, read from the "
        "calls' records (`benchmarks/results/gpu-run-*.json`), beside the decision "
        f"on what it sent back, as the ledger (`{gpu_calls.LEDGER.relative_to(ROOT)}`) "
        "holds it. A segment part trains two recipes side by side; its column "
        "'on validation' gives each one's mask mIoU on validation scenes "
        f"{gpu_calls.CHOICE}, which the part chooses on. For nano-real it gives the "
        "two goals the model had not met, items named and three-digit numbers "
        "read, on the decision's validation examples, and the shipped model's "
        "before it. Under the table, each decision as the ledger words it. The rule "
        "that decides now (A.4) compares what came back with the shipped adapter on "
        f"validation scenes {gpu_calls.SHIP}, pair by pair, and grades test only "
        "once something ships; the tries of 2026-11-26 were decided by the rules of "
        "that day."
    )
    return "\n\n".join(
        ["## What each GPU call trained, and what shipped", intro,
         gpu_calls.table(found), gpu_calls.summary(found)]
    )  # fmt: skip


def gpu_run_t4(t4: dict) -> str:
    recipe, lora = t4.get("receipts recipe"), t4.get("3b lora", {})
    if recipe is None:
        return ""
    m = recipe["metrics"]
    rows = [[f"{k}", f"{v:.3f}"] for k, v in m.items() if k != "examples"]
    lines = [
        "**The GPU playing a T4** (compute capability 7.5, so fp16 autocast with the "
        "loss scaler; memory capped at 15 GiB; two data workers). Chapter 12's GPU "
        f"recipe, {recipe['steps']} steps of {recipe['batch_size']} receipts: "
        f"{recipe['seconds']:.0f} s, {recipe['examples_per_s']:.0f} receipts/s, "
        f"peak {recipe['peak_memory_bytes'] / GIB:.2f} GiB, "
        f"{recipe['skipped_steps']} of them skipped by the scaler; the loss fell from "
        f"{recipe['loss_first_5']:.2f} to {recipe['loss_last_5']:.2f}. On "
        f"{recipe.get('validation') or recipe['test']}:",  # test until 2026-11-27
        table(["field", "accuracy"], rows),
    ]
    if lora:
        rows = []
        for dtype, r in lora.items():
            fits = (
                f"fits: peak {r['peak_memory_bytes'] / GIB:.2f} GiB, "
                f"{sorted(r['step_s'])[len(r['step_s']) // 2]:.2f} s a step"
                if r["fits"]
                else "out of memory"
            )
            rows.append([dtype.replace("torch.", ""), fits])
        lines += [
            "A LoRA step at PaliGemma-3B's shapes (random weights; r=8 on chapter "
            "10's targets, gradient checkpointing, batch 2 of 302 tokens) under the "
            "same cap, by the dtype of the frozen weights:",
            table(["frozen weights", "under 15 GiB"], rows),
        ]
    if not all(r["fits"] for r in lora.values()):
        lines.append(t4_lora_fresh())
    return "\n\n".join(lines)


def t4_lora_fresh() -> str:
    "The 3B LoRA step measured again, each model freed before the next was built"
    fresh = record(T4_LORA_FRESH)
    peaks = {r["dtype"].replace("torch.", ""): r["peak_memory_bytes"] / GIB
             for r in fresh["results"]}  # fmt: skip
    return (
        'That "out of memory" was the script\'s own: the float32 model measured '
        "before was still on the GPU, held by a reference cycle (chapter 11.2's "
        "gradient checkpointing, since fixed). Measured again in one process, "
        "each model collected before the next: float16 fits at a peak of "
        f"{peaks['float16']:.2f} GiB, float32 at {peaks['float32']:.2f} GiB "
        f"(`{place(T4_LORA_FRESH)}`, {fresh['device']})."
    )


def gpu_run_speed(parts: dict, env: dict) -> str:
    speed = parts.get("speed", {})
    ways = {
        "ours, compiled (CUDA graphs)": "decode ours compiled, batch 1",
        "`transformers`, static cache, compiled": (
            "decode transformers static compiled, batch 1"
        ),
        "ours, eager": "decode ours eager, batch 1",
        "ours, int8 weights, eager": "decode ours int8 eager, batch 1",
    }
    rows = [[k, f"{speed[v]:.2f}"] for k, v in ways.items()
            if isinstance(speed.get(v), float)]  # fmt: skip
    lines = []
    if rows:
        lines += [
            f"**Decoding at PaliGemma-3B's shapes on the {env['device']}** (random "
            "bf16 weights, batch 1, `benchmarks/gpu.py --short`; ms a step):",
            table(["way", "ms/step"], rows),
        ]
    runs = parts.get("segment", {}).get("runs", {})
    for name, r in runs.items():
        what = {"lora": "LoRA", "rows": "LoRA and the <seg> rows"}.get(
            name, "every weight"
        )
        lines.append(
            f"Training nano on the segments world ({what}, batch "
            f"{parts['segment']['batch_size']}, "
            f"{parts['segment']['workers per run']} data workers, beside a second "
            f"run): {r['examples_per_s']:.0f} examples a second."
        )
    return "\n\n".join(lines)


PROFILE_CHART = ROOT / "book" / "figures" / "a2_decode_profile.png"
PROFILED = ("bf16, batch 1, as shipped", "int8, batch 1, as shipped")  # the figure's


def decode_profiles(results: Path = RESULTS) -> list[Path]:
    "tools/gpu_run.py's part `decode`, ingested: newest last"
    return sorted(results.glob("decode-profile-*.json"), key=lambda p: date_of(p.name))


def decode_profile(results: Path = RESULTS, chart: Path = PROFILE_CHART) -> str:
    """Where a compiled decoding step goes (issue 50), from the newest record of the
    GPU script's part `decode`: each row's step, and each kernel class's time beside
    the time its bytes need at the bandwidth; '' before the first record"""
    found = decode_profiles(results)
    if not found:
        return ""
    profile = json.loads(found[-1].read_text())
    rows, classes = [], []
    for label, row in profile["rows"].items():
        if "classes" not in row:
            rows.append([label] + ["-"] * 6 + [row.get("skipped", "error")])
            continue
        rows.append([label] + [f"{row[k]:.2f}" for k in (
            "generate ms a step", "replayed ms a step", "kernels ms a step",
            "gaps ms a step", "host ms a step", "limit ms a step")]
            + [f"{row['of limit']:.0%}" + ("" if row["tokens equal eager"]
                                            else ", tokens differ")])  # fmt: skip
        if label in PROFILED:
            for name, c in row["classes"].items():
                ratio = "-" if c["of limit"] is None else f"{c['of limit']:.0%}"
                classes.append([label, name, f"{c['ms']:.3f}", f"{c['kernels']:g}",
                                f"{c['bytes'] / 1e9:.3f}", f"{c['limit ms']:.3f}",
                                ratio])  # fmt: skip
    machine = f"{profile['device']}, PyTorch {profile['torch']}"
    bandwidth = profile["bandwidth"] / 1e12
    cited = found[-1].relative_to(ROOT) if found[-1].is_relative_to(ROOT) else None
    intro = (
        "`tools/gpu_run.py --only decode` at PaliGemma-3B's shapes (random "
        "weights): `generate(compile=True)`'s step (64 tokens less 1, over 63), "
        "the compiled step replayed with no host work between steps, its kernels' "
        "time (the profiler's), the gaps between kernels, the host's work between "
        f"steps, and the time the step's bytes need at {bandwidth:.2f} TB/s. "
        "Candidate fixes: `tuned` (Inductor's coordinate-descent tuning), "
        "`grouped` (attention without `repeat_kv`), `math` (attention written "
        "out for Inductor to fuse)."
    )
    caption = (
        f"```{{figure}} figures/{chart.name}\n:alt: Each kernel class's "
        "milliseconds a step beside the time its bytes need at the bandwidth\n\n"
        "Each kernel class's time a step (bars) beside the time its bytes need at "
        "the memory's bandwidth (ticks), bf16 and int8 at batch 1.\n```"
    )
    header = ["row", "generate ms", "replayed ms", "kernels ms", "gaps ms",
              "host ms", "limit ms", "of limit"]  # fmt: skip
    by_class = ["row", "class", "ms", "kernels", "GB", "limit ms", "of limit"]
    source = f"*Machine:* {machine}." + (f" *Record:* `{cited}`" if cited else "")
    return "\n\n".join(
        [
            "## Where a decoding step goes",
            intro,
            source,
            table(header, rows),
            caption,
            table(by_class, classes),
        ]  # fmt: skip
    )


def draw_decode_profile(profile: dict, path: Path) -> None:
    "Each class's ms (bar) and the ms its bytes need (tick), for PROFILED's rows"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [label for label in PROFILED if "classes" in profile["rows"].get(label, {})]
    figure, axes = plt.subplots(1, max(1, len(shown)), figsize=(6.8, 3.2), dpi=100,
                                sharey=True, squeeze=False)  # fmt: skip
    for ax, label in zip(axes[0], shown):
        classes = profile["rows"][label]["classes"]
        names = list(classes)
        ax.barh(range(len(names)), [c["ms"] for c in classes.values()],
                color="#4C72B0", label="measured")  # fmt: skip
        ax.scatter([c["limit ms"] for c in classes.values()], range(len(names)),
                   marker="|", s=300, color="black",
                   label="bytes at bandwidth")  # fmt: skip
        ax.set_title(label, fontsize=9)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0][0].invert_yaxis()
    axes[0][0].legend(fontsize=7, frameon=False)
    figure.supxlabel("ms a decoding step", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, metadata={"Software": None})
    plt.close(figure)


def render() -> str:
    head = "\n\n".join(
        [
            "# Speed and memory",
            "Every figure on this page is read from a benchmark record by "
            "`tools/speed_page.py`, which wrote this page; each table names its "
            "machine, date and command. Benchmarks run our code and the reference "
            "side by side in one process. Records taken on a machine busy with "
            "other work are not published.",
        ]
    )
    parts = [
        head,
        gpu_decoding(),
        gpu_lora(),
        gpu_int8(),
        gpu_run(),
        gpu_calls_bought(),
        decode_profile(),
        nano_training(),
        cpu_threads(),
        cpu_int8(),
        data_pipeline(),
        recipe_data(),
        cpu_resolution(),
        gpu_resolution(),
    ]
    return "\n\n".join(part for part in parts if part) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args()
    page = render()
    if args.check:
        if PAGE.read_text() != page or not CHART.is_file():
            print(
                f"{PAGE.relative_to(ROOT)} or {CHART.relative_to(ROOT)} is out of "
                "date: python tools/speed_page.py"
            )
            return 1
        return 0
    PAGE.write_text(page)
    draw_decoding_chart()
    for newest in decode_profiles()[-1:]:
        draw_decode_profile(json.loads(newest.read_text()), PROFILE_CHART)
    print(f"wrote {PAGE.relative_to(ROOT)} and {CHART.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
