"""A SingleTurnEnv with a @group_reward function takes the orchestrator's group path: one call per
group, its value landing on each rollout beside the per-rollout functions'."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from orchestrator_fakes import FakeClient, fake_tokenizer

from grpo.envs import SingleTurnEnv, group_reward
from grpo.inference.types import SamplingParams
from grpo.orchestrator.rollouts.rollout import GroupRequest, RolloutRunner
from grpo.orchestrator.scheduler import PolicyTracker


def test_a_group_reward_is_called_once_per_group_and_lands_on_each_rollout(tmp_path: Path) -> None:
    calls: list[tuple[list[str], list[Any]]] = []

    @group_reward
    def position(completions: list[str], completion_ids: list[Any]) -> list[float]:
        calls.append((list(completions), list(completion_ids)))
        return [float(i) for i in range(len(completions))]

    def matches(completion: str, answer: str) -> float:
        return float(completion == answer)

    env = SingleTurnEnv([{"prompt": "q", "answer": "3"}], [matches, position])
    client = FakeClient(reply="3")
    runner = RolloutRunner(client, fake_tokenizer(), PolicyTracker(tmp_path, client, "default", "m"))  # type: ignore[arg-type]
    group = asyncio.run(runner.run_group(GroupRequest(0, env, 0, env.examples[0], 3, SamplingParams())))
    assert len(calls) == 1 and calls[0][0] == ["3", "3", "3"]
    assert calls[0][1] == [r.completion_ids for r in group.rollouts]
    assert [r.reward_metrics for r in group.rollouts] == [
        {"matches": 1.0, "position": float(i)} for i in range(3)
    ]
    assert [r.reward for r in group.rollouts] == [1.0, 2.0, 3.0]
