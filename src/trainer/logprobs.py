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

The logits are float32 and unrounded (grpo.trainer.float32_logits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from grpo.transport.batches.batch import SamplingTruncation

GPU_CHUNK_TOKENS = 1024
# On CPU a chunk's [C, V] float32 buffers are fresh memory the kernel maps and zeroes page by page
# (glibc serves blocks over 32 MiB by mmap), and a smaller chunk's stay in cache and in the heap.
# A short-answer step's 1,536 loss tokens x 49,152 vocab, head forward + backward with kept
# probabilities (2 AVX512-BF16 cores, 3 rounds in turns): chunks of 768 tokens 0.67 s and ~150,000
# page faults, 256 0.57-0.59 s, 128 0.54-0.59 s and ~30,000 faults.
CPU_CHUNK_TOKENS = 128


def logprob_chunk_tokens(configured: int | None, on_gpu: bool) -> int:
    """The trainer's `logprob_chunk_size`, its null resolved for the device."""
    if configured is not None:
        return configured
    return GPU_CHUNK_TOKENS if on_gpu else CPU_CHUNK_TOKENS


def _chunk_logprobs(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    untempered: bool,
    truncation: SamplingTruncation,
    kept_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [C, H], targets [C], temperatures [C] -> (logprob [C] float32, entropy [C] float32,
    logprob at temperature 1 [C] float32 when `untempered`, else [0]). `kept_counts` [C]: the
    engine's kept-set sizes (grpo.trainer.sampling_truncation), 0 where it reported none."""
    import torch

    from grpo.trainer.float32_logits import float32_logits
    from grpo.trainer.sampling_truncation import truncated_log_softmax

    raw = float32_logits(lm_head, hidden)  # [C, V]
    log_probs = truncated_log_softmax(raw / temperatures.float().unsqueeze(-1), truncation, kept_counts)
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
    chunk_size: int | None,
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
    chunk_size: int | None,
    untempered: bool = True,
    truncation: SamplingTruncation | None = None,
    keep_probs: bool = False,
    kept_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_logprobs, plus (when `untempered`) the logprobs at temperature 1 from the same logits,
    without a gradient and without truncation: the teacher term compares the student with teacher
    logprobs, which are scored at temperature 1 with no sampling processor, so the student's must be
    too ([0] when not `untempered`). `keep_probs`: the fused path keeps each chunk's probabilities
    for backward instead of recomputing its logits (the caller has the memory for all of them).
    `kept_counts` [N]: the engine's kept-set size of each token (0: none reported), used where
    `truncation` is active."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from grpo.trainer.fused_logprobs import fused_applicable, fused_chunk_logprobs
    from grpo.transport.batches.batch import SamplingTruncation

    truncation = truncation or SamplingTruncation()
    chunk_size = logprob_chunk_tokens(chunk_size, on_gpu=hidden.device.type != "cpu")

    assert hidden.dim() == 2 and targets.shape == temperatures.shape == hidden.shape[:1]
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    # With or without a gradient, so a policy and its reference (or an earlier pass) that hold the
    # same weights give bitwise the same logprobs: a KL or ratio at exactly 0 and 1, no gradient.
    fused = fused_applicable(lm_head, truncation.is_active)
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    # Equal chunks of at most chunk_size: a remainder of a few rows would stream the whole
    # [H, V] weight for little work.
    num_tokens = hidden.shape[0]
    num_chunks = max(1, -(-num_tokens // chunk_size))
    even_size = max(1, -(-num_tokens // num_chunks))
    for start in range(0, num_tokens, even_size):
        end = start + even_size
        hidden_chunk, target_chunk, temperature_chunk = (
            hidden[start:end],
            targets[start:end],
            temperatures[start:end],
        )
        if fused:
            chunks.append(
                fused_chunk_logprobs(
                    lm_head,
                    hidden_chunk,
                    target_chunk,
                    temperature_chunk,
                    untempered,
                    keep_probs=keep_probs and needs_grad,
                )
            )
            continue
        counts_chunk = None if kept_counts is None else kept_counts[start:end]
        args = (lm_head, hidden_chunk, target_chunk, temperature_chunk, untempered, truncation, counts_chunk)
        if needs_grad:
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
    chunk_size: int | None,
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
