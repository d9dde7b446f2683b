"""Log-probabilities of the actual next tokens, only where they are used, chunked over tokens.

The lm_head and its full-vocabulary softmax are most of the cost past the decoder, so they run only
on the hidden states that predict a token someone needs: a training step passes its loss tokens
(completion tokens; prompts and environment tokens are skipped), scoring a row passes every token.

The float32 logits of a packed row are [tokens x vocab] (2048 x 49152 x 4 bytes = 400 MB for
SmolLM2), and autograd would keep them, their log_softmax and their gradient alive at once. Here
the lm_head runs on `chunk_size` tokens at a time inside `torch.utils.checkpoint`: forward keeps
only each chunk's inputs, and backward recomputes one chunk's logits at a time, so the peak is one
chunk's logits instead of all of them. Without sampling truncation and with a plain linear lm_head
(the defaults) a chunk is one fused autograd step instead (grpo.trainer.fused_logprobs), with or
without a gradient: the same recompute, with the gradient formed in place in the recomputed logits.

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

    from grpo.transport.batches.batch import SamplingTruncation


def float32_logits(lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [C, H] -> logits [C, V] float32, unrounded; an lm_head that is not a plain linear
    layer (LoRA or quantized) computes as it does and its output is cast."""
    from torch import nn

    if type(lm_head) is not nn.Linear:
        return lm_head(hidden).float()
    return float32_linear(hidden, lm_head.weight, lm_head.bias)


def float32_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """hidden [C, H] @ weight [V, H]^T (+ bias) -> [C, V] float32: each product of the 16-bit
    operands exact, the sums accumulated and kept in float32."""
    import torch

    if weight.dtype == torch.float32:
        return torch.nn.functional.linear(hidden.float(), weight, bias)
    if hidden.is_cuda and hidden.dtype == weight.dtype:
        # cuBLAS multiplies the 16-bit operands, accumulates in float32 and writes float32: the same
        # unrounded logits as the cast below without its float32 copy of the weight (2.5 GB for a
        # 151936 x 4096 head, made per chunk and again in backward's recompute).
        logits = _float32_out_matmul().apply(hidden, weight)
        return logits if bias is None else logits + bias.float()
    # No 16-bit GEMM with a float32 output off CUDA: a float32 copy of the weight per chunk
    # (V x H x 4 bytes, freed after the chunk).
    return torch.nn.functional.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


_FLOAT32_OUT_MATMUL: Any = None


def _float32_out_matmul() -> Any:
    """autograd Function: hidden [C, H] x weight [V, H] (both 16-bit, CUDA) -> [C, V] float32.

    torch's mm with out_dtype (as of 2.13) has no derivative. Backward rounds the float32 gradient of
    the logits to the operands' dtype and multiplies in it (float32 accumulation): the gradients
    bf16 autocast would give, again without a float32 weight."""
    global _FLOAT32_OUT_MATMUL
    if _FLOAT32_OUT_MATMUL is None:
        import torch

        class Float32OutMatmul(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                ctx.save_for_backward(hidden, weight)
                return torch.mm(hidden, weight.t(), out_dtype=torch.float32)

            @staticmethod
            def backward(ctx: Any, grad_logits: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
                hidden, weight = ctx.saved_tensors
                grad = grad_logits.to(hidden.dtype)  # [C, V]
                grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
                grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
                return grad_hidden, grad_weight

        _FLOAT32_OUT_MATMUL = Float32OutMatmul
    return _FLOAT32_OUT_MATMUL


def _chunk_logprobs(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    untempered: bool,
    truncation: SamplingTruncation,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [C, H], targets [C], temperatures [C] -> (logprob [C] float32, entropy [C] float32,
    logprob at temperature 1 [C] float32 when `untempered`, else [0])."""
    import torch

    from grpo.trainer.sampling_truncation import truncated_log_softmax

    raw = float32_logits(lm_head, hidden)  # [C, V]
    log_probs = truncated_log_softmax(raw / temperatures.float().unsqueeze(-1), truncation)
    token_lp = log_probs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        plain_lp = raw.new_zeros(0)
        if untempered:
            plain_lp = torch.log_softmax(raw, dim=-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return token_lp, entropy, plain_lp


def token_logprobs(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    chunk_size: int,
    truncation: SamplingTruncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H] predicts targets [N] at temperatures [N] -> (logprobs [N], entropy [N]).

    Entropy is a metric (no gradient). Logits are divided by each token's sampling temperature and
    truncated as vLLM truncated them (`truncation`: top_k/top_p/min_p), because inference logprobs
    are reported after both.
    """
    lp, entropy, _ = token_logprobs_and_untempered(
        hidden, lm_head, targets, temperatures, chunk_size, untempered=False, truncation=truncation
    )
    return lp, entropy


def token_logprobs_and_untempered(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    chunk_size: int,
    untempered: bool = True,
    truncation: SamplingTruncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_logprobs, plus (when `untempered`) the logprobs at temperature 1 from the same logits,
    without a gradient and without truncation: the teacher term compares the student with teacher
    logprobs, which are scored at temperature 1 with no sampling processor, so the student's must be
    too ([0] when not `untempered`)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from grpo.trainer.fused_logprobs import fused_applicable, fused_chunk_logprobs
    from grpo.transport.batches.batch import SamplingTruncation

    truncation = truncation or SamplingTruncation()

    assert hidden.dim() == 2 and targets.shape == temperatures.shape == hidden.shape[:1]
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    # With or without a gradient, so a policy and its reference (or an earlier pass) that hold the
    # same weights give bitwise the same logprobs: a KL or ratio at exactly 0 and 1, no gradient.
    fused = fused_applicable(lm_head, truncation.is_active)
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    # Equal chunks of at most chunk_size: a short remainder chunk runs the [C, H] x [H, V] product
    # at a fraction of the speed (CPU, 2 cores: 23 GFLOP/s for 192 rows against 68 for 1,024).
    num_tokens = hidden.shape[0]
    num_chunks = max(1, -(-num_tokens // chunk_size))
    even_size = max(1, -(-num_tokens // num_chunks))
    for start in range(0, num_tokens, even_size):
        end = start + even_size
        args = (
            lm_head,
            hidden[start:end],
            targets[start:end],
            temperatures[start:end],
            untempered,
            truncation,
        )
        if fused:
            chunks.append(
                fused_chunk_logprobs(
                    lm_head, hidden[start:end], targets[start:end], temperatures[start:end], untempered
                )
            )
        elif needs_grad:
            chunks.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            chunks.append(_chunk_logprobs(*args))
    if not chunks:  # a one-token row predicts nothing
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty, empty
    lp, entropy, plain = (torch.cat(parts) for parts in zip(*chunks, strict=True))
    return lp, entropy, plain


def every_token_logprobs(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    input_ids: torch.Tensor,
    parent_ids: torch.Tensor,
    temperatures: torch.Tensor,
    chunk_size: int,
    truncation: SamplingTruncation | None = None,
) -> torch.Tensor:
    """hidden [T, H], input_ids [T], parent_ids [T], temperatures [T] -> logprobs [T] aligned with
    input_ids: entry t is log p(input_ids[t] | t's ancestors), predicted from its parent's hidden
    state; 0 where a sequence starts (nothing predicts it). For scoring whole rows; a training step
    computes only its loss tokens (grpo.trainer.packing.LossTokens)."""
    import torch

    predicted = (parent_ids >= 0).nonzero().squeeze(-1)
    lp, _ = token_logprobs(
        hidden[parent_ids[predicted]],
        lm_head,
        input_ids[predicted],
        temperatures[predicted],
        chunk_size,
        truncation,
    )
    out = torch.zeros(input_ids.shape[0], dtype=lp.dtype, device=lp.device)
    return out.index_copy(0, predicted, lp)
