"""An `openenv:` environment in the orchestrator's rollout loop (fake inference server, the real guess
server of tests/openenv_fixtures.py): each step's reward lands on the model turn it reacts to, and
per-turn credit trains each turn on its own return."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from openenv_fixtures import WRONG, guess_server, target
from orchestrator_fakes import FakeClient, fake_tokenizer

from grpo.config.orchestrator import AdvantageConfig, EnvConfig
from grpo.envs.loading import load_environment
from grpo.inference.types import Completion, GenerateRequest, SamplingParams
from grpo.orchestrator.batching.turn_credit import per_turn_advantages
from grpo.orchestrator.rollouts.rollout import GroupRequest, RolloutRunner
from grpo.orchestrator.scheduler import PolicyTracker


class ScriptedClient(FakeClient):
    """Replies with the next text of `script` on each generate call (one rollout at a time)."""

    def __init__(self, script: list[str]) -> None:
        super().__init__()
        self.script = list(script)

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        text = self.script.pop(0)
        return [Completion([7, 8], [-0.5, -0.5], text, "stop") for _ in range(request.n)]


def test_openenv_step_rewards_are_the_turn_rewards_of_the_rollout(tmp_path: Path) -> None:
    right = target(0)
    with guess_server() as address:
        env = load_environment(
            EnvConfig(
                id=f"openenv:http://{address}", args={"num_examples": 1, "max_turns": 3, "max_sessions": 1}
            )
        )
        # one rollout guesses too high, then right; the other is right at once (one rollout per group:
        # the script is read in order)
        client = ScriptedClient([str(right + 2), str(right), str(right)])
        runner = RolloutRunner(client, fake_tokenizer(), PolicyTracker(tmp_path, client, "default", "m"))  # type: ignore[arg-type]
        slow, fast = [
            asyncio.run(
                runner.run_group(GroupRequest(0, env, 0, env.examples[0], 1, SamplingParams()))
            ).rollouts[0]
            for _ in range(2)
        ]
    assert slow.failure is None and fast.failure is None
    assert slow.turn_rewards == [WRONG, 1.0] and slow.reward == pytest.approx(WRONG + 1.0)
    assert fast.turn_rewards == [1.0] and fast.reward == 1.0

    cfg = AdvantageConfig(turn_credit="per_turn")
    (advantages,) = per_turn_advantages(
        cfg,
        [[slow.turn_rewards, fast.turn_rewards]],
        [[slow.turn_num_model_tokens(), fast.turn_num_model_tokens()]],
        np.ones((1, 2), dtype=bool),
    )
    # turn 0: returns WRONG + 1 and 1, mean 1 + WRONG / 2; turn 1 only the slow rollout reached
    assert advantages[0].tolist() == pytest.approx([WRONG / 2, 0.0])
    assert advantages[1].tolist() == pytest.approx([-WRONG / 2])


@pytest.mark.parametrize("max_turns", [1, 3])
def test_a_group_larger_than_the_servers_sessions_plays_one_rollout_after_another(
    tmp_path: Path, max_turns: int
) -> None:
    """Each rollout holds its server session from reset to score: with one session and a group of two
    the second waits for the first to be scored (holding every session until the group had played
    waited forever)."""
    right = target(0)
    with guess_server() as address:
        env = load_environment(
            EnvConfig(
                id=f"openenv:http://{address}",
                args={"num_examples": 1, "max_turns": max_turns, "max_sessions": 1},
            )
        )
        client = ScriptedClient([str(right + 2), str(right), str(right)])
        runner = RolloutRunner(client, fake_tokenizer(), PolicyTracker(tmp_path, client, "default", "m"))  # type: ignore[arg-type]
        request = GroupRequest(0, env, 0, env.examples[0], 2, SamplingParams())
        group = asyncio.run(asyncio.wait_for(runner.run_group(request), timeout=60))
    assert [r.failure for r in group.rollouts] == [None, None]
    if max_turns == 1:  # one generate call for the group: both guessed too high, once
        assert [r.turn_rewards for r in group.rollouts] == [[WRONG], [WRONG]]
    else:  # the first rollout played its whole episode before the second reset
        assert [r.turn_rewards for r in group.rollouts] == [[WRONG, 1.0], [1.0]]
