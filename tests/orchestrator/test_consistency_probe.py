"""The orchestrator's half of the consistency check: at a check step it waits for the servers to run
the policy the trainer will compute the batch with, samples fresh completions under it, and ships
the engine's top tokens at each of their positions with the batch; other steps carry no probe."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from orchestrator_fakes import VERSION_TOKEN_BASE, FakeClient, FakeTrainer, QueueSender, fake_tokenizer

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs import SingleTurnEnv
from grpo.orchestrator.consistency_probe import top_arrays
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.transport.batches.batch import TrainingBatch
from grpo.utils.errors import UserError


def _run(tmp_path: Path, client: FakeClient, max_async_level: int = 1) -> list[TrainingBatch]:
    cfg = OrchestratorConfig.model_validate(
        {
            "model": {"name": "base-model", "lora_adapter": "default"},
            "batch_size": 8,
            "rollouts_per_example": 2,
            "seq_len": 64,
            "max_steps": 5,
            "max_async_level": max_async_level,
            "consistency_check": {"interval": 2, "num_samples": 2, "top_logprobs": 2},
        }
    )
    env = SingleTurnEnv(examples=[{"prompt": f"question {i}"} for i in range(20)], rewards=[lambda: 1.0])
    sender = QueueSender(maxsize=1)
    trainer = FakeTrainer(sender, tmp_path, 5, train_seconds=0.05)
    trainer.start()
    orch = Orchestrator(cfg, client, sender, tmp_path, fake_tokenizer(), [env])
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
    trainer.join(timeout=30)
    assert trainer.error is None, trainer.error
    return trainer.received


def test_check_steps_carry_a_probe_of_the_policy_the_trainer_computes_them_with(tmp_path: Path) -> None:
    batches = _run(tmp_path, FakeClient(delay=0.005, num_tokens=3))
    assert [b.consistency_probe is not None for b in batches] == [True, False, True, False, True]
    for batch in batches[::2]:
        probe = batch.consistency_probe
        assert probe is not None and probe.policy_version == batch.step
        assert len(probe.sequences) == 2
        policy_token = VERSION_TOKEN_BASE + batch.step
        for sequence in probe.sequences:
            # sampled fresh by policy `step`, though async 1 lets the batch's rollouts be older
            assert sequence.input_ids[sequence.num_prompt_tokens :].tolist() == [policy_token] * 3
            assert sequence.engine_top_ids.tolist() == [[policy_token, 1]] * 3
            np.testing.assert_allclose(sequence.engine_top_logprobs, [[-0.1, -2.5]] * 3)
            assert sequence.engine_prompt_matches


def test_a_server_template_unlike_the_orchestrator_s_is_reported(tmp_path: Path) -> None:
    batches = _run(
        tmp_path, FakeClient(num_tokens=2, template_prefix="<system>be brief|\n"), max_async_level=0
    )
    probe = batches[0].consistency_probe
    assert probe is not None
    assert [s.engine_prompt_matches for s in probe.sequences] == [False, False]


def test_top_arrays_rank_each_position_and_drop_the_own_token_past_the_top() -> None:
    entries: list[dict[int, float] | None] = [{5: -1.0, 7: -0.5, 9: -4.0}, {3: -0.2, 4: -2.0}]
    ids, logprobs = top_arrays(entries, 2)
    assert ids.tolist() == [[7, 5], [3, 4]]
    assert logprobs.tolist() == [[-0.5, -1.0], [-0.20000000298023224, -2.0]]
    assert ids.dtype == np.int32 and logprobs.dtype == np.float32


class _RefusingClient(FakeClient):
    """A server started without a max_logprobs the check asks for."""

    async def prompt_top_logprobs(
        self, token_ids: list[int], model: str, num_top: int
    ) -> list[dict[int, float] | None]:
        raise RuntimeError(
            "http://s/v1/completions: HTTP 400: Requested prompt logprobs of 2, which is greater than max allowed: 1"
        )


def test_a_server_that_refuses_the_top_logprobs_ends_the_run_naming_max_logprobs(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"start it with max_logprobs: 2 in infer.yaml"):
        _run(tmp_path, _RefusingClient(), max_async_level=0)
