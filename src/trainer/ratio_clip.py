"""How loss.clip_low / clip_high / tis_cap / type bend the importance ratio in the loss coefficient
(docs/loss.md, "Clipping and truncation").

On a batch's first update (the only one with num_iterations 1) the trainer's own old policy is the
current one and PPO's ratio pi / pi_old would be 1: every ratio there is against the behaviour
(inference) logprobs, the same `ratio[t]` the coefficient already multiplies by.

    type default:  weight = min(ratio, tis_cap)         (= ratio without tis_cap)
                   the token keeps no gradient where PPO's min(ratio * s, clip(ratio) * s) takes the
                   clipped branch: s > 0 and ratio > clip_high, or s < 0 and ratio < clip_low
    type cispo:    weight = clamp(ratio, clip_low, clip_high), every token keeps its gradient

with s the token's signal (advantage term plus the kl and teacher terms). A missing bound is no bound.

On the later updates of a batch (num_iterations > 1) the caller passes `policy_ratio` = pi / pi_old
(pi_old: the first pass's logprobs) and `old_ratio` = pi_old / mu. Type default then clips
policy_ratio (PPO's own ratio) with the same sign rule, and the weight is
min(old_ratio, tis_cap) * policy_ratio (= ratio without tis_cap): the truncation stays on the
behaviour mismatch, decided once per batch. Type cispo's weight is the whole importance ratio
pi / mu clamped, on every update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from grpo.config.trainer import LossConfig


@dataclass
class ClippedRatio:
    """All [T], no gradient."""

    weight: torch.Tensor
    """What the coefficient multiplies the signal by, in place of the ratio."""
    has_gradient: torch.Tensor
    """bool: False where PPO's clip takes the constant branch (always True for cispo)."""
    clipped_low: torch.Tensor
    """bool: where clip_low acted (default: dropped a negative-signal token; cispo: raised the weight)."""
    clipped_high: torch.Tensor
    """bool: where clip_high acted (default: dropped a positive-signal token; cispo: lowered the weight)."""
    tis_capped: torch.Tensor
    """bool: where tis_cap lowered the weight."""


def clip_ratio(
    ratio: torch.Tensor,
    signal: torch.Tensor,
    cfg: LossConfig,
    policy_ratio: torch.Tensor | None = None,
    old_ratio: torch.Tensor | None = None,
) -> ClippedRatio:
    """`ratio` [T] (pi / mu per token, or its sample's for the sequence types) and `signal` [T] ->
    the weights and gates of the configured clip; identity (weight = ratio, every token kept) by
    default. `policy_ratio` (pi / pi_old) and `old_ratio` (pi_old / mu), both [T] and shaped like
    `ratio`, only on a batch's later updates (num_iterations > 1)."""
    import torch

    assert (policy_ratio is None) == (old_ratio is None), "a later update passes both"
    no = torch.zeros_like(ratio, dtype=torch.bool)
    if cfg.type == "cispo":
        below = no if cfg.clip_low is None else ratio < cfg.clip_low
        above = no if cfg.clip_high is None else ratio > cfg.clip_high
        weight = ratio.clamp(min=cfg.clip_low, max=cfg.clip_high)
        return ClippedRatio(weight, ~no, below, above, no)
    clip_tested = ratio if policy_ratio is None else policy_ratio
    low = no if cfg.clip_low is None else (clip_tested < cfg.clip_low) & (signal < 0)
    high = no if cfg.clip_high is None else (clip_tested > cfg.clip_high) & (signal > 0)
    behaviour = ratio if old_ratio is None else old_ratio
    capped = no if cfg.tis_cap is None else behaviour > cfg.tis_cap
    if cfg.tis_cap is None:
        weight = ratio
    elif policy_ratio is None:
        weight = ratio.clamp(max=cfg.tis_cap)
    else:
        weight = behaviour.clamp(max=cfg.tis_cap) * policy_ratio
    return ClippedRatio(weight, ~(low | high), low, high, capped)
