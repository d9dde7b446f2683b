"""Streaming: the orchestrator sends each step in parts of finished groups, under the same rules."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
from orchestrator_fakes import FakeClient, fake_tokenizer, policies_in
from pydantic import ValidationError

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs import SingleTurnEnv
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.transport.batches.batch import TrainingBatch
from grpo.transport.batches.memory import memory_transport_pair
from grpo.transport.batches.parts import PartReceiver
from grpo.utils.atomic import publish_dir, staging_dir
from grpo.utils.jsonl import read_jsonl


def _env() -> SingleTurnEnv:
    examples = [{"prompt": f"question {i}", "answer": "ok"} for i in range(20)]

    def length_reward(completion: str, answer: str) -> float:
        return float(len(completion) % 3)

    return SingleTurnEnv(examples=examples, rewards=[length_reward], name="toy")


def _cfg(**overrides: object) -> OrchestratorConfig:
    base: dict[str, object] = {
        "model": {"name": "base-model"},
        "batch_size": 8,
        "rollouts_per_example": 2,
        "seq_len": 64,
        "max_steps": 4,
        "shared_prefix": False,
        "streaming": {"groups_per_part": 3},
    }
    return OrchestratorConfig.model_validate({**base, **overrides})


class _PartTrainer(threading.Thread):
    """Receives every part of step n, then publishes policy n + 1."""

    def __init__(self, receiver: PartReceiver, run_dir: Path, num_steps: int) -> None:
        super().__init__(daemon=True)
        self.receiver, self.run_dir, self.num_steps = receiver, run_dir, num_steps
        self.parts: list[list[TrainingBatch]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for step in range(self.num_steps):
                self.parts.append(
                    [self.receiver.receive(step, 30, k) for k in range(self.receiver.num_parts)]
                )
                threading.Event().wait(0.02)
                final = self.run_dir / "broadcasts" / f"step_{step + 1}"
                staged = staging_dir(final)
                (staged / "adapter_config.json").write_text("{}")
                publish_dir(staged, final)
        except BaseException as exc:
            self.error = exc


def _num_sequences(batch: TrainingBatch) -> int:
    return sum(int((row.position_ids == 0).sum()) for row in batch.rows)


@pytest.mark.parametrize("max_async_level", [0, 1])
def test_each_step_arrives_in_parts_of_finished_groups_within_the_staleness_bound(
    tmp_path: Path, max_async_level: int
) -> None:
    cfg = _cfg(max_async_level=max_async_level, max_off_policy_steps=max_async_level)
    assert cfg.num_parts_per_step == 2  # 4 groups in parts of 3: the last part holds 1
    sender, receiver = memory_transport_pair((cfg.max_async_level + 1) * cfg.num_parts_per_step)
    trainer = _PartTrainer(PartReceiver(receiver, cfg.num_parts_per_step), tmp_path, 4)
    trainer.start()
    orch = Orchestrator(cfg, FakeClient(delay=0.005), sender, tmp_path, fake_tokenizer(), [_env()])
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
    trainer.join(timeout=30)
    assert trainer.error is None, trainer.error
    assert len(trainer.parts) == 4
    for step, parts in enumerate(trainer.parts):
        assert [p.step for p in parts] == [step, step]
        assert [_num_sequences(p) for p in parts] == [6, 2]  # groups of 2 rollouts
        for part in parts:
            for version in policies_in(part):
                assert 0 <= step - version <= max_async_level, (step, version)
            # Per-group advantages: each part's advantages sum to zero over its groups.
            advantages = np.concatenate([r.advantages[r.loss_mask] for r in part.rows])
            assert abs(float(advantages.sum())) < 1e-4
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(0 < r["packing/efficiency"] <= 1 and r["packing/num_rows"] >= 2 for r in records)


@pytest.mark.parametrize("advantage", ["reinforce_pp", "reinforce_pp_baseline"])
def test_streaming_refuses_batch_wide_advantages_at_load(advantage: str) -> None:
    with pytest.raises(ValidationError, match=r"streaming\.groups_per_part needs a per-group advantage"):
        _cfg(advantage={"type": advantage})


def test_streaming_is_off_by_default() -> None:
    assert OrchestratorConfig().num_parts_per_step == 1
