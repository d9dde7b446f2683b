"""Advantage estimators over groups of rollouts of the same prompt.

All functions take rewards [num_groups, group_size] and completion lengths of the same shape and
return advantages of that shape (numpy float64). Each is the estimator of its paper:

- default: reward minus the group mean (optionally length-weighted, see below).
- grpo (DeepSeekMath): (reward - group mean) / group std; a group whose rewards are all equal gets
  0, not NaN.
- dr_grpo (Liu et al. 2025, "Understanding R1-Zero-like training"): reward minus the group mean,
  no std division (the std up-weights groups that are nearly solved or nearly failed). Its other
  half, a constant loss normaliser instead of the step's token count, is the trainer's
  loss.normalization: constant (config cross-check).
- rloo (Ahmadian et al. 2024): reward minus the mean of the *other* rollouts of the group (the
  unbiased leave-one-out baseline), never whitened: a division by a batch std would rescale the
  unbiased estimate (OpenRLHF's rloo does not whiten either).
- reinforce_pp (REINFORCE++, Hu 2025): no group baseline; the advantages are whitened over the
  whole batch: (A - batch mean) / (batch std + eps).
- reinforce_pp_baseline (REINFORCE++-baseline): group mean removed, then whitened over the batch.
- length_weighted_mean (default only): the group mean is weighted by completion length (long
  samples carry more tokens of the loss, so their reward counts more in the baseline).

Every group std (grpo) is the sample std (ddof=1, Bessel-corrected), as TRL's GRPO and OpenRLHF's
group_norm compute it; a group of fewer than two rewards has none, and its advantages are 0.

Batch whitening (the REINFORCE++ pair) is over the batch's completion tokens, as REINFORCE++ and
OpenRLHF define it: every token of a rollout carries the rollout's advantage, so a rollout weighs
its completion length (`lengths`) in the batch mean and in the batch std, which is the population
std over those tokens; then A <- (A - mean) / (std + 1e-6). Equal advantages whiten to 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from grpo.config.orchestrator import AdvantageConfig
from grpo.utils.errors import UserError

_EPS = 1e-6


def _group_mean(
    rewards: np.ndarray, lengths: np.ndarray, length_weighted: bool, valid: np.ndarray
) -> np.ndarray:
    """[G, 1] baseline over the valid rollouts of each group (0 for a group with none)."""
    weights: np.ndarray = valid.astype(np.float64)
    if length_weighted:
        weights = weights * np.maximum(lengths, 1)
    total = weights.sum(axis=1, keepdims=True)
    return (np.where(valid, rewards, 0.0) * weights).sum(axis=1, keepdims=True) / np.maximum(total, _EPS)


def _all_valid(rewards: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
    return np.ones(rewards.shape, dtype=bool) if valid is None else valid


def _sample_std(centred: np.ndarray, valid: np.ndarray, axis: int | None) -> np.ndarray:
    """Sample std (ddof=1) of values already centred on their mean; 0 where fewer than 2 are valid."""
    count = valid.sum(axis=axis, keepdims=True)
    squares = np.where(valid, centred, 0.0) ** 2
    return np.where(
        count >= 2, np.sqrt(squares.sum(axis=axis, keepdims=True) / np.maximum(count - 1, 1)), 0.0
    )


def _whiten(values: np.ndarray, lengths: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """(values - mean) / (std + eps) over the completion tokens of the valid rollouts: each rollout's
    value counts once per token (`lengths`), the std is the population std over those tokens."""
    weights = np.where(valid, np.maximum(lengths, 0.0), 0.0)
    total = weights.sum()
    if total <= 0:
        return np.zeros_like(values)
    centred = np.where(valid, values - (values * weights).sum() / total, 0.0)
    std = float(np.sqrt((weights * centred**2).sum() / total))
    return centred / (std + _EPS)


def mean_baseline(
    rewards: np.ndarray, lengths: np.ndarray, length_weighted: bool = False, valid: np.ndarray | None = None
) -> np.ndarray:
    valid = _all_valid(rewards, valid)
    return np.where(valid, rewards - _group_mean(rewards, lengths, length_weighted, valid), 0.0)


def dr_grpo(rewards: np.ndarray, lengths: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    # The plain group-mean baseline: what sets Dr. GRPO apart from default is its loss normaliser.
    return mean_baseline(rewards, lengths, False, valid)


def grpo(rewards: np.ndarray, lengths: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    valid = _all_valid(rewards, valid)
    centred = mean_baseline(rewards, lengths, False, valid)
    std = _sample_std(centred, valid, axis=1)
    # zero-std groups carry no signal; dividing would give 0/0
    return np.where(std > _EPS, centred / np.maximum(std, _EPS), 0.0)


def rloo(rewards: np.ndarray, lengths: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    valid = _all_valid(rewards, valid)
    count = valid.sum(axis=1, keepdims=True)
    kept = np.where(valid, rewards, 0.0)
    others_mean = (kept.sum(axis=1, keepdims=True) - kept) / np.maximum(count - 1, 1)
    # fewer than two valid rollouts: no "others" to compare with
    return np.where(valid & (count >= 2), rewards - others_mean, 0.0)


def reinforce_pp(rewards: np.ndarray, lengths: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    return _whiten(rewards, lengths, _all_valid(rewards, valid))


def reinforce_pp_baseline(
    rewards: np.ndarray, lengths: np.ndarray, valid: np.ndarray | None = None
) -> np.ndarray:
    valid = _all_valid(rewards, valid)
    return _whiten(mean_baseline(rewards, lengths, False, valid), lengths, valid)


_ESTIMATORS: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]] = {
    "dr_grpo": dr_grpo,
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def _import(path: str) -> Callable[..., Any]:
    from grpo.utils.function_import import import_function

    if ":" not in path:
        raise UserError(
            f"advantage.import_path {path!r} must look like 'pkg.module:function' or 'file.py:function'"
        )
    return import_function(f"advantage.import_path {path!r}", path)


def compute_advantages(
    cfg: AdvantageConfig, rewards: np.ndarray, lengths: np.ndarray, valid: np.ndarray | None = None
) -> np.ndarray:
    """Advantages [num_groups, group_size] for `cfg.type`.

    `valid` (same shape) marks the rollouts that were scored; the others (failed, or a reward that
    is not finite) are left out of every baseline and get advantage 0, so a failure neither trains
    as reward 0 nor shifts its group's baseline. The result is always finite."""
    rewards = np.asarray(rewards, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.float64)
    assert rewards.shape == lengths.shape and rewards.ndim == 2, (rewards.shape, lengths.shape)
    valid = np.isfinite(rewards) if valid is None else np.asarray(valid, dtype=bool) & np.isfinite(rewards)
    if cfg.type == "custom":
        assert cfg.import_path is not None  # config validation guarantees it
        # User code sees no NaN: invalid entries hold their group's valid mean (no deviation).
        filled = np.where(valid, rewards, _group_mean(rewards, lengths, False, valid))
        out = np.asarray(_import(cfg.import_path)(filled, lengths, **cfg.kwargs), dtype=np.float64)
        if out.shape != rewards.shape:
            raise UserError(
                f"custom advantage {cfg.import_path} returned shape {out.shape}, expected {rewards.shape}"
            )
        if not np.all(np.isfinite(out[valid])):
            raise UserError(
                f"custom advantage {cfg.import_path} returned non-finite values for finite rewards; "
                "it must return finite advantages (guard divisions by a zero std)"
            )
        return np.where(valid, out, 0.0)
    rewards = np.where(valid, rewards, 0.0)
    if cfg.type == "default":
        return mean_baseline(rewards, lengths, cfg.length_weighted_mean, valid)
    return _ESTIMATORS[cfg.type](rewards, lengths, valid)
