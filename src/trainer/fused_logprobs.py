"""One chunk's lm_head, log-softmax and target gather as a single autograd step.

The generic path (grpo.trainer.logprobs) checkpoints `_chunk_logprobs`: backward runs the chunk's
forward again (logits, log-softmax, gather, and the entropy metric) and then autograd's backward of
each op, which for the gather scatters into a fresh zero [C, V] tensor and for the log-softmax makes
another. With no sampling truncation the gradient has a closed form,

    d logprob(target) / d scaled = onehot(target) - softmax(scaled),     scaled = logits / T,

so backward here recomputes only the logits and turns that one [C, V] float32 buffer into the
gradient in place (divide, subtract the saved log-sum-exp, exp, scale, add at the targets, divide by
T). Forward computes the log-probabilities in log_softmax's order (scaled - max - log sum exp), up
to float32 rounding the generic path's values. On 2 AVX2 cores, lm_head and log-softmax forward and
backward over a short-answer step's 1,216 loss tokens x 49,152 vocab took 2.71 s against 3.66 (with
the even chunks of grpo.trainer.logprobs), and the whole trainer step 12.1 s against 15.7-16.2.

With `keep_probs` forward keeps each chunk's float32 probabilities [C, V] for backward instead of
recomputing the logits there: two lm_head products per chunk instead of three, for C x V x 4 bytes
held from forward to backward (the trainer asks for it only where its activation budget has that
room, grpo.trainer.hf.checkpointing). On 2 AVX2 cores a short-answer step's two 768-token chunks spent
1.1 s of 15 s recomputing their logits.

Used, with or without a gradient, when the lm_head is a plain linear layer and vLLM sampled without
top_k/top_p/min_p (the defaults); a LoRA or quantized lm_head, or a truncated distribution, takes
the generic path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

_FUSED: Any = None


def fused_applicable(lm_head: nn.Module, truncation_active: bool) -> bool:
    from torch import nn

    return type(lm_head) is nn.Linear and not truncation_active


def fused_chunk_logprobs(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    untempered: bool,
    keep_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [C, H], targets [C], temperatures [C] -> (logprob [C] float32 with gradient, entropy
    [C] float32, logprob at temperature 1 [C] float32 when `untempered`, else [0]); the last two
    carry no gradient, as in the generic path. `keep_probs`: backward reads the probabilities kept
    from forward rather than recomputing the logits."""
    from torch import nn

    assert isinstance(lm_head, nn.Linear)
    lp, entropy, plain = _fused_function().apply(
        hidden, lm_head.weight, lm_head.bias, targets, temperatures, untempered, keep_probs
    )
    return lp, entropy, plain


def _fused_function() -> Any:
    global _FUSED
    if _FUSED is None:
        _FUSED = _build()
    return _FUSED


def _build() -> Any:
    import torch
    from torch.autograd.function import once_differentiable

    from grpo.trainer.float32_logits import float32_linear

    class FusedTokenLogprobs(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any,
            hidden: torch.Tensor,
            weight: torch.Tensor,
            bias: torch.Tensor | None,
            targets: torch.Tensor,
            temperatures: torch.Tensor,
            untempered: bool,
            keep_probs: bool,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            index = targets.long().unsqueeze(-1)  # [C, 1]
            logits = float32_linear(hidden, weight, bias)  # [C, V]
            plain = logits.new_zeros(0)
            if untempered:
                plain = logits.gather(-1, index).squeeze(-1) - torch.logsumexp(logits, dim=-1)
            # log_softmax's own order (x - max - log sum exp), in place, with one exp pass that also
            # gives the probabilities the entropy needs.
            shifted = logits.div_(temperatures.float().unsqueeze(-1))
            row_max = shifted.amax(dim=-1, keepdim=True)  # [C, 1]
            shifted.sub_(row_max)
            probs = shifted.exp()  # [C, V], unnormalised
            sum_exp = probs.sum(dim=-1, keepdim=True)
            log_sum = sum_exp.log()
            log_probs = shifted.sub_(log_sum)
            token_lp = log_probs.gather(-1, index).squeeze(-1)
            probs.div_(sum_exp)
            if keep_probs:
                # Row-wise dot products: the kept probabilities stay as they are, no [C, V] product.
                entropy = -torch.bmm(probs.unsqueeze(1), log_probs.unsqueeze(2)).view(-1)
                ctx.save_for_backward(hidden, weight, bias, index, temperatures, probs)
            else:
                entropy = -(probs.mul_(log_probs)).sum(-1)
                log_sum_exp = (row_max + log_sum).squeeze(-1)  # [C]
                ctx.save_for_backward(hidden, weight, bias, index, temperatures, log_sum_exp)
            ctx.keep_probs = keep_probs
            ctx.mark_non_differentiable(entropy, plain)
            return token_lp, entropy, plain

        @staticmethod
        @once_differentiable
        def backward(
            ctx: Any, grad_lp: torch.Tensor, _grad_entropy: Any, _grad_plain: Any
        ) -> tuple[torch.Tensor | None, ...]:
            hidden, weight, bias, index, temperatures, saved = ctx.saved_tensors
            inv_scale = temperatures.float().unsqueeze(-1)  # [C, 1]
            with torch.no_grad():
                if ctx.keep_probs:
                    # Consumed in place: once_differentiable, and the trainer never backpropagates a
                    # graph twice.
                    grad = saved  # [C, V] softmax(scaled), becomes d loss / d logits
                else:
                    grad = float32_linear(hidden, weight, bias)  # [C, V], becomes d loss / d logits
                    grad.div_(inv_scale).sub_(saved.unsqueeze(-1)).exp_()  # softmax(scaled)
                upstream = grad_lp.float().unsqueeze(-1)  # [C, 1]
                grad.mul_(-upstream)
                grad.scatter_add_(-1, index, upstream)
                grad.div_(inv_scale)
                grad_hidden, grad_weight, grad_bias = _linear_grads(
                    grad, hidden, weight, bias, ctx.needs_input_grad[:3]
                )
            return grad_hidden, grad_weight, grad_bias, None, None, None, None

    return FusedTokenLogprobs


def _linear_grads(
    grad_logits: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    needs: tuple[bool, ...],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of float32_linear's inputs from grad_logits [C, V] float32, in the arithmetic
    float32_linear's own autograd would use: 16-bit operands multiply in their dtype with the float32
    gradient rounded to it (grads_in_16_bit), float32 ones in float32."""
    from grpo.trainer.float32_logits import grads_in_16_bit

    in_16_bit = grads_in_16_bit(hidden, weight)
    grad = grad_logits.to(hidden.dtype) if in_16_bit else grad_logits
    w = weight if in_16_bit else weight.float()
    grad_hidden = (grad @ w).to(hidden.dtype) if needs[0] else None
    grad_weight = None
    if needs[1]:
        x = hidden if in_16_bit else hidden.float()
        grad_weight = (grad.t() @ x).to(weight.dtype)
    grad_bias = grad_logits.sum(0).to(bias.dtype) if bias is not None and needs[2] else None
    return grad_hidden, grad_weight, grad_bias
