"""The dtype the vLLM engine runs in on this device, and the dtypes refused on it.

vLLM's CUDA LoRA kernels (punica/triton) take float16 and bfloat16 weights only, so a float32
engine serving LoRA adapters on a GPU dies at start. On CPU float32 is what makes the co-located
trainer (which computes in the engine's dtype, on the engine's own weights) and the engine agree
to ~1e-8 in logprobs instead of ~2e-3 in bfloat16. `dtype: float32_on_cpu` asks for both: float32
on CPU, bfloat16 on a GPU, so one config runs on either.

`dtype: auto` is vLLM's choice (16 bits for a 16-bit or float32 checkpoint) on a GPU, and float32 on
a CPU unless the weights are quantized. A 16-bit CPU engine is faster per token where the CPU
multiplies bf16 natively (AVX512-BF16, AMX), but it learns less per step: a LoRA policy served as
one merged weight is rounded to the base weight's 16-bit grid, which drops every element of the
update below half a step of that grid (benchmarks/README.md, "Learning per step"), and without
native bf16 (AVX2) 16-bit matmuls are emulated, about 80x slower than float32.
"""

from __future__ import annotations

from grpo.config.inference import InferenceConfig
from grpo.utils.device import cuda_present


def resolve_engine_dtype(cfg: InferenceConfig, on_cuda: bool) -> str:
    """The value of vLLM's --dtype for `cfg` on a CUDA device (`on_cuda`) or the CPU."""
    if cfg.dtype == "float32_on_cpu":
        return "bfloat16" if on_cuda else "float32"
    # Quantized weights are dequantized to 16 bits by their kernels (a float32 engine is refused
    # with them), so auto stays vLLM's there.
    if cfg.dtype == "auto" and not on_cuda and cfg.quantization is None:
        return "float32"
    return cfg.dtype


def merging_is_exact(cfg: InferenceConfig, on_cuda: bool) -> bool:
    """Whether the engine can serve base + scaling * B @ A as one merged weight that is the policy
    the trainer trains: only in float32. A 16-bit merged weight is rounded to the base weight's own
    grid, so every element of the update below half a step of it is lost (bfloat16 at |w| ~ 0.03:
    6e-5, more than a LoRA update makes in its first steps at lr 1e-4) and the engine keeps
    sampling an older policy than the one trained."""
    return resolve_engine_dtype(cfg, on_cuda) == "float32"


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
