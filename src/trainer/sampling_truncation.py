"""The trainer's logits truncated as vLLM truncated them when it sampled (top_k, top_p, min_p).

vLLM (v1 sampler, with grpo's `--logprobs-mode processed_logprobs`) reports each token's logprob
under the distribution it sampled from: logits / temperature, then min_p, then top_k, then top_p,
then a log-softmax over the tokens left. The trainer computes its logprobs the same way, or every
importance ratio would compare a truncated distribution with a full one. Each rule as vLLM 0.32's
CPU engine applies it (vllm/v1/sample/logits_processor/builtin.py MinPLogitsProcessor,
ops/topk_topp_sampler.py apply_top_k_top_p_pytorch):

  min_p   drop a token whose probability is below min_p x the largest probability
  top_k   drop a token whose logit is below the k-th largest (ties with the k-th stay)
  top_p   sort ascending, cumulative softmax; drop the tokens whose cumulative mass is <= 1 - top_p
          (formed in float32), never the most likely one

An engine on CUDA keeps by other boundary and tie rules (grpo.trainer.cuda_sampling_truncation);
`truncation.engine_sampler` says whose rules apply.

When the engine reports how many tokens it kept at each sampled position (`kept_counts`, a grpo CPU
engine's per-token count, grpo.inference.vllm_compat.kept_counts), the trainer keeps exactly that
many of its own most likely tokens there instead of reproducing the rules: the kept set's size is
then the engine's, wherever the rules' boundary would have fallen. Tokens tied at the boundary are
kept lowest token id first (a stable descending sort), so the set is a deterministic function of the
logits and the count. A count of 0 (a token without one: a prompt token, an older batch, another
engine) falls back to the rules.

The kept set is a step function of the logits, so it is chosen without gradient; the log-softmax
over it is differentiated as usual. A sampled token the current policy no longer keeps (the policy
moved since vLLM sampled it) has probability 0: its logprob is OUTSIDE_LOGPROB instead of -inf, which
gives it a ratio of 0 (the token masks drop it) without an inf that would turn the loss NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from grpo.transport.batches.batch import SamplingTruncation

OUTSIDE_LOGPROB = -1e4
"""The logprob of a token outside the kept set: exp() of it is 0 in float32, and it is finite."""


def kept_tokens(
    scaled_logits: torch.Tensor, truncation: SamplingTruncation, kept_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, V] logits already divided by the temperature -> [N, V] bool, the tokens vLLM keeps: the
    `kept_counts[i]` most likely ones where the engine reported a count (> 0), else by the rules of
    the engine's sampler (truncation.engine_sampler)."""
    keep = kept_by_rules(scaled_logits, truncation)
    if kept_counts is None:
        return keep
    counted = kept_counts > 0
    if not bool(counted.any()):
        return keep
    keep[counted] = kept_by_count(scaled_logits[counted], kept_counts[counted])
    return keep


def kept_by_count(scaled_logits: torch.Tensor, kept_counts: torch.Tensor) -> torch.Tensor:
    """[N, V] logits, [N] counts >= 1 -> [N, V] bool: the kept_counts[i] most likely tokens of row i,
    ties lowest token id first."""
    import torch

    with torch.no_grad():
        order = scaled_logits.float().sort(dim=-1, descending=True, stable=True).indices
        ranks = torch.empty_like(order).scatter_(
            -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
        )
        return ranks < kept_counts.to(ranks.dtype).unsqueeze(-1)


def kept_by_rules(scaled_logits: torch.Tensor, truncation: SamplingTruncation) -> torch.Tensor:
    """[N, V] logits already divided by the temperature -> [N, V] bool, the tokens vLLM keeps, by
    the rules of the engine's sampler (truncation.engine_sampler)."""
    import torch

    from grpo.trainer import cuda_sampling_truncation as cuda

    on_cuda = truncation.engine_sampler != "cpu"
    with torch.no_grad():
        logits = scaled_logits.float()
        keep = torch.ones_like(logits, dtype=torch.bool)
        if truncation.min_p > 0.0:
            if truncation.engine_sampler == "cuda_v2":
                keep &= cuda.min_p_kept_on_logits(logits, truncation.min_p)
            else:
                probs = logits.softmax(dim=-1)
                keep &= probs >= probs.amax(dim=-1, keepdim=True) * truncation.min_p
            logits = logits.masked_fill(~keep, -float("inf"))
        num_vocab = logits.shape[-1]
        # rows the CUDA kernel cuts by top_k, then top_p from the top_k pivot; the others by top_p alone
        cut_by_top_k = torch.zeros_like(keep[:, :1])
        if 0 < truncation.top_k < num_vocab:
            cut_by_top_k = torch.isfinite(logits).sum(dim=-1, keepdim=True) > truncation.top_k
            if on_cuda:
                keep &= cuda.top_k_kept_by_index(logits, truncation.top_k)
            else:
                kth_largest = logits.topk(truncation.top_k, dim=-1).values[:, -1:]
                keep &= logits >= kth_largest
            logits = logits.masked_fill(~keep, -float("inf"))
        if truncation.top_p < 1.0 and on_cuda:
            keep &= cuda.top_p_kept_by_index(logits, truncation.top_p, cut_by_top_k)
        elif truncation.top_p < 1.0:
            ascending, order = logits.sort(dim=-1)
            cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
            # 1 - p formed in float32 from a float32 p, as vLLM forms it: 1 - p in float64 rounds to a
            # cutoff 1-3 float32 units away, and a cumulative mass between the two flips a token.
            cutoff = 1.0 - torch.tensor(truncation.top_p, dtype=torch.float32)
            drop_sorted = cumulative <= cutoff
            drop_sorted[:, -1] = False
            keep &= ~torch.zeros_like(keep).scatter(-1, order, drop_sorted)
        return keep


def truncated_log_softmax(
    scaled_logits: torch.Tensor, truncation: SamplingTruncation, kept_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, V] tempered logits -> [N, V] float32 logprobs under vLLM's truncation (`kept_counts`: [N]
    the engine's kept-set sizes, 0 where it reported none); dropped tokens get OUTSIDE_LOGPROB
    (their gradient is 0)."""
    import torch

    if not truncation.is_active:
        return torch.log_softmax(scaled_logits, dim=-1)
    keep = kept_tokens(scaled_logits, truncation, kept_counts)
    log_probs = torch.log_softmax(scaled_logits.masked_fill(~keep, -float("inf")), dim=-1)
    return torch.where(keep, log_probs, torch.full_like(log_probs, OUTSIDE_LOGPROB))
