# Hand-written, not exported from a notebook.
"""Nominal memory bandwidth of the GPUs our benchmarks meet, from the vendors' data
sheets (bytes per second), by the name `torch.cuda.get_device_name()` gives."""

NOMINAL = {  # most specific first: "H100 PCIe" before "H100"
    "H200": 4.8e12,  # SXM and NVL alike
    "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12,
    "H100": 3.35e12,  # "NVIDIA H100 80GB HBM3": SXM
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100": 1.555e12,  # 40 GB
    "L4": 0.3e12,
    "A10G": 0.6e12,
    "T4": 0.32e12,
}


def nominal_bandwidth(device_name: str) -> float:
    "The data sheet's bandwidth for a device name; an error names the way out"
    for key, value in NOMINAL.items():
        if key in device_name:
            return value
    raise SystemExit(
        f"no nominal bandwidth known for {device_name!r}: pass --bandwidth BYTES_PER_S"
        " from its data sheet"
    )
