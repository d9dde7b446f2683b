"""The orchestrator trains on an environment served by a grpo-env server (env[].address)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from orchestrator_fakes import FakeClient, FakeTrainer, QueueSender, fake_tokenizer

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs import SingleTurnEnv
from grpo.envs.loading import load_environment
from grpo.envs.server import BackgroundServer, build_app
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.utils.jsonl import read_jsonl


def _served_env() -> SingleTurnEnv:
    def exact(completion: str, answer: str) -> float:
        return float(completion == answer)

    examples = [{"prompt": f"question {i}", "answer": "ok"} for i in range(10)]
    return SingleTurnEnv(examples=examples, rewards=[exact], name="served")


def test_loop_runs_steps_on_an_env_given_by_address(tmp_path: Path) -> None:
    app = build_app(_served_env(), "toy-server")
    with BackgroundServer(app) as address:
        cfg = OrchestratorConfig.model_validate(
            {
                "model": {"name": "base-model"},
                "env": [{"id": "toy-server", "name": "remote-toy", "address": address}],
                "batch_size": 8,
                "rollouts_per_example": 2,
                "seq_len": 64,
                "max_steps": 3,
            }
        )
        envs = [load_environment(e) for e in cfg.env]
        sender = QueueSender(maxsize=1)
        trainer = FakeTrainer(sender, tmp_path, 3)
        trainer.start()
        orch = Orchestrator(cfg, FakeClient(reply="ok"), sender, tmp_path, fake_tokenizer(), envs)
        asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
        trainer.join(timeout=30)
    assert trainer.error is None, trainer.error
    assert [b.step for b in trainer.received] == [0, 1, 2]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    # the server scored every rollout (a transport failure would score 0.0 and count as failed)
    assert all(r["failed/num_rollouts"] == 0 for r in records)
    assert all(r["reward/mean"] == 1.0 and r["reward/remote-toy/mean"] == 1.0 for r in records)
    assert len(app.state.sessions) == 0  # every session was scored and closed
