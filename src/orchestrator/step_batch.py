"""What a step makes of the groups it took: the TrainingBatch (advantages, filters, packing) and the
step's rollout metrics.

Pure CPU work on finished groups (the loop runs build_batch in a worker thread). Under streaming a
step is built part by part: build_batch adds each part's packing counts to the step's `stats`, and
pack_metrics turns their sums into the step's rates once every part is sent.
"""

from __future__ import annotations

import statistics

import numpy as np

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs.base import Environment
from grpo.orchestrator.advantage import compute_advantages
from grpo.orchestrator.env_labels import env_labels
from grpo.orchestrator.filters import apply_filters
from grpo.orchestrator.packer import pack_rollouts
from grpo.orchestrator.partial import partial_metrics
from grpo.orchestrator.types import Group, Rollout
from grpo.transport.batches.batch import TrainingBatch


def build_batch(
    cfg: OrchestratorConfig,
    vocab_size: int,
    policy_version: int,
    step: int,
    groups: list[Group],
    stats: dict[str, float],
) -> tuple[TrainingBatch, list[Rollout]]:
    """Batch `step` (or one part of it) from `groups`, and their rollouts with advantages set; adds
    the filters' and the packer's counts to `stats`."""
    rollouts = [r for g in groups for r in g.rollouts]
    rewards = np.array([g.rewards for g in groups], dtype=np.float64)
    lengths = np.array([[r.num_model_tokens for r in g.rollouts] for g in groups], dtype=np.float64)
    scored = np.array([g.scored for g in groups], dtype=bool)
    advantages = compute_advantages(cfg.advantage, rewards, lengths, scored)
    for group, row in zip(groups, advantages, strict=True):
        for rollout, adv in zip(group.rollouts, row, strict=True):
            rollout.advantage = float(adv)
    for key, count in apply_filters(rollouts, cfg.filters, vocab_size).items():
        stats[key] = stats.get(key, 0) + count
    rows, pack = pack_rollouts(rollouts, cfg.seq_len, share_prefixes=cfg.shared_prefix)
    # Sums over the step's parts (one part unless streaming); pack_metrics turns them into rates.
    for key, value in (
        ("packing/num_rows", pack.num_rows),
        ("packing/num_truncated", pack.num_truncated),
        ("packing/num_tokens", pack.num_tokens),
        ("packing/num_sample_tokens", pack.num_sample_tokens),
    ):
        stats[key] = stats.get(key, 0) + value
    batch = TrainingBatch(step=step, rows=rows, metadata={"policy_version": policy_version})
    return batch, rollouts


def pack_metrics(stats: dict[str, float], rollouts: list[Rollout], seq_len: int) -> None:
    """The step's packing and advantage metrics from the sums its parts left in `stats`."""
    num_tokens = stats.pop("packing/num_tokens")
    stats["packing/efficiency"] = num_tokens / max(stats["packing/num_rows"] * seq_len, 1)
    stats["packing/shared_frac"] = 1.0 - num_tokens / max(stats.pop("packing/num_sample_tokens"), 1)
    advantages = np.array([r.advantage for r in rollouts], dtype=np.float64)
    stats["advantage/mean"] = float(advantages.mean())
    stats["advantage/std"] = float(advantages.std())


def rollout_metrics(
    step: int,
    groups: list[Group],
    rollouts: list[Rollout],
    envs: list[Environment],
    policy_version: int,
    partial_rollouts: bool,
) -> dict[str, float]:
    """Rewards, lengths, failures and off-policy lag of batch `step`'s rollouts; per environment its
    mean reward (`reward/<env>`) and each reward function's mean (`reward/<env>/<function>`)."""
    # Failed rollouts have no reward (they are masked): they are counted, not averaged in.
    rewards = [r.reward for r in rollouts if r.failure is None] or [0.0]
    lengths = [r.num_model_tokens for r in rollouts]
    metrics: dict[str, float] = {
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "frac_reward_zero_std": sum(1 for g in groups if len(set(g.rewards)) == 1) / len(groups),
        "completion_len/mean": statistics.fmean(lengths),
        "completion_len/max": max(lengths),
        "truncated/frac": sum(r.truncated for r in rollouts) / len(rollouts),
        "failed/num_rollouts": sum(r.failure is not None for r in rollouts),
        "failed/frac": sum(r.failure is not None for r in rollouts) / len(rollouts),
        "masked/num_rollouts": sum(r.masked for r in rollouts),
        "off_policy/mean_lag": statistics.fmean(step - r.start_version for r in rollouts),
        "off_policy/max_lag": max(step - r.start_version for r in rollouts),
        "policy/version": policy_version,
    }
    if partial_rollouts:
        metrics.update(partial_metrics(rollouts))
    for env_index, label in enumerate(env_labels(envs)):
        scored = [r for g in groups if g.env_index == env_index for r in g.rollouts if r.failure is None]
        if scored:
            metrics[f"reward/{label}"] = statistics.fmean(r.reward for r in scored)
        for name, mean in reward_function_means(scored).items():
            metrics[f"reward/{label}/{name}"] = mean
    return metrics


def reward_function_means(rollouts: list[Rollout]) -> dict[str, float]:
    """Each reward function's mean over the rollouts it scored (a TRL-style one may pass on some:
    None, so absent from their reward_metrics); failed rollouts carry none."""
    values: dict[str, list[float]] = {}
    for rollout in rollouts:
        for name, value in rollout.reward_metrics.items():
            values.setdefault(name, []).append(value)
    return {name: statistics.fmean(fn_values) for name, fn_values in values.items()}
