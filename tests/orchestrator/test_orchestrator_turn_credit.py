"""A whole orchestrator run (fake server and trainer) with per-turn credit: an environment that rewards
turns, each step's rollout log holding the per-turn advantages computed by hand, the per-turn
metrics, and batches whose loss tokens carry their turn's advantage."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from orchestrator_fakes import FakeClient, FakeTrainer, QueueSender, fake_tokenizer

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs import EnvReply, Message, MultiTurnEnv
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.orchestrator.reporting.rollout_log import read_rollouts, rollouts_file
from grpo.utils.jsonl import read_jsonl


class HalfTheTimeEnv(MultiTurnEnv):
    """Rewards the first turn of every other rollout with 1.0; the score gives 0.5 to every rollout."""

    async def reset(self, example: Any) -> dict[str, Any]:
        self.count = getattr(self, "count", 0) + 1
        return {"rewarded": self.count % 2 == 0}

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        reward = 1.0 if state["rewarded"] else None
        return EnvReply([{"role": "user", "content": "again"}], done=False, reward=reward)


def test_a_run_with_per_turn_credit_trains_each_turn_on_its_own_return(tmp_path: Path) -> None:
    env = HalfTheTimeEnv(
        examples=[{"prompt": f"q {i}"} for i in range(8)], rewards=[lambda completion: 0.5], max_turns=2
    )
    cfg = OrchestratorConfig.model_validate(
        {
            "model": {"name": "base-model"},
            "batch_size": 8,
            "rollouts_per_example": 4,
            "seq_len": 64,
            "max_steps": 2,
            "advantage": {"type": "default", "turn_credit": "per_turn", "turn_discount": 0.5},
        }
    )
    sender = QueueSender(maxsize=1)
    trainer = FakeTrainer(sender, tmp_path, 2)
    trainer.start()
    orch = Orchestrator(cfg, FakeClient(reply="ok"), sender, tmp_path, fake_tokenizer(), [env])
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
    trainer.join(timeout=30)
    assert trainer.error is None, trainer.error

    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for step, record in enumerate(records):
        assert record["reward/turn_1/mean"] == 0.5 and "advantage/turn_1/std" in record
        rollouts = read_rollouts(rollouts_file(tmp_path, step))
        token_advantages = set()
        for start in range(0, len(rollouts), 4):
            group = rollouts[start : start + 4]
            first = np.array([r["turn_rewards"][0] for r in group])
            assert all(r["turn_rewards"][1] == 0.5 for r in group)
            returns0 = first + 0.5 * 0.5  # r_0 + gamma * r_1
            for record_, a0 in zip(group, returns0 - returns0.mean(), strict=True):
                # every rollout's turn 1 has the same return: advantage 0
                assert record_["turn_advantages"] == pytest.approx([a0, 0.0])
                assert record_["reward"] == pytest.approx(record_["turn_rewards"][0] + 0.5)
                token_advantages.add(round(float(a0), 6))
        assert len(token_advantages) > 1  # the groups mix rewarded and unrewarded first turns
        # the batch's loss tokens carry exactly these per-turn advantages (and turn 1's 0)
        batch = trainer.received[step]
        sent = {round(float(a), 6) for row in batch.rows for a in row.advantages[row.loss_mask]}
        assert sent == token_advantages | {0.0}
