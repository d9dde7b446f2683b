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
from grpo.orchestrator.rollout import GroupRequest, RolloutRunner
from grpo.orchestrator.scheduler import PolicyTracker
from grpo.orchestrator.turn_credit import per_turn_advantages


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
