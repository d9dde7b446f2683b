"""vLLM's CPU engine with a float32 head: the lm_head's float32 copy made once, not every step.

grpo serves with `head_dtype: float32` (grpo.inference.server_args) so the engine's logprobs come
from float32 logits, as the trainer's do. On CUDA vLLM multiplies the bf16 weight into a float32
output; elsewhere it casts the whole lm_head weight to float32 on every forward: for
SmolLM2-135M (49,152 x 576) a 113 MB copy, 37 ms of a ~290 ms decode step of 64 sequences on
two cores (torch profiler, 0.88 s of a 6.9 s generation round of 8 prompts x 8 completions). Here
the copy is kept beside the weight and rebuilt when the weights change: every update path of
the worker extension ends in `forget_float32_heads`, and a weight replaced by another tensor
(another storage) is noticed at the next forward. The kept copy costs vocab x hidden x 4 bytes
of host memory for as long as the engine runs, the size of the transient copy it replaces. The
product itself goes to oneDNN (grpo.utils.cpu_float32_gemm): half the time of torch's default
float32 GEMM at 64 rows on the machines measured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CACHE_ATTRIBUTE = "_grpo_float32_weight"
"""The lm_head module attribute holding (source data_ptr, float32 copy)."""


def float32_weight(lm_head: torch.nn.Module) -> torch.Tensor:
    """`lm_head.weight` in float32, copied once per weight version (see the module docstring)."""
    import torch

    weight: torch.Tensor = lm_head.weight
    if weight.dtype == torch.float32:
        return weight
    cached: tuple[int, torch.Tensor] | None = lm_head.__dict__.get(CACHE_ATTRIBUTE)
    if cached is not None and cached[0] == weight.data_ptr():
        return cached[1]
    copy = weight.detach().to(torch.float32)
    lm_head.__dict__[CACHE_ATTRIBUTE] = (weight.data_ptr(), copy)
    return copy


def forget_float32_heads(model: torch.nn.Module) -> int:
    """Drop every kept float32 head copy of `model` (its weights changed); returns how many."""
    num_dropped = 0
    for module in model.modules():
        if module.__dict__.pop(CACHE_ATTRIBUTE, None) is not None:
            num_dropped += 1
    return num_dropped


def keep_float32_cpu_head() -> None:
    """On CPU, run a float32 head from a kept float32 copy of the lm_head weight.

    Wraps vLLM's LogitsProcessor._apply_head; the CUDA/ROCm path (a float32-output GEMM on the bf16
    weight), a head in the model's dtype and a quantized lm_head go to vLLM's own code. Must run in
    the engine worker before it serves; idempotent; a no-op off CPU.
    """
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    from grpo.utils.cpu_float32_gemm import cpu_float32_linear

    if not current_platform.is_cpu():
        return
    original = LogitsProcessor._apply_head
    if getattr(original, "_grpo_keeps_float32_head", False):
        return

    def apply_head(
        processor: Any,
        lm_head: torch.nn.Module,
        hidden_states: torch.Tensor,
        embedding_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        head_dtype = processor.head_dtype
        plain = isinstance(
            getattr(lm_head, "quant_method", None), (UnquantizedEmbeddingMethod, UnquantizedLinearMethod)
        )
        if head_dtype != torch.float32 or hidden_states.dtype == torch.float32 or not plain:
            logits: torch.Tensor = original(processor, lm_head, hidden_states, embedding_bias)
            return logits
        bias = embedding_bias.to(torch.float32) if embedding_bias is not None else None
        return cpu_float32_linear(hidden_states.to(torch.float32), float32_weight(lm_head), bias)

    apply_head._grpo_keeps_float32_head = True  # type: ignore[attr-defined]
    LogitsProcessor._apply_head = apply_head
