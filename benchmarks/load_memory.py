"""Peak memory of loading a full-size PaliGemma-3B checkpoint (random weights, bfloat16) with `load_pretrained`.

    python benchmarks/load_memory.py /tmp/paligemma-3b-random     # makes the checkpoint there once, then measures

The checkpoint (config.json + one 5.9 GB model.safetensors in the Hub layout) is written tensor by tensor, so
making it needs about 1 GB of memory. The loading runs in a fresh subprocess, which then reads every parameter
(so that all of it is really in memory) and reports its peak resident set size (VmHWM) and how the resident
memory splits into file-backed pages (the memory-mapped checkpoint) and anonymous memory (everything else).

Measured on the 2-core, 24 GiB development machine (torch 2.13 CPU, safetensors 0.8): file 5.85 GB
(2,923,466,480 bf16 parameters); RSS 0.24 GB after the imports; load_pretrained 1.1 s (the pages come in
when touched); after reading every parameter RSS 6.17 GB, of which 5.94 GB file-backed (the mapped checkpoint
and the shared libraries) and 0.23 GB anonymous; peak RSS 6.17 GB = the file + 0.32 GB, 1.06 x the file.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from paligemma_lib.config import PaliGemmaConfig
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.weights import SINGLE_FILE


def make_checkpoint(folder: Path, seed: int = 0):
    "config.json + model.safetensors of PaliGemma-3B with random bf16 weights, written one tensor at a time"
    config = PaliGemmaConfig()
    with torch.device("meta"):
        model = PaliGemmaForConditionalGeneration(config)
    shapes = {
        name: list(p.shape) for name, p in model.named_parameters()
    }  # the tied LM head appears once
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = 2 * torch.Size(shape).numel()
        header[name] = {
            "dtype": "BF16",
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    with open(folder / SINGLE_FILE, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, shape in shapes.items():
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            f.write(tensor.view(torch.uint8).numpy().tobytes())
    (folder / "config.json").write_text(
        json.dumps({**config.to_hf(), "dtype": "bfloat16"}, indent=2)
    )


MEASURE = """
import json, time, torch
from pathlib import Path
from paligemma_lib.weights import load_pretrained

def status():
    fields = dict(line.split(':', 1) for line in Path('/proc/self/status').read_text().splitlines())
    return {{k: int(fields[k].split()[0]) * 1024 for k in ('VmHWM', 'VmRSS', 'RssAnon', 'RssFile')}}

before = status()
start = time.perf_counter()
model = load_pretrained({folder!r})
loaded = time.perf_counter() - start
with torch.no_grad():
    for p in model.parameters():
        p.amax()  # read every byte, so the whole model is resident
after = status()
print(json.dumps({{'before': before, 'after': after, 'load_s': loaded, 'dtype': str(next(model.parameters()).dtype),
                  'parameters': sum(p.numel() for p in model.parameters())}}))
"""


def main(folder: str):
    folder = Path(folder)
    if not (folder / SINGLE_FILE).is_file():
        start = time.perf_counter()
        make_checkpoint(folder)
        print(f"made {folder / SINGLE_FILE} in {time.perf_counter() - start:.0f} s")
    file_size = (folder / SINGLE_FILE).stat().st_size
    run = subprocess.run(
        [sys.executable, "-c", MEASURE.format(folder=str(folder))],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    gb = 1e9
    print(
        f"file: {file_size / gb:.2f} GB ({result['parameters']:,} parameters in {result['dtype']})"
    )
    print(
        f"RSS after imports: {result['before']['VmRSS'] / gb:.2f} GB; load_pretrained: {result['load_s']:.1f} s"
    )
    print(
        f"after reading every parameter: RSS {result['after']['VmRSS'] / gb:.2f} GB "
        f"(file-backed {result['after']['RssFile'] / gb:.2f} GB, anonymous {result['after']['RssAnon'] / gb:.2f} GB)"
    )
    peak = result["after"]["VmHWM"]
    print(
        f"peak RSS {peak / gb:.2f} GB = file + {(peak - file_size) / gb:.2f} GB ({peak / file_size:.2f} x the file)"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/paligemma-3b-random")
