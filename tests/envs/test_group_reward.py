"""Group-level rewards, concurrent reward functions and the reward pool's size."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs import MultiTurnEnv, SingleTurnEnv, group_reward
from grpo.envs.base import GroupScoring
from grpo.envs.rewards import REWARD_POOL, RewardPool, RewardSet
from grpo.orchestrator.entry import configure_rewards
from grpo.utils.errors import UserError

EXAMPLES = [{"prompt": "say something", "answer": "b"}]


def _reply(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


seen: list[dict[str, Any]] = []


@group_reward
def rank_by_length(completions: list[str], answer: str, completion_ids: list[Any]) -> list[float]:
    seen.append({"completions": list(completions), "answer": answer, "completion_ids": completion_ids})
    order = sorted(range(len(completions)), key=lambda i: len(completions[i]))
    ranks = [0.0] * len(completions)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def exact(completion: str, answer: str) -> float:
    return float(completion == answer)


def test_a_group_reward_gets_the_whole_group_and_its_values_land_per_completion() -> None:
    seen.clear()
    env = SingleTurnEnv(EXAMPLES, [exact, rank_by_length], weights=[1.0, 0.5])
    assert isinstance(env, GroupScoring)
    texts = ["ccc", "b", "aa"]
    scores = asyncio.run(env.score_group(EXAMPLES[0], [_reply(t) for t in texts], [[1, 2, 3], [4], [5, 6]]))
    assert seen == [{"completions": texts, "answer": "b", "completion_ids": [[1, 2, 3], [4], [5, 6]]}]
    assert [s.metrics for s in scores] == [
        {"exact": 0.0, "rank_by_length": 2.0},
        {"exact": 1.0, "rank_by_length": 0.0},
        {"exact": 0.0, "rank_by_length": 1.0},
    ]
    assert [s.reward for s in scores] == [1.0, 1.0, 0.5]


def test_an_env_without_group_rewards_is_scored_rollout_by_rollout() -> None:
    assert not isinstance(SingleTurnEnv(EXAMPLES, [exact]), GroupScoring)


def test_a_group_reward_returning_the_wrong_count_fails_the_group() -> None:
    @group_reward
    def one_value(completions: list[str]) -> list[float]:
        return [1.0]

    env = SingleTurnEnv(EXAMPLES, [exact, one_value])
    scores = asyncio.run(env.score_group(EXAMPLES[0], [_reply("a"), _reply("b")], [None, None]))
    assert [s.failure for s in scores] == ["reward one_value returned a bad list"] * 2


def test_a_multi_turn_env_refuses_a_group_reward() -> None:
    with pytest.raises(UserError, match="single-turn rollouts only"):
        MultiTurnEnv(EXAMPLES, [rank_by_length], max_turns=2)
    assert isinstance(MultiTurnEnv(EXAMPLES, [rank_by_length], max_turns=1), GroupScoring)


def test_two_slow_async_rewards_of_one_rollout_take_one_delay_not_two() -> None:
    async def slow_a(completion: str) -> float:
        await asyncio.sleep(0.4)
        return 1.0

    async def slow_b(completion: str) -> float:
        await asyncio.sleep(0.4)
        return 2.0

    rewards = RewardSet("toy", [slow_a, slow_b])
    started = time.monotonic()
    score = asyncio.run(rewards.score({"completion": "x"}))
    elapsed = time.monotonic() - started
    assert score.reward == 3.0 and score.metrics == {"slow_a": 1.0, "slow_b": 2.0}
    assert elapsed < 0.7, elapsed


def test_each_function_keeps_its_own_timeout_and_failure_reason() -> None:
    async def hangs(completion: str) -> float:
        await asyncio.sleep(10)
        return 1.0

    def fine(completion: str) -> float:
        return 0.5

    score = asyncio.run(RewardSet("toy", [fine, hangs], timeout=0.2).score({"completion": "x"}))
    assert score.failure == "reward hangs timed out after 0.2s"
    assert score.metrics == {"fine": 0.5} and score.reward == 0.0


def test_the_reward_pool_is_sized_by_reward_threads() -> None:
    class NoClient:
        base_urls = ()

    before = REWARD_POOL.max_workers
    try:
        configure_rewards(OrchestratorConfig(reward_threads=3), NoClient())  # type: ignore[arg-type]
        assert REWARD_POOL.max_workers == 3
    finally:
        REWARD_POOL.resize(before)
    assert OrchestratorConfig().reward_threads == 8


def test_a_pool_of_two_runs_two_sync_rewards_at_once_and_queues_the_third() -> None:
    pool = RewardPool(max_workers=2)

    def sleepy() -> float:
        time.sleep(0.3)
        return 1.0

    async def main() -> float:
        started = time.monotonic()
        await asyncio.gather(*(pool.run(sleepy, {}, 5.0) for _ in range(3)))
        return time.monotonic() - started

    elapsed = asyncio.run(main())
    assert 0.55 < elapsed < 1.0, elapsed
