"""The device's peak FLOP/s in the trainer's matmul dtype: the denominator of the `mfu` metric.

GPUs: the dense 16-bit tensor-core figure of the vendor's data sheet, looked up by device name (a
probe on a GPU reaches 70-80% of it, which would flatter MFU). CPUs, GPUs not in the table and
float32 compute: a short matmul probe in that dtype on the trainer's device, once per process, so
MFU is relative to what this machine's matmul kernel does at its best on this many threads.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Dense bf16/fp16 tensor-core TFLOP/s (no sparsity), from NVIDIA's data sheets. Longer names first:
# the first entry whose key is in the device name wins.
GPU_PEAK_16BIT_TFLOPS: dict[str, float] = {
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,
    "H800": 989.4,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.1,
    "L40": 181.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "RTX 4090": 165.2,
    "RTX 3090": 71.0,
}


def table_peak_tflops(device_name: str) -> float | None:
    for key, tflops in GPU_PEAK_16BIT_TFLOPS.items():
        if key in device_name:
            return tflops
    return None


# Long enough that one slow moment (another process's burst, a thread waking late) is outvoted by
# many good ones: with 3 products of ~2 ms each the probe sometimes read half the machine's rate.
PROBE_SECONDS = 0.25
MIN_TIMED_PRODUCTS = 3


@functools.cache
def _probe_flops(device_type: str, dtype_name: str, num_threads: int) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    device = torch.device(device_type)
    # Big enough that the kernel, not the call, is timed; the fastest of many is the peak.
    size = 4096 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)  # the first call pays for kernel selection and page faults
    best = float("inf")
    num_timed = 0
    deadline = time.perf_counter() + PROBE_SECONDS
    while num_timed < MIN_TIMED_PRODUCTS or time.perf_counter() < deadline:
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
        num_timed += 1
    return 2.0 * size**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(FLOP/s, where the figure comes from: "spec" or "probe") of one device computing in `dtype`."""
    import torch

    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        if (tflops := table_peak_tflops(name)) is not None:
            return tflops * 1e12, "spec"
    dtype_name = str(dtype).removeprefix("torch.")
    return _probe_flops(device.type, dtype_name, torch.get_num_threads()), "probe"


def describe_peak(device: torch.device, dtype: torch.dtype) -> str:
    """The peak `mfu` divides by and where it comes from, in words."""
    peak, source = peak_flops(device, dtype)
    where = "data sheet" if source == "spec" else f"matmul probe on {device.type}"
    return f"{str(dtype).removeprefix('torch.')} peak {peak / 1e9:,.0f} GFLOP/s ({where})"
