"""Peak memory of loading a full-width PaliGemma-3B checkpoint with `load_pretrained`.

    python benchmarks/load_memory.py /tmp/paligemma-3b-random
    python benchmarks/load_memory.py /tmp/paligemma-fp32 --file-dtype fp32 \\
        --text-layers 6 --load-as bf16

The first makes the checkpoint in the folder once (random weights, Hub layout:
config.json and one model.safetensors), then measures. It is written tensor by tensor,
so making it needs about 1 GB of memory. `--file-dtype` picks the stored dtype (bf16,
as the Hub's `bfloat16` branch, or fp32, as its `main` branch); `--text-layers` keeps
the full widths and fewer decoder layers, so that a float32 file fits a smaller machine;
`--load-as` asks load_pretrained for a dtype (default: as stored).

The loading runs in a fresh subprocess, which then reads every parameter (so that all of
it is really in memory) and reports its peak resident set size (VmHWM) and how the
resident memory splits into file-backed pages (the memory-mapped checkpoint) and
anonymous memory.

Measured on the 2-core, 24 GiB development machine (torch 2.13 CPU, safetensors 0.8):

- bf16 file, full 3B, loaded as stored: file 5.85 GB (2,923,466,480 parameters); RSS
  0.24 GB after the imports; after reading every parameter RSS 6.17 GB, of which 5.94 GB
  file-backed and 0.23 GB anonymous; peak 6.17 GB = the file + 0.32 GB, 1.06 x the file.
- fp32 file, full widths, 6 of 18 decoder layers (`/tmp/pg-fp32 --file-dtype fp32
  --text-layers 6`): file 6.41 GB (1,602,211,568 parameters).
  `--load-as fp32`: peak 6.74 GB = the file + 0.33 GB, 1.05 x the file (after reading:
  6.51 GB file-backed, 0.23 GB anonymous).
  `--load-as bf16`: load_pretrained 6.7 s; peak 9.94 GB = the file + 3.53 GB, 1.55 x the
  file; after loading RSS 3.54 GB (0.10 GB file-backed, 3.43 GB anonymous: the bf16
  copy).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from paligemma_lib.config import PaliGemmaConfig
from paligemma_lib.paligemma import PaliGemmaForConditionalGeneration
from paligemma_lib.weights import SINGLE_FILE

FILE_DTYPES = {"bf16": ("BF16", torch.bfloat16), "fp32": ("F32", torch.float32)}


def make_checkpoint(folder: Path, file_dtype="bf16", text_layers=None, seed=0):
    "config.json + model.safetensors of PaliGemma-3B's widths, random weights"
    config = PaliGemmaConfig()
    if text_layers is not None:
        config.text.num_hidden_layers = text_layers
    with torch.device("meta"):
        model = PaliGemmaForConditionalGeneration(config)
    # the tied LM head appears once
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    code, dtype = FILE_DTYPES[file_dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = itemsize * torch.Size(shape).numel()
        header[name] = {
            "dtype": code,
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
        for shape in shapes.values():
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
            f.write(tensor.view(torch.uint8).numpy().tobytes())
    name = {"bf16": "bfloat16", "fp32": "float32"}[file_dtype]
    hf = {**config.to_hf(), "dtype": name}
    (folder / "config.json").write_text(json.dumps(hf, indent=2))


MEASURE = """
import json, time, torch
from pathlib import Path
from paligemma_lib.weights import load_pretrained

def status():
    lines = Path('/proc/self/status').read_text().splitlines()
    fields = dict(line.split(':', 1) for line in lines)
    keys = ('VmHWM', 'VmRSS', 'RssAnon', 'RssFile')
    return {{k: int(fields[k].split()[0]) * 1024 for k in keys}}

before = status()
start = time.perf_counter()
model = load_pretrained({folder!r}, dtype={dtype!r})
loaded = time.perf_counter() - start
with torch.no_grad():
    for p in model.parameters():
        p.amax()  # read every byte, so the whole model is resident
after = status()
print(json.dumps({{
    'before': before, 'after': after, 'load_s': loaded,
    'dtype': str(next(model.parameters()).dtype),
    'parameters': sum(p.numel() for p in model.parameters()),
}}))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default="/tmp/paligemma-3b-random")
    parser.add_argument("--file-dtype", choices=sorted(FILE_DTYPES), default="bf16")
    parser.add_argument("--text-layers", type=int, default=None)
    parser.add_argument("--load-as", choices=["bf16", "fp32"], default=None)
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    if not (folder / SINGLE_FILE).is_file():
        start = time.perf_counter()
        make_checkpoint(folder, args.file_dtype, args.text_layers)
        print(f"made {folder / SINGLE_FILE} in {time.perf_counter() - start:.0f} s")
    stored = json.loads((folder / "config.json").read_text())["dtype"]
    file_size = (folder / SINGLE_FILE).stat().st_size
    run = subprocess.run(
        [sys.executable, "-c", MEASURE.format(folder=str(folder), dtype=args.load_as)],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    before, after, gb = result["before"], result["after"], 1e9
    print(
        f"file: {file_size / gb:.2f} GB of {stored} "
        f"({result['parameters']:,} parameters), loaded as {result['dtype']}"
    )
    print(
        f"RSS after imports: {before['VmRSS'] / gb:.2f} GB; "
        f"load_pretrained: {result['load_s']:.1f} s"
    )
    print(
        f"after reading every parameter: RSS {after['VmRSS'] / gb:.2f} GB "
        f"(file-backed {after['RssFile'] / gb:.2f} GB, "
        f"anonymous {after['RssAnon'] / gb:.2f} GB)"
    )
    peak = after["VmHWM"]
    print(
        f"peak RSS {peak / gb:.2f} GB = file + {(peak - file_size) / gb:.2f} GB "
        f"({peak / file_size:.2f} x the file)"
    )


if __name__ == "__main__":
    main()
