"""Advantage estimators over groups of rollouts of the same prompt.

All functions take rewards [num_groups, group_size] and completion lengths of the same shape and
return advantages of that shape (numpy float64).

- default / dr_grpo: reward minus the group mean (Dr. GRPO drops GRPO's std division, which
  up-weights groups that are nearly solved or nearly failed).
- grpo: (reward - mean) / std; a group whose rewards are all equal gets 0, not NaN.
- rloo: reward minus the mean of the *other* rollouts of the group (unbiased leave-one-out baseline).
- reinforce_pp: group mean removed, then normalised by the std of the whole batch.
- length_weighted_mean: the group mean is weighted by completion length (long samples carry more
  tokens of the loss, so their reward counts more in the baseline).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from grpo.config.orchestrator import AdvantageConfig

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


def mean_baseline(
    rewards: np.ndarray, lengths: np.ndarray, length_weighted: bool = False, valid: np.ndarray | None = None
) -> np.ndarray:
    valid = _all_valid(rewards, valid)
    return np.where(valid, rewards - _group_mean(rewards, lengths, length_weighted, valid), 0.0)


def grpo(
    rewards: np.ndarray, lengths: np.ndarray, length_weighted: bool = False, valid: np.ndarray | None = None
) -> np.ndarray:
    valid = _all_valid(rewards, valid)
    centred = mean_baseline(rewards, lengths, length_weighted, valid)
    plain = np.where(valid, rewards - _group_mean(rewards, lengths, False, valid), 0.0)
    std = np.sqrt((plain**2).sum(axis=1, keepdims=True) / np.maximum(valid.sum(axis=1, keepdims=True), 1))
    # zero-std groups carry no signal; dividing would give 0/0
    return np.where(std > _EPS, centred / np.maximum(std, _EPS), 0.0)


def rloo(
    rewards: np.ndarray, lengths: np.ndarray, length_weighted: bool = False, valid: np.ndarray | None = None
) -> np.ndarray:
    valid = _all_valid(rewards, valid)
    count = valid.sum(axis=1, keepdims=True)
    kept = np.where(valid, rewards, 0.0)
    others_mean = (kept.sum(axis=1, keepdims=True) - kept) / np.maximum(count - 1, 1)
    # fewer than two valid rollouts: no "others" to compare with
    return np.where(valid & (count >= 2), rewards - others_mean, 0.0)


def reinforce_pp(
    rewards: np.ndarray, lengths: np.ndarray, length_weighted: bool = False, valid: np.ndarray | None = None
) -> np.ndarray:
    valid = _all_valid(rewards, valid)
    centred = mean_baseline(rewards, lengths, length_weighted, valid)
    std = float(centred[valid].std()) if valid.any() else 0.0
    return centred / std if std > _EPS else np.zeros_like(centred)


_ESTIMATORS: dict[str, Callable[..., np.ndarray]] = {
    "default": mean_baseline,
    "dr_grpo": mean_baseline,
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}


def _import(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"advantage.import_path {path!r} must look like 'pkg.module:function'")
    return getattr(importlib.import_module(module_name), attr)


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
            raise ValueError(
                f"custom advantage {cfg.import_path} returned shape {out.shape}, expected {rewards.shape}"
            )
        if not np.all(np.isfinite(out[valid])):
            raise ValueError(
                f"custom advantage {cfg.import_path} returned non-finite values for finite rewards; "
                "it must return finite advantages (guard divisions by a zero std)"
            )
        return np.where(valid, out, 0.0)
    return _ESTIMATORS[cfg.type](np.where(valid, rewards, 0.0), lengths, cfg.length_weighted_mean, valid)
