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
from grpo.envs.tool_env import ToolUse
from grpo.orchestrator.batching.filters import apply_filters
from grpo.orchestrator.batching.group_checks import FAILED_GROUPS_METRIC, bounded_advantages, fail_group
from grpo.orchestrator.batching.packer import pack_rollouts
from grpo.orchestrator.batching.rollout_failures import FAILED_ROLLOUTS_METRIC, drop_groups_with_failures
from grpo.orchestrator.env_labels import env_labels
from grpo.orchestrator.rollouts.partial import partial_metrics
from grpo.orchestrator.types import Group, Rollout
from grpo.transport.batches.batch import SamplingTruncation, TrainingBatch
from grpo.transport.batches.validate import check_batch_values
from grpo.utils.logging import get_logger

log = get_logger("orchestrator")


def batch_sampling(cfg: OrchestratorConfig) -> SamplingTruncation:
    """The truncation every completion of the run was sampled under (the trainer repeats it)."""
    return SamplingTruncation(top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p, min_p=cfg.sampling.min_p)


def build_batch(
    cfg: OrchestratorConfig,
    vocab_size: int,
    policy_version: int,
    step: int,
    groups: list[Group],
    stats: dict[str, float],
) -> tuple[TrainingBatch, list[Rollout]]:
    """Batch `step` (or one part of it) from `groups`, and all their rollouts (failed ones too) with
    advantages set; adds the filters', the packer's and the failures' counts to `stats`.

    Failed rollouts are left out of the batch, and their groups kept or dropped by
    advantage.on_rollout_failure (grpo.orchestrator.batching.rollout_failures). The batch passes the trainer's
    own check (check_batch_values) before anyone spools or sends it: groups whose rewards or
    advantages the trainer would refuse fail whole (grpo.orchestrator.batching.group_checks); a group that
    still fails the check on its own is left out of the batch."""
    rollouts = [r for g in groups for r in g.rollouts]
    num_failed_rollouts, num_dropped = drop_groups_with_failures(cfg.advantage.on_rollout_failure, groups)
    stats[FAILED_ROLLOUTS_METRIC] = stats.get(FAILED_ROLLOUTS_METRIC, 0) + num_failed_rollouts
    num_failed = bounded_advantages(cfg.advantage, groups)
    for key, count in apply_filters(rollouts, cfg.filters, vocab_size).items():
        stats[key] = stats.get(key, 0) + count
    metadata: dict[str, float | int | str] = {"policy_version": policy_version}
    sampling = batch_sampling(cfg)
    rows, pack = pack_rollouts(_finished(rollouts), cfg.seq_len, cfg.shared_prefix, cfg.row_tokens)
    batch = TrainingBatch(step=step, rows=rows, metadata=metadata, sampling=sampling)
    try:
        check_batch_values(batch, vocab_size)
    except ValueError:
        kept = []
        for group in groups:
            if _passes_alone(cfg, vocab_size, group):
                kept.append(group)
            else:
                fail_group(group, "the trainer's batch check refuses its rollouts")
                num_failed += 1
        packed = _finished([r for g in kept for r in g.rollouts])
        rows, pack = pack_rollouts(packed, cfg.seq_len, cfg.shared_prefix, cfg.row_tokens)
        batch = TrainingBatch(step=step, rows=rows, metadata=metadata, sampling=sampling)
        check_batch_values(batch, vocab_size)  # what no group causes (metadata): stop, send nothing
    if num_failed:
        log.warning(
            "batch %d: %d of %d group(s) failed whole (a reward or advantage beyond the trainer's bound, "
            "or values its batch check refuses; GRPO_LOG_LEVEL=DEBUG names each)",
            step,
            num_failed,
            len(groups),
        )
    stats[FAILED_GROUPS_METRIC] = stats.get(FAILED_GROUPS_METRIC, 0) + num_dropped + num_failed
    # Sums over the step's parts (one part unless streaming); pack_metrics turns them into rates.
    for key, value in (
        ("packing/num_rows", pack.num_rows),
        ("packing/num_truncated", pack.num_truncated),
        ("packing/num_tokens", pack.num_tokens),
        ("packing/num_sample_tokens", pack.num_sample_tokens),
    ):
        stats[key] = stats.get(key, 0) + value
    return batch, rollouts


def _finished(rollouts: list[Rollout]) -> list[Rollout]:
    """The rollouts that go into the batch: a failed one never trains, so it is not sent at all."""
    return [r for r in rollouts if r.failure is None]


def _passes_alone(cfg: OrchestratorConfig, vocab_size: int, group: Group) -> bool:
    rows, _pack = pack_rollouts(_finished(group.rollouts), cfg.seq_len, cfg.shared_prefix, cfg.row_tokens)
    try:
        check_batch_values(TrainingBatch(step=0, rows=rows, metadata={}), vocab_size)
    except ValueError:
        return False
    return True


def pack_metrics(stats: dict[str, float], rollouts: list[Rollout], row_tokens: int) -> None:
    """The step's packing and advantage metrics from the sums its parts left in `stats`."""
    num_tokens = stats.pop("packing/num_tokens")
    stats["packing/efficiency"] = num_tokens / max(stats["packing/num_rows"] * row_tokens, 1)
    stats["packing/shared_frac"] = 1.0 - num_tokens / max(stats.pop("packing/num_sample_tokens"), 1)
    advantages = np.array([r.advantage for r in rollouts], dtype=np.float64)
    stats["advantage/mean"] = float(advantages.mean())
    stats["advantage/std"] = float(advantages.std())
    stats.update(turn_metrics(rollouts))


def turn_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """With per-turn credit: the mean and std of turn t's advantage and the mean of its reward, over
    the scored rollouts that reached turn t (`advantage/turn_<t>/mean`, `/std`, `reward/turn_<t>/mean`)."""
    scored = [r for r in rollouts if r.turn_advantages is not None and r.failure is None]
    metrics: dict[str, float] = {}
    for t in range(max((r.num_turns for r in scored), default=0)):
        reached = [r for r in scored if r.num_turns > t]
        advantages = np.array([r.turn_advantages[t] for r in reached if r.turn_advantages is not None])
        metrics[f"advantage/turn_{t}/mean"] = float(advantages.mean())
        metrics[f"advantage/turn_{t}/std"] = float(advantages.std())
        metrics[f"reward/turn_{t}/mean"] = statistics.fmean(r.turn_rewards[t] for r in reached)
    return metrics


def rollout_metrics(
    step: int,
    groups: list[Group],
    rollouts: list[Rollout],
    envs: list[Environment],
    policy_version: int,
    partial_rollouts: bool,
) -> dict[str, float]:
    """Rewards, lengths, failures and off-policy lag of batch `step`'s rollouts; per environment the
    mean and standard deviation of its reward (`reward/<env>/mean`, `/std`) and of each reward
    function's value (`reward/<env>/<function>/mean`, `/std`) over the rollouts it scored."""
    # Failed rollouts have no reward (they are masked): they are counted, not averaged in.
    rewards = [r.reward for r in rollouts if r.failure is None] or [0.0]
    lengths = [r.num_model_tokens for r in rollouts]
    metrics: dict[str, float] = {
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "frac_reward_zero_std": sum(1 for g in groups if len(set(g.finished_rewards)) <= 1) / len(groups),
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
            env_rewards = [r.reward for r in scored]
            metrics[f"reward/{label}/mean"] = statistics.fmean(env_rewards)
            metrics[f"reward/{label}/std"] = statistics.pstdev(env_rewards)
        for name, fn_values in reward_function_values(scored).items():
            metrics[f"reward/{label}/{name}/mean"] = statistics.fmean(fn_values)
            metrics[f"reward/{label}/{name}/std"] = statistics.pstdev(fn_values)
        if isinstance(envs[env_index], ToolUse):
            metrics.update(
                tool_metrics(label, [r for g in groups if g.env_index == env_index for r in g.rollouts])
            )
    return metrics


def tool_metrics(label: str, rollouts: list[Rollout]) -> dict[str, float]:
    """An environment with tools: tool calls run per rollout, and how many of them came back as errors."""
    if not rollouts:
        return {}
    return {
        f"tools/{label}/calls_per_rollout": statistics.fmean(r.num_tool_calls for r in rollouts),
        f"tools/{label}/num_errors": sum(r.num_tool_errors for r in rollouts),
    }


def reward_function_values(rollouts: list[Rollout]) -> dict[str, list[float]]:
    """Each reward function's values over the rollouts it scored (a TRL-style one may pass on some:
    None, so absent from their reward_metrics); failed rollouts carry none."""
    values: dict[str, list[float]] = {}
    for rollout in rollouts:
        for name, value in rollout.reward_metrics.items():
            values.setdefault(name, []).append(value)
    return values


def reward_function_means(rollouts: list[Rollout]) -> dict[str, float]:
    """Each reward function's mean over the rollouts it scored."""
    return {name: statistics.fmean(v) for name, v in reward_function_values(rollouts).items()}
