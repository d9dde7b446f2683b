"""float32 logits from 16-bit hidden states and lm_head weights, unrounded.

The logits are float32 from 16-bit hidden states and weights (each product exact, the sum
accumulated and kept in float32) rather than rounded to bf16 by a bf16 matmul: a bf16 logit of
SmolLM2's size (10-30) is off by up to 1/16, which alone gives a mismatch KL near 1e-3. vLLM is
started with `head_dtype: float32` for the same reason (grpo.inference.server_args), so both sides
compute the same unrounded logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


def float32_logits(lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [C, H] -> logits [C, V] float32, unrounded; an lm_head that is not a plain linear
    layer (LoRA or quantized) computes as it does and its output is cast."""
    from torch import nn

    if type(lm_head) is not nn.Linear:
        return lm_head(hidden).float()
    return float32_linear(hidden, lm_head.weight, lm_head.bias)


def float32_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """hidden [C, H] @ weight [V, H]^T (+ bias) -> [C, V] float32: each product of the 16-bit
    operands exact, the sums accumulated and kept in float32. Backward of 16-bit operands multiplies
    in their dtype (grads_in_16_bit)."""
    import torch

    if weight.dtype == torch.float32:
        return torch.nn.functional.linear(hidden.float(), weight, bias)
    if grads_in_16_bit(hidden, weight):
        logits = _float32_out_matmul().apply(hidden, weight)
        return logits if bias is None else logits + bias.float()
    return torch.nn.functional.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


def grads_in_16_bit(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the gradients of float32_linear's 16-bit operands are computed in that dtype: the
    float32 gradient of the logits rounded to it, then multiplied with float32 accumulation, as bf16
    autocast and every 16-bit layer below the head do. Its float32 alternative costs, per product, a
    float32 copy of the weight and a float32 GEMM (on a CPU with native bf16, ~2.5x slower)."""
    import torch

    return weight.dtype != torch.float32 and hidden.dtype == weight.dtype


_FLOAT32_OUT_MATMUL: Any = None

FLOAT32_COPY_ATTRIBUTE = "_grpo_float32_copy"
"""The frozen weight's attribute holding (data_ptr, version, float32 copy)."""


def float32_copy(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in float32 for a CPU product. A frozen weight (LoRA's lm_head) is copied once and
    the copy kept on it, for as long as its storage and version stay: a 49,152 x 576 copy takes
    ~40 ms, and each of a step's logit chunks made its own (2 AVX512-BF16 cores: a short-answer
    step's head forward + backward 0.74-0.78 s -> 0.66-0.71 s). A trained weight changes every step
    and is copied per call."""
    import torch

    if weight.requires_grad:
        return weight.float()
    key = (weight.data_ptr(), weight._version)
    kept: tuple[int, int, torch.Tensor] | None = weight.__dict__.get(FLOAT32_COPY_ATTRIBUTE)
    if kept is not None and kept[:2] == key:
        return kept[2]
    copy = weight.detach().to(torch.float32)
    setattr(weight, FLOAT32_COPY_ATTRIBUTE, (*key, copy))
    return copy


def _float32_out_matmul() -> Any:
    """autograd Function: hidden [C, H] x weight [V, H] (both 16-bit) -> [C, V] float32.

    Forward: cuBLAS multiplies the 16-bit operands, accumulates in float32 and writes float32 (torch's
    mm with out_dtype), with no float32 copy of the weight (2.5 GB for a 151936 x 4096 head). Off
    CUDA there is no such GEMM (torch 2.13's CPU mm has no out_dtype), so the operands are copied to
    float32 (and on CPU multiplied by oneDNN, grpo.utils.cpu_float32_gemm): the same unrounded
    logits. torch's mm with out_dtype has no derivative, and backward multiplies in 16 bit either
    way (grads_in_16_bit)."""
    global _FLOAT32_OUT_MATMUL
    if _FLOAT32_OUT_MATMUL is None:
        import torch

        from grpo.utils.cpu_float32_gemm import cpu_float32_linear

        class Float32OutMatmul(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                ctx.save_for_backward(hidden, weight)
                if hidden.is_cuda:
                    return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
                if hidden.device.type == "cpu":
                    return cpu_float32_linear(hidden.float(), float32_copy(weight))
                return hidden.float() @ weight.float().t()

            @staticmethod
            def backward(ctx: Any, grad_logits: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
                hidden, weight = ctx.saved_tensors
                grad = grad_logits.to(hidden.dtype)  # [C, V]
                grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
                grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
                return grad_hidden, grad_weight

        _FLOAT32_OUT_MATMUL = Float32OutMatmul
    return _FLOAT32_OUT_MATMUL
