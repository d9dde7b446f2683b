"""Reward functions: non-finite values fail the rollout; hanging ones are bounded and isolated."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading

import pytest

from grpo.envs.rewards import RewardSet


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_fails_the_rollout(bad: float) -> None:
    def broken(completion: str) -> float:
        return bad

    score = asyncio.run(RewardSet("toy", [broken]).score({"completion": "x"}))
    assert score.failed and score.reward == 0.0
    assert score.failure == f"reward broken returned {bad}, not a finite number"


def test_hanging_rewards_time_out_without_starving_the_default_pool() -> None:
    release = threading.Event()

    def hangs(completion: str) -> float:
        release.wait()
        return 1.0

    rewards = RewardSet("toy", [hangs], timeout=0.3)

    async def main() -> tuple[list, int]:
        try:
            scores = await asyncio.gather(*(rewards.score({"completion": "x"}) for _ in range(40)))
            # batch sends, checkpoint saves and policy polling use the default pool: it must still run
            done = await asyncio.wait_for(asyncio.to_thread(lambda: 7), timeout=5)
            return scores, done
        finally:
            release.set()  # before asyncio.run joins the default pool's threads

    scores, done = asyncio.run(main())
    assert done == 7
    assert all(s.failed and "timed out after 0.3s" in (s.failure or "") for s in scores)


def test_a_hung_reward_does_not_keep_the_process_alive() -> None:
    code = (
        "import asyncio, threading\n"
        "from grpo.envs.rewards import RewardSet\n"
        "def hangs(completion): threading.Event().wait()\n"
        "print(asyncio.run(RewardSet('toy', [hangs], timeout=0.2).score({'completion': 'x'})).failure)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "timed out" in result.stdout, result.stderr


def test_a_user_environments_reward_mistakes_are_user_errors_naming_the_env() -> None:
    from grpo.envs.single_turn import SingleTurnEnv
    from grpo.utils.errors import UserError

    with pytest.raises(UserError, match="env mine: an environment needs at least one reward function"):
        SingleTurnEnv([{"prompt": "p"}], rewards=[], name="mine")
    with pytest.raises(UserError, match="env mine: 2 reward weights for 1 reward functions"):
        RewardSet("mine", [lambda completion: 1.0], weights=[1.0, 2.0])
    with pytest.raises(UserError, match="reward timeout must be > 0"):
        RewardSet("mine", [lambda completion: 1.0], timeout=0)
