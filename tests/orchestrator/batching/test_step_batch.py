"""A step's rollout metrics: each environment's reward functions are logged by name."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from grpo.orchestrator.batching.step_batch import rollout_metrics
from grpo.orchestrator.types import Group, Rollout


def _rollout(reward: float, metrics: dict[str, float], failure: str | None = None) -> Rollout:
    rollout = Rollout("gsm8k", 0, [1], [2], [True], [0.0], 1.0, 0, 0, reward=reward, reward_metrics=metrics)
    if failure is not None:
        rollout.fail(failure)
    return rollout


def test_each_reward_function_mean_and_std_are_logged_over_the_rollouts_it_scored() -> None:
    rollouts = [
        _rollout(1.5, {"correct": 1.0, "brief": 1.0}),
        _rollout(0.0, {"correct": 0.0}),  # brief returned None here
        _rollout(0.0, {"correct": 1.0, "brief": 1.0}, failure="every reward function returned None"),
    ]
    envs: list[Any] = [SimpleNamespace(name="gsm8k")]
    metrics = rollout_metrics(0, [Group(0, {}, 0, rollouts)], rollouts, envs, 0, False)
    assert metrics["reward/gsm8k/mean"] == 0.75 and metrics["reward/gsm8k/std"] == 0.75
    assert metrics["reward/gsm8k/correct/mean"] == 0.5 and metrics["reward/gsm8k/brief/mean"] == 1.0
    assert metrics["reward/gsm8k/correct/std"] == 0.5 and metrics["reward/gsm8k/brief/std"] == 0.0
    assert metrics["failed/num_rollouts"] == 1
