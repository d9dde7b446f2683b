"""The trainer's half of the consistency check: its next-token distributions against the engine's
at every position of a batch's probe (grpo.transport.batches.probe), as metrics.

Per probed position, with p the engine's distribution and q the trainer's, both untempered and
untruncated:
- KL(p || q) and the total variation, over the engine's top K tokens plus one bin for the rest of
  the vocabulary. With K the whole vocabulary they are exact; otherwise they are lower bounds (a
  merged bin hides what differs inside it), tight when the rest holds little mass.
- whether the kept sets differ: the tokens the trainer keeps at the completion's temperature under
  the batch's truncation (top_k, top_p, min_p, by the engine's sampler's rules) against the tokens
  the engine kept. Those are the top `engine_kept_counts` tokens where a grpo CPU engine reported
  how many it kept when it sampled, else the same rules applied to the engine's distribution, its
  tail past the top K spread evenly (exact when the kept set lies within the top K at temperature
  1, or K is the whole vocabulary).

Metrics (`consistency/...`): full_kl (mean over positions), max_kl, tv (mean), kept_set_disagreement
(share of positions whose kept sets differ; 0 without truncation), prompt_mismatch (share of probed
prompts the engine renders to other ids than the orchestrator did), num_positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    import torch

    from grpo.transport.batches.batch import PackedRow, SamplingTruncation
    from grpo.transport.batches.probe import ConsistencyProbe, ProbeSequence

log = get_logger("trainer")

ProbeLogits = Callable[["ProbeSequence"], "torch.Tensor"]
"""A probe sequence -> the trainer's raw logits [num_completion_tokens, V] predicting each of its
completion tokens."""


def probe_row(sequence: ProbeSequence) -> PackedRow:
    """A probe sequence as a packed row with nothing to train, for the trainer's forward."""
    import numpy as np

    from grpo.transport.batches.batch import PackedRow, plain_parent_ids

    num_tokens = int(sequence.input_ids.shape[0])
    position_ids: np.ndarray = np.arange(num_tokens, dtype=np.int32)
    return PackedRow(
        input_ids=sequence.input_ids,
        position_ids=position_ids,
        loss_mask=np.zeros(num_tokens, np.bool_),
        advantages=np.zeros(num_tokens, np.float32),
        inference_logprobs=np.zeros(num_tokens, np.float32),
        temperatures=np.ones(num_tokens, np.float32),
        parent_ids=plain_parent_ids(position_ids),
    )


def completion_predictors(sequence: ProbeSequence) -> slice:
    """The row positions whose hidden states predict the completion's tokens (each token is
    predicted from the one before it)."""
    return slice(sequence.num_prompt_tokens - 1, int(sequence.input_ids.shape[0]) - 1)


def binned_divergences(
    top_ids: torch.Tensor, engine_logprobs: torch.Tensor, trainer_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, K] engine top ids and logprobs, [P, V] trainer logits -> (KL(engine || trainer) [P], total
    variation [P]) over the K tokens plus one bin for the rest (none when K covers the vocabulary),
    in float64."""
    import torch

    trainer_lp = torch.log_softmax(trainer_logits.double(), dim=-1)
    trainer_top = trainer_lp.gather(-1, top_ids.long())
    engine_top = engine_logprobs.double()
    engine_p, trainer_p = engine_top.exp(), trainer_top.exp()
    kl = (engine_p * (engine_top - trainer_top)).sum(-1)
    tv = (engine_p - trainer_p).abs().sum(-1)
    if top_ids.shape[-1] < trainer_logits.shape[-1]:
        engine_rest = (1.0 - engine_p.sum(-1)).clamp(min=0.0)
        # the trainer's rest from its own tail, not 1 - sum: exact where the rest is tiny
        trainer_rest = trainer_lp.scatter(-1, top_ids.long(), -math.inf).logsumexp(-1).exp()
        kl += torch.where(
            engine_rest > 0,
            engine_rest * (engine_rest.log() - trainer_rest.clamp(min=1e-300).log()),
            torch.zeros_like(engine_rest),
        )
        tv += (engine_rest - trainer_rest).abs()
    return kl, tv / 2


def engine_logits(top_ids: torch.Tensor, engine_logprobs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[P, K] top ids and logprobs -> [P, V] float32 logits of the engine's distribution: its top K
    as they are, the rest of the mass spread evenly over the other tokens (never above the K-th)."""
    import torch

    top = engine_logprobs.float()
    num_rest = vocab_size - top.shape[-1]
    if num_rest > 0:
        rest = (1.0 - top.double().exp().sum(-1)).clamp(min=0.0)
        fill = (rest / num_rest).log().float().unsqueeze(-1)
        fill = torch.minimum(fill, top.min(dim=-1, keepdim=True).values)
    else:
        fill = torch.full_like(top[:, :1], -math.inf)
    logits = fill.expand(top.shape[0], vocab_size).clone()
    return logits.scatter(-1, top_ids.long(), top)


def kept_sets_differ(
    sequence: ProbeSequence, trainer_logits: torch.Tensor, truncation: SamplingTruncation
) -> torch.Tensor:
    """[P] bool: where the trainer's kept set differs from the engine's (module doc)."""
    import torch

    from grpo.trainer.sampling_truncation import kept_by_rules

    num_positions, vocab_size = trainer_logits.shape
    if not truncation.is_active:
        return torch.zeros(num_positions, dtype=torch.bool)
    top_ids = torch.from_numpy(sequence.engine_top_ids).long()
    top_lp = torch.from_numpy(sequence.engine_top_logprobs)
    trainer_kept = kept_by_rules(trainer_logits.float() / sequence.temperature, truncation)
    engine_kept = kept_by_rules(engine_logits(top_ids, top_lp, vocab_size) / sequence.temperature, truncation)
    if sequence.engine_kept_counts is not None:
        counts = torch.from_numpy(sequence.engine_kept_counts).long()
        counted = counts > 0
        # the engine's top ids rank its tokens; a count past them is compared by size alone
        within = counted & (counts <= top_ids.shape[-1])
        ranked = torch.zeros_like(engine_kept)
        ranked.scatter_(
            -1, top_ids, torch.arange(top_ids.shape[-1]).expand_as(top_ids) < counts.unsqueeze(-1)
        )
        engine_kept = torch.where(within.unsqueeze(-1), ranked, engine_kept)
        sizes_differ = trainer_kept.sum(-1) != counts
        beyond = counted & ~within
        differ = (engine_kept != trainer_kept).any(-1)
        return torch.where(beyond, sizes_differ, differ)
    return (engine_kept != trainer_kept).any(-1)


def probe_metrics(
    probe: ConsistencyProbe, step: int, truncation: SamplingTruncation, logits_of: ProbeLogits
) -> dict[str, float]:
    """The `consistency/...` metrics of the probe batch `step` carries (module doc), computed with
    policy `step`; warns past its warn_kl, or when a kept set or a prompt rendering differs. No
    metrics (and a warning) for a probe of another policy, which this one cannot be compared with."""
    import torch

    if probe.policy_version != step:
        log.warning(
            "consistency probe of policy %d came with batch %d; not checked", probe.policy_version, step
        )
        return {}

    kls, tvs, differs = [], [], []
    for sequence in probe.sequences:
        with torch.no_grad():
            logits = logits_of(sequence).float().cpu()
        top_ids = torch.from_numpy(sequence.engine_top_ids)
        kl, tv = binned_divergences(top_ids, torch.from_numpy(sequence.engine_top_logprobs), logits)
        kls.append(kl)
        tvs.append(tv)
        differs.append(kept_sets_differ(sequence, logits, truncation))
    kl_all, tv_all, differ_all = torch.cat(kls), torch.cat(tvs), torch.cat(differs)
    mismatched = sum(not s.engine_prompt_matches for s in probe.sequences)
    metrics = {
        "consistency/full_kl": float(kl_all.mean()),
        "consistency/max_kl": float(kl_all.max()),
        "consistency/tv": float(tv_all.mean()),
        "consistency/kept_set_disagreement": float(differ_all.double().mean()),
        "consistency/prompt_mismatch": mismatched / len(probe.sequences),
        "consistency/num_positions": float(kl_all.numel()),
    }
    if (
        metrics["consistency/full_kl"] > probe.warn_kl
        or metrics["consistency/kept_set_disagreement"] > 0
        or mismatched
    ):
        log.warning(
            "consistency check at policy %d: KL %.3g (max %.3g), total variation %.3g, kept sets differ at "
            "%.1f%% of %d positions, %d of %d prompts rendered differently by the engine's chat template; "
            "the engine does not sample what the trainer computes (docs/loss.md, 'The consistency check')",
            probe.policy_version,
            metrics["consistency/full_kl"],
            metrics["consistency/max_kl"],
            metrics["consistency/tv"],
            100 * metrics["consistency/kept_set_disagreement"],
            kl_all.numel(),
            mismatched,
            len(probe.sequences),
        )
    return metrics
