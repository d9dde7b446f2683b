"""On-policy distillation: batches carry the teacher's logprob of every token, aligned to input_ids."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from orchestrator_fakes import FakeClient, FakeTrainer, QueueSender, fake_tokenizer, sequence_indices

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs import SingleTurnEnv
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.transport.batches.batch import TrainingBatch


def teacher_logprob(prefix: list[int], token: int) -> float:
    """The fake teacher's log p(token | prefix): depends on both, so misalignment shows."""
    return -((token * 7 + len(prefix)) % 13) / 4 - 0.125


class FakeTeacher(FakeClient):
    """A teacher server: scores token sequences, never samples."""

    def __init__(self) -> None:
        super().__init__()
        self.scored: list[tuple[list[int], str]] = []

    async def prompt_logprobs(self, token_ids: list[int], model: str) -> list[float]:
        self.scored.append((list(token_ids), model))
        return [0.0] + [teacher_logprob(token_ids[:t], token_ids[t]) for t in range(1, len(token_ids))]


def _cfg(teacher: dict[str, object] | None) -> OrchestratorConfig:
    return OrchestratorConfig.model_validate(
        {
            "model": {"name": "student"},
            "batch_size": 4,
            "rollouts_per_example": 2,
            "seq_len": 128,
            "max_steps": 2,
            "teacher_model": teacher,
        }
    )


def _env() -> SingleTurnEnv:
    examples = [{"prompt": "q" * (i + 1), "answer": "ok"} for i in range(6)]
    return SingleTurnEnv(examples=examples, rewards=[lambda completion: 1.0], name="toy")


def _run(
    tmp_path: Path, cfg: OrchestratorConfig, client: FakeClient, teacher: FakeClient | None
) -> list[TrainingBatch]:
    sender = QueueSender(maxsize=1)
    trainer = FakeTrainer(sender, tmp_path, cfg.max_steps or 0)
    trainer.start()
    orch = Orchestrator(cfg, client, sender, tmp_path, fake_tokenizer(), [_env()], teacher_client=teacher)
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
    trainer.join(timeout=30)
    assert trainer.error is None, trainer.error
    return trainer.received


def test_batches_carry_teacher_logprobs_aligned_to_tokens(tmp_path: Path) -> None:
    policy, teacher = FakeClient(), FakeTeacher()
    batches = _run(tmp_path, _cfg({"model": {"name": "teacher-model"}}), policy, teacher)
    assert len(batches) == 2
    num_samples = 0
    for batch in batches:
        for row in batch.rows:
            assert row.teacher_logprobs is not None
            row.validate()
            for sample in sequence_indices(row):
                ids = row.input_ids[sample].tolist()
                expected = [0.0] + [teacher_logprob(ids[:t], ids[t]) for t in range(1, len(ids))]
                np.testing.assert_allclose(row.teacher_logprobs[sample], expected, rtol=0, atol=1e-6)
                num_samples += 1
    assert num_samples == 2 * 4
    # every rollout scored whole (prompt + completion) by the teacher model, on the teacher's server
    assert {model for _, model in teacher.scored} == {"teacher-model"}
    scored = {tuple(ids) for ids, _ in teacher.scored}
    packed = {
        tuple(row.input_ids[s].tolist()) for b in batches for row in b.rows for s in sequence_indices(row)
    }
    assert packed <= scored


def test_without_a_teacher_client_the_policy_servers_score_the_teacher(tmp_path: Path) -> None:
    policy = FakeTeacher()
    batches = _run(tmp_path, _cfg({"model": {"name": "teacher-model"}}), policy, None)
    assert all(row.teacher_logprobs is not None for b in batches for row in b.rows)
    assert {model for _, model in policy.scored} == {"teacher-model"}


def test_no_teacher_means_no_teacher_logprobs(tmp_path: Path) -> None:
    policy = FakeTeacher()
    batches = _run(tmp_path, _cfg(None), policy, None)
    assert all(row.teacher_logprobs is None for b in batches for row in b.rows)
    assert policy.scored == []


def test_a_teacher_server_gets_no_api_key_unless_its_own_variable_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from grpo.inference.client import InferenceClient

    monkeypatch.setenv("VLLM_API_KEY", "the-runs-own-inference-key-0123456789")
    monkeypatch.setenv("TEACHER_KEY", "the-teachers-key-0123456789abcdef")
    elsewhere = {"base_url": ["http://teacher.example:8000/v1"]}

    async def headers(client_cfg: dict[str, object]) -> dict[str, str]:
        cfg = _cfg({"model": {"name": "teacher"}, "client": client_cfg})
        assert cfg.teacher_model is not None and cfg.teacher_model.client is not None
        client = InferenceClient(cfg.teacher_model.client)
        try:
            return dict(client._http.headers)
        finally:
            await client.close()

    assert "authorization" not in asyncio.run(headers(elsewhere))
    named = asyncio.run(headers({**elsewhere, "api_key_var": "TEACHER_KEY"}))
    assert named["authorization"] == "Bearer the-teachers-key-0123456789abcdef"
    # the policy's own servers still get the run's key
    policy = InferenceClient(_cfg(None).client)
    assert policy._http.headers["authorization"] == "Bearer the-runs-own-inference-key-0123456789"
    asyncio.run(policy.close())
