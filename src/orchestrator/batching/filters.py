"""Rollout quality filters, judged from the sampled tokens and their logprobs.

- gibberish: a token with a rare id (>= token_id_threshold) sampled with a logprob below
  log(1/vocab_size) + logprob_offset, i.e. no likelier than chance: typical of degenerate sampling.
- repetition: `window` consecutive tokens each sampled with probability >= prob_threshold: the model
  is looping with total confidence.

A filter with enforce=true masks flagged rollouts from the loss; otherwise flags are only counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from grpo.config.orchestrator import FilterConfig, GibberishFilterConfig, RepetitionFilterConfig
from grpo.orchestrator.types import Rollout


def is_gibberish(rollout: Rollout, cfg: GibberishFilterConfig, vocab_size: int) -> bool:
    floor = -math.log(max(vocab_size, 2)) + cfg.logprob_offset
    for token, logprob, trains in zip(
        rollout.completion_ids, rollout.completion_logprobs, rollout.completion_mask, strict=True
    ):
        if trains and token >= cfg.token_id_threshold and logprob < floor:
            return True
    return False


def is_repetitive(rollout: Rollout, cfg: RepetitionFilterConfig) -> bool:
    threshold = math.log(cfg.prob_threshold)
    run = 0
    for logprob, trains in zip(rollout.completion_logprobs, rollout.completion_mask, strict=True):
        if not trains:
            continue
        run = run + 1 if logprob >= threshold else 0
        if run >= cfg.window:
            return True
    return False


def apply_filters(
    rollouts: Sequence[Rollout], filters: Sequence[FilterConfig], vocab_size: int
) -> dict[str, int]:
    """Flag rollouts; mask the ones an enforcing filter flags. Returns counts by `filter/<type>`."""
    counts: dict[str, int] = {}
    for cfg in filters:
        key = f"filter/{cfg.type}"
        counts.setdefault(key, 0)
        for rollout in rollouts:
            if isinstance(cfg, GibberishFilterConfig):
                flagged = is_gibberish(rollout, cfg, vocab_size)
            else:
                flagged = is_repetitive(rollout, cfg)
            if flagged:
                counts[key] += 1
                if cfg.enforce:
                    rollout.masked = True
    return counts
