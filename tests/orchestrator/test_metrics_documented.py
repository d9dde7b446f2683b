"""A whole orchestrator run (fake server and trainer) logs only names docs/metrics.md lists: the
runtime half of tests/test_metrics_page.py's source check, on a run with per-turn credit and both
rollout filters so their optional names appear too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from metrics_page import undocumented
from orchestrator_fakes import FakeClient, FakeTrainer, QueueSender, fake_tokenizer

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs import EnvReply, Message, MultiTurnEnv
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.utils.jsonl import read_jsonl


class TwoTurnEnv(MultiTurnEnv):
    """Rewards each first turn with 0.25 and asks once more."""

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        return EnvReply([{"role": "user", "content": "again"}], done=False, reward=0.25)


def test_an_orchestrator_run_logs_only_names_the_metrics_page_lists(tmp_path: Path) -> None:
    env = TwoTurnEnv(
        examples=[{"prompt": f"q {i}"} for i in range(8)],
        rewards=[lambda completion: 0.5],
        max_turns=2,
        name="toy",
    )
    cfg = OrchestratorConfig.model_validate(
        {
            "model": {"name": "base-model"},
            "batch_size": 8,
            "rollouts_per_example": 4,
            "seq_len": 64,
            "max_steps": 2,
            "advantage": {"type": "default", "turn_credit": "per_turn"},
            "filters": [{"type": "gibberish"}, {"type": "repetition"}],
        }
    )
    sender = QueueSender(maxsize=1)
    trainer = FakeTrainer(sender, tmp_path, 2)
    trainer.start()
    orch = Orchestrator(cfg, FakeClient(reply="ok"), sender, tmp_path, fake_tokenizer(), [env])
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
    trainer.join(timeout=30)
    assert trainer.error is None, trainer.error

    logged = {key for row in read_jsonl(tmp_path / "metrics.jsonl") for key in row} - {"step"}
    assert {"reward/toy/mean", "advantage/turn_1/mean", "filter/gibberish", "time/step"} <= logged
    assert not undocumented(logged), undocumented(logged)
