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


def _group_mean(rewards: np.ndarray, lengths: np.ndarray, length_weighted: bool) -> np.ndarray:
    """[G, 1] baseline."""
    if not length_weighted:
        return rewards.mean(axis=1, keepdims=True)
    weights = np.maximum(lengths, 1).astype(np.float64)
    return (rewards * weights).sum(axis=1, keepdims=True) / weights.sum(axis=1, keepdims=True)


def mean_baseline(rewards: np.ndarray, lengths: np.ndarray, length_weighted: bool = False) -> np.ndarray:
    return rewards - _group_mean(rewards, lengths, length_weighted)


def grpo(rewards: np.ndarray, lengths: np.ndarray, length_weighted: bool = False) -> np.ndarray:
    centred = mean_baseline(rewards, lengths, length_weighted)
    std = rewards.std(axis=1, keepdims=True)
    # zero-std groups carry no signal; dividing would give 0/0
    return np.where(std > _EPS, centred / np.maximum(std, _EPS), 0.0)


def rloo(rewards: np.ndarray, lengths: np.ndarray, length_weighted: bool = False) -> np.ndarray:
    group_size = rewards.shape[1]
    if group_size < 2:
        return np.zeros_like(rewards)
    others_mean = (rewards.sum(axis=1, keepdims=True) - rewards) / (group_size - 1)
    return rewards - others_mean


def reinforce_pp(rewards: np.ndarray, lengths: np.ndarray, length_weighted: bool = False) -> np.ndarray:
    centred = mean_baseline(rewards, lengths, length_weighted)
    std = centred.std()
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


def compute_advantages(cfg: AdvantageConfig, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Advantages [num_groups, group_size] for `cfg.type`."""
    rewards = np.asarray(rewards, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.float64)
    assert rewards.shape == lengths.shape and rewards.ndim == 2, (rewards.shape, lengths.shape)
    if cfg.type == "custom":
        assert cfg.import_path is not None  # config validation guarantees it
        out = np.asarray(_import(cfg.import_path)(rewards, lengths, **cfg.kwargs), dtype=np.float64)
        if out.shape != rewards.shape:
            raise ValueError(
                f"custom advantage {cfg.import_path} returned shape {out.shape}, expected {rewards.shape}"
            )
        return out
    return _ESTIMATORS[cfg.type](rewards, lengths, cfg.length_weighted_mean)
