"""The dtype the vLLM engine runs in on this device, and the dtypes refused on it.

vLLM's CUDA LoRA kernels (punica/triton) take float16 and bfloat16 weights only, so a float32
engine serving LoRA adapters on a GPU dies at start. On CPU float32 is what makes the co-located
trainer (which computes in the engine's dtype, on the engine's own weights) and the engine agree
to ~1e-8 in logprobs instead of ~2e-3 in bfloat16. `dtype: float32_on_cpu` asks for both: float32
on CPU, bfloat16 on a GPU, so one config (configs/demo) runs on either.

`dtype: auto` is vLLM's choice (16 bits for a 16-bit or float32 checkpoint) except on a CPU without
native 16-bit matmuls (no AVX512-BF16 or AMX; grpo.utils.device.cpu_has_native_bf16), where the
engine and a co-located trainer on its weights would compute 16-bit matmuls emulated, about 80x
slower than float32 on a 2-core AVX2 machine (a default co-located LoRA step went from ~10 s on an
AVX512-BF16 machine to ~210 s there): auto is float32 on such a CPU, unless the weights are quantized.
"""

from __future__ import annotations

from grpo.config.inference import InferenceConfig
from grpo.utils.device import cuda_present


def resolve_engine_dtype(cfg: InferenceConfig, on_cuda: bool, cpu_bf16: bool | None = None) -> str:
    """The value of vLLM's --dtype for `cfg` on a CUDA device (`on_cuda`) or the CPU; `cpu_bf16`:
    whether the CPU has native 16-bit matmuls (None: ask this one)."""
    if cfg.dtype == "float32_on_cpu":
        return "bfloat16" if on_cuda else "float32"
    # Quantized weights are dequantized to 16 bits by their kernels whatever the CPU (a float32
    # engine is refused with them), so auto stays vLLM's there.
    if cfg.dtype == "auto" and not on_cuda and cfg.quantization is None:
        if cpu_bf16 is None:
            from grpo.utils.device import cpu_has_native_bf16

            cpu_bf16 = cpu_has_native_bf16()
        if not cpu_bf16:
            return "float32"
    return cfg.dtype


def dtype_problems(cfg: InferenceConfig, on_cuda: bool | None = None) -> list[str]:
    """One line naming infer dtype and the fix when the engine cannot run it here; else [].
    `on_cuda` defaults to whether a CUDA device is visible."""
    if cfg.dtype != "float32" or not cfg.enable_lora:
        return []
    if on_cuda is None:
        on_cuda = cuda_present()
    if not on_cuda:
        return []
    return [
        "infer dtype float32 with enable_lora on a GPU: vLLM's CUDA LoRA kernels take float16/bfloat16 only; "
        "set dtype: bfloat16 (or float32_on_cpu: float32 on CPU, bfloat16 on a GPU)"
    ]
