"""A failed rollout never trains and never counts as reward 0: under on_rollout_failure exclude its
group trains on the rollouts that finished, advantages computed from them alone (a group left with
fewer than 2 is dropped); under drop_group its group is dropped."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from orchestrator_fakes import FakeClient, FakeTrainer, QueueSender, fake_tokenizer

from grpo.config.orchestrator import AdvantageConfig, OrchestratorConfig
from grpo.envs import SingleTurnEnv
from grpo.orchestrator.batching.advantage import compute_advantages
from grpo.orchestrator.batching.rollout_failures import RolloutFailureRule, drop_groups_with_failures
from grpo.orchestrator.batching.step_batch import build_batch
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.orchestrator.reporting.rollout_log import read_rollouts, rollouts_file
from grpo.orchestrator.types import Group, Rollout
from grpo.transport.batches.batch import TrainingBatch
from grpo.transport.batches.wire import decode_batch, encode_batch
from grpo.utils.jsonl import read_jsonl

VOCAB = 1000
NUM_COMPLETION_TOKENS = 3
_ESTIMATORS = ["default", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]


def _group(example_index: int, rewards: list[float], failed: tuple[int, ...] = ()) -> Group:
    """A group of rollouts with `rewards`; those at the `failed` indices failed (their environment raised)."""
    rollouts = []
    for i, reward in enumerate(rewards):
        rollout = Rollout(
            env_name="toy",
            example_index=example_index,
            prompt_ids=[1, 2, 3, 4, 5],
            completion_ids=[10 + i, 20 + i, 30 + i],
            completion_mask=[True] * NUM_COMPLETION_TOKENS,
            completion_logprobs=[-0.1] * NUM_COMPLETION_TOKENS,
            temperature=1.0,
            start_version=0,
            end_version=0,
            reward=reward,
        )
        if i in failed:
            rollout.fail("env toy: reset raised RuntimeError")
        rollouts.append(rollout)
    return Group(env_index=0, example={}, example_index=example_index, rollouts=rollouts)


def _cfg(
    advantage: dict[str, object], shared_prefix: bool = True, rollouts_per_example: int = 4
) -> OrchestratorConfig:
    return OrchestratorConfig.model_validate(
        {
            "model": {"name": "base-model"},
            "batch_size": 2 * rollouts_per_example,
            "rollouts_per_example": rollouts_per_example,
            "seq_len": 64,
            "shared_prefix": shared_prefix,
            "advantage": advantage,
        }
    )


def _build(cfg: OrchestratorConfig, groups: list[Group]) -> tuple[TrainingBatch, dict[str, float]]:
    stats: dict[str, float] = {}
    batch, rollouts = build_batch(cfg, VOCAB, 0, 0, groups, stats)
    assert len(rollouts) == sum(len(g.rollouts) for g in groups)  # the step's metrics see every rollout
    return decode_batch(encode_batch(batch), VOCAB), stats  # the trainer's receive refuses bad values


def _trained_advantages(batch: TrainingBatch) -> list[float]:
    """Each trained sample's advantage, sorted (a sample's loss tokens all carry it)."""
    values = np.concatenate([row.advantages[row.loss_mask] for row in batch.rows])
    per_sample = values.reshape(-1, NUM_COMPLETION_TOKENS)
    assert np.all(per_sample == per_sample[:, :1])
    return sorted(per_sample[:, 0].tolist())


def test_exclude_is_the_default() -> None:
    assert AdvantageConfig().on_rollout_failure == "exclude"


@pytest.mark.parametrize("advantage_type", _ESTIMATORS)
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_exclude_trains_the_finished_rollouts_on_advantages_computed_from_them_alone(
    advantage_type: str, shared_prefix: bool
) -> None:
    rewards = [1.0, 7.0, 0.0, 0.5]  # the failed rollout's reward would move every baseline
    group = _group(0, rewards, failed=(1,))
    batch, stats = _build(_cfg({"type": advantage_type}, shared_prefix), [group])

    finished = np.array([[1.0, 0.0, 0.5]])
    expected = compute_advantages(
        AdvantageConfig(type=advantage_type), finished, np.full(finished.shape, NUM_COMPLETION_TOKENS)
    )[0]
    assert np.abs(expected).max() > 0.1  # the check below can tell a wrong baseline
    got = [r.advantage for i, r in enumerate(group.rollouts) if i != 1]
    assert got == pytest.approx(expected.tolist(), abs=1e-9)
    assert group.rollouts[1].advantage == 0.0 and group.rollouts[1].masked
    # Only the 3 finished rollouts are in the batch (the failed one is not sent at all).
    assert batch.num_loss_samples == 3 and batch.num_loss_tokens == 3 * NUM_COMPLETION_TOKENS
    assert (
        sum(row.num_tokens for row in batch.rows)
        == (5 if shared_prefix else 3 * 5) + 3 * NUM_COMPLETION_TOKENS
    )
    assert _trained_advantages(batch) == pytest.approx(sorted(expected.tolist()), abs=1e-6)
    assert stats["rollouts/num_failed"] == 1 and stats["failed/num_groups"] == 0


def test_exclude_drops_a_group_left_with_one_finished_rollout() -> None:
    kept, dropped = (
        _group(0, [1.0, 0.0, 0.5, 0.25], failed=(0,)),
        _group(1, [1.0, 0.0, 0.5, 0.25], failed=(0, 1, 3)),
    )
    batch, stats = _build(_cfg({"type": "grpo"}), [kept, dropped])
    assert all(r.failure is not None and r.masked and r.advantage == 0.0 for r in dropped.rollouts)
    assert batch.num_loss_samples == 3  # kept's finished rollouts only
    assert stats["rollouts/num_failed"] == 1 + 3 and stats["failed/num_groups"] == 1


def test_drop_group_drops_every_group_with_a_failed_rollout() -> None:
    clean, flaky = _group(0, [1.0, 0.0, 0.5, 0.25]), _group(1, [1.0, 0.0, 0.5, 0.25], failed=(2,))
    batch, stats = _build(_cfg({"type": "grpo", "on_rollout_failure": "drop_group"}), [clean, flaky])
    assert all(r.failure is not None and r.advantage == 0.0 for r in flaky.rollouts)
    assert "drop_group" in str(flaky.rollouts[0].failure)
    assert all(r.failure is None for r in clean.rollouts)
    expected = compute_advantages(
        AdvantageConfig(type="grpo"), np.array([[1.0, 0.0, 0.5, 0.25]]), np.full((1, 4), 3)
    )
    assert [r.advantage for r in clean.rollouts] == pytest.approx(expected[0].tolist())
    assert batch.num_loss_samples == 4
    assert stats["rollouts/num_failed"] == 1 and stats["failed/num_groups"] == 1


@pytest.mark.parametrize("rule", ["exclude", "drop_group"])
def test_a_step_whose_rollouts_all_failed_sends_a_batch_with_nothing_to_train(rule: str) -> None:
    groups = [_group(0, [0.0] * 4, failed=(0, 1, 2, 3)), _group(1, [0.0] * 4, failed=(0, 1, 2, 3))]
    batch, stats = _build(_cfg({"type": "grpo", "on_rollout_failure": rule}), groups)
    assert batch.rows == []
    assert stats["rollouts/num_failed"] == 8 and stats["failed/num_groups"] == 2


def test_a_group_of_one_rollout_that_finished_is_kept() -> None:
    # rollouts_per_example 1 (REINFORCE++): no group to compare with, nothing failed, nothing dropped.
    groups = [_group(0, [1.0]), _group(1, [0.0])]
    assert drop_groups_with_failures("exclude", groups) == (0, 0)
    assert all(r.failure is None for g in groups for r in g.rollouts)


@pytest.mark.parametrize("rule", ["exclude", "drop_group"])
def test_a_group_without_failures_is_untouched_by_either_rule(rule: RolloutFailureRule) -> None:
    group = _group(0, [1.0, 0.0, 0.5, 0.25])
    assert drop_groups_with_failures(rule, [group]) == (0, 0)
    assert all(r.failure is None and not r.masked for r in group.rollouts)


class FlakyEnv(SingleTurnEnv):
    """Its reset raises for 1 rollout in 4 (the second of every four it starts: a group's resets run
    one after another); every other rollout's reward is its start index mod 4, over 4, so a group's
    finished rollouts have different rewards."""

    def __init__(self) -> None:
        super().__init__(
            examples=[{"prompt": f"question {i}"} for i in range(8)], rewards=[self.indexed], name="flaky"
        )
        self.num_resets = 0

    async def reset(self, example: dict[str, Any]) -> dict[str, Any]:
        index, self.num_resets = self.num_resets, self.num_resets + 1
        if index % 4 == 1:
            raise RuntimeError("the sandbox did not start")
        return {"index": index}

    @staticmethod
    def indexed(state: dict[str, Any]) -> float:
        return state["index"] % 4 / 4


def _flaky_run(
    tmp_path: Path, rule: str
) -> tuple[list[TrainingBatch], list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """Two steps of 2 groups x 4 rollouts (advantage.type grpo): the batches the trainer received, the
    metrics rows, and each step's rollout log grouped by group."""
    cfg = OrchestratorConfig.model_validate(
        {
            "model": {"name": "base-model"},
            "batch_size": 8,
            "rollouts_per_example": 4,
            "seq_len": 64,
            "max_steps": 2,
            "advantage": {"type": "grpo", "on_rollout_failure": rule},
        }
    )
    sender = QueueSender(maxsize=1)
    trainer = FakeTrainer(sender, tmp_path, 2)
    trainer.start()
    orch = Orchestrator(cfg, FakeClient(), sender, tmp_path, fake_tokenizer(), [FlakyEnv()])
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
    trainer.join(timeout=30)
    assert trainer.error is None, trainer.error
    logged = [read_rollouts(rollouts_file(tmp_path, step)) for step in range(2)]
    groups = [records[i : i + 4] for records in logged for i in range(0, len(records), 4)]
    return trainer.received, read_jsonl(tmp_path / "metrics.jsonl"), groups


def _raised(record: dict[str, Any]) -> bool:
    return "reset raised RuntimeError" in str(record["failure"])


def test_an_env_raising_for_one_rollout_in_four_trains_the_other_three_under_exclude(tmp_path: Path) -> None:
    batches, metrics, groups = _flaky_run(tmp_path, "exclude")
    assert len(groups) == 4
    for group in groups:
        assert [_raised(r) for r in group].count(True) == 1
        finished = [r for r in group if r["failure"] is None]
        rewards = np.array([r["reward"] for r in finished])
        expected = (rewards - rewards.mean()) / rewards.std(ddof=1)  # grpo over the finished rollouts
        assert [r["advantage"] for r in finished] == pytest.approx(expected.tolist(), abs=1e-9)
        assert [r["advantage"] for r in group if r["failure"] is not None] == [0.0]
    assert [r["rollouts/num_failed"] for r in metrics] == [2, 2]
    assert [r["failed/num_groups"] for r in metrics] == [0, 0]
    assert [b.num_loss_samples for b in batches] == [6, 6]  # the failed rollouts were not sent


def test_an_env_raising_for_one_rollout_in_four_drops_every_group_under_drop_group(tmp_path: Path) -> None:
    batches, metrics, groups = _flaky_run(tmp_path, "drop_group")
    assert len(groups) == 4
    for group in groups:
        assert [_raised(r) for r in group].count(True) == 1
        assert all(r["failure"] is not None and r["advantage"] == 0.0 for r in group)
    assert [r["rollouts/num_failed"] for r in metrics] == [2, 2]
    assert [r["failed/num_groups"] for r in metrics] == [2, 2]
    assert [b.rows for b in batches] == [[], []]
