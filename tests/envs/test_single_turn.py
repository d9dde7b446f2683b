from __future__ import annotations

import asyncio

import pytest

from grpo.envs import SingleTurnEnv


def _score(env: SingleTurnEnv, completion: str, index: int = 0) -> float:
    example = env.examples[index]
    score = asyncio.run(env.score(example, [{"role": "assistant", "content": completion}], {}))
    return score.reward


def test_exact_call_with_sync_and_async_rewards_and_weights() -> None:
    def exact(completion: str, answer: str) -> float:
        return float(completion.strip() == answer)

    async def short(completion: str, **kwargs: object) -> float:
        return 1.0 if len(completion) < 5 else 0.0

    env = SingleTurnEnv(
        examples=[{"prompt": "2+2?", "answer": "4"}], rewards=[exact, short], weights=[1.0, 0.5]
    )
    assert _score(env, "4") == 1.5
    assert _score(env, "five!") == 0.0


def test_prompt_messages_accept_strings_chat_lists_and_system_prompt() -> None:
    env = SingleTurnEnv(
        examples=[{"prompt": "hi"}, {"prompt": [{"role": "user", "content": "yo"}]}],
        rewards=[lambda completion: 0.0],
        system_prompt="be brief",
    )
    assert env.prompt_messages(env.examples[0]) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert env.prompt_messages(env.examples[1])[1] == {"role": "user", "content": "yo"}


def test_raising_reward_fails_the_rollout_and_logs_once() -> None:
    def broken(completion: str) -> float:
        raise KeyError(completion)

    env = SingleTurnEnv(examples=[{"prompt": "x"}], rewards=[broken])
    scores = [
        asyncio.run(env.score(env.examples[0], [{"role": "assistant", "content": c}], {})) for c in "abc"
    ]
    assert all(s.failed and s.reward == 0.0 for s in scores)
    assert env.rewards.failures.counts == {"reward broken raised KeyError": 3}


def test_slow_reward_times_out_as_a_failure() -> None:
    async def slow(completion: str) -> float:
        await asyncio.sleep(10)
        return 1.0

    env = SingleTurnEnv(examples=[{"prompt": "x"}], rewards=[slow], reward_timeout=0.05)
    score = asyncio.run(env.score(env.examples[0], [{"role": "assistant", "content": "y"}], {}))
    assert score.failed and "timed out" in (score.failure or "")


def test_example_without_prompt_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="prompt"):
        SingleTurnEnv(examples=[{"question": "x"}], rewards=[lambda: 0.0])
