"""How loss.clip_low / clip_high / tis_cap / type bend the importance ratio in the loss coefficient
(docs/loss.md, "Clipping and truncation").

grpo makes one optimizer update per batch, so the trainer's own old policy is the current one and
PPO's ratio pi / pi_old would be 1: every ratio here is against the behaviour (inference) logprobs,
the same `ratio[t]` the coefficient already multiplies by.

    type default:  weight = min(ratio, tis_cap)         (= ratio without tis_cap)
                   the token keeps no gradient where PPO's min(ratio * s, clip(ratio) * s) takes the
                   clipped branch: s > 0 and ratio > clip_high, or s < 0 and ratio < clip_low
    type cispo:    weight = clamp(ratio, clip_low, clip_high), every token keeps its gradient

with s the token's signal (advantage term plus the kl and teacher terms). A missing bound is no bound.
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


def clip_ratio(ratio: torch.Tensor, signal: torch.Tensor, cfg: LossConfig) -> ClippedRatio:
    """`ratio` [T] (per token, or its sample's for the sequence types) and `signal` [T] -> the
    weights and gates of the configured clip; identity (weight = ratio, every token kept) by default."""
    import torch

    no = torch.zeros_like(ratio, dtype=torch.bool)
    below = no if cfg.clip_low is None else ratio < cfg.clip_low
    above = no if cfg.clip_high is None else ratio > cfg.clip_high
    if cfg.type == "cispo":
        weight = ratio.clamp(min=cfg.clip_low, max=cfg.clip_high)
        return ClippedRatio(weight, ~no, below, above, no)
    low = below & (signal < 0)
    high = above & (signal > 0)
    capped = no if cfg.tis_cap is None else ratio > cfg.tis_cap
    weight = ratio if cfg.tis_cap is None else ratio.clamp(max=cfg.tis_cap)
    return ClippedRatio(weight, ~(low | high), low, high, capped)
