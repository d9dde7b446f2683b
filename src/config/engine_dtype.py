"""The dtype the vLLM engine runs in on this device, and the dtypes refused on it.

vLLM's CUDA LoRA kernels (punica/triton) take float16 and bfloat16 weights only, so a float32
engine serving LoRA adapters on a GPU dies at start. On CPU float32 is what makes the co-located
trainer (which computes in the engine's dtype, on the engine's own weights) and the engine agree
to ~1e-8 in logprobs instead of ~2e-3 in bfloat16. `dtype: float32_on_cpu` asks for both: float32
on CPU, bfloat16 on a GPU, so one config (configs/demo) runs on either.
"""

from __future__ import annotations

from grpo.config.inference import InferenceConfig
from grpo.utils.device import cuda_present


def resolve_engine_dtype(cfg: InferenceConfig, on_cuda: bool) -> str:
    """The value of vLLM's --dtype for `cfg` on a CUDA device (`on_cuda`) or the CPU."""
    if cfg.dtype == "float32_on_cpu":
        return "bfloat16" if on_cuda else "float32"
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
