"""The one way grpo asks about CUDA devices before vLLM has started: without initialising CUDA here.

vLLM starts its engine core (and workers) with fork unless told otherwise, and switches to spawn
only when `torch.cuda.is_initialized()`. `torch.cuda.is_available()` does neither: it calls
`cudaGetDeviceCount` (torch's `_cuda_getDeviceCount`), which initialises the driver and registers
torch's fork handler without marking CUDA initialised, so vLLM still forks, and the forked child's
first CUDA call raises "Cannot re-initialize CUDA in forked subprocess". `torch.cuda.device_count()`
counts through NVML instead (it falls back to the CUDA runtime only when NVML fails), which leaves
this process's CUDA untouched. Facts only CUDA can give (memory, name) are asked in a forked child.

Where grpo starts vLLM on a CUDA machine it also asks for spawn
(grpo.inference.server_args.server_env), so even the NVML fallback cannot break the engine.
`tests/utils/test_device.py` runs every entry point up to vLLM's engine start with torch's CUDA
calls recorded and fails on any that would poison a fork.
"""

from __future__ import annotations

from dataclasses import dataclass


def num_cuda_devices() -> int:
    """CUDA devices this process may use (CUDA_VISIBLE_DEVICES applied), counted through NVML."""
    import torch

    return int(torch.cuda.device_count())


def cuda_present() -> bool:
    """Whether a CUDA device is visible; safe before vLLM forks (see the module doc)."""
    return num_cuda_devices() > 0


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 (and float16) matrices natively (AVX512-BF16 or AMX, as
    oneDNN reports it). Without, torch and vLLM-CPU emulate 16-bit matmuls: on a 2-core AVX2 EPYC a
    [1024, 576] x [576, 1536] matmul ran at 1.3 GFLOP/s in bf16 or fp16 against 105 in float32."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class CudaDeviceFacts:
    index: int
    name: str
    total_bytes: int


def _facts_here() -> CudaDeviceFacts:
    import torch

    index = torch.cuda.current_device()
    _free, total = torch.cuda.mem_get_info(index)
    return CudaDeviceFacts(index=index, name=torch.cuda.get_device_name(index), total_bytes=int(total))


def cuda_device_facts() -> CudaDeviceFacts:
    """The current CUDA device's index, name and total memory. Unless CUDA is already initialised
    here, they are read in a forked child that exits afterwards, so this process stays forkable
    (vLLM reads device properties the same way). Where NVML is missing, device_count() has already
    asked the CUDA runtime, and that child fails with torch's "Cannot re-initialize CUDA in forked
    subprocess"."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    if torch.cuda.is_initialized():
        return _facts_here()
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(_facts_here).result()
