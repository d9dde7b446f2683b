"""A group whose rewards or advantages the trainer would refuse fails alone, and the batch sent is
always one the trainer's own check accepts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from grpo.config.orchestrator import AdvantageConfig, OrchestratorConfig
from grpo.orchestrator.batching.advantage import compute_advantages
from grpo.orchestrator.batching.step_batch import build_batch
from grpo.orchestrator.types import Group, Rollout
from grpo.transport.batches.wire import decode_batch, encode_batch

VOCAB = 1000
_ESTIMATORS = ["default", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]


def _group(example_index: int, rewards: list[float], logprob: float = -0.1) -> Group:
    rollouts = [
        Rollout(
            env_name="toy",
            example_index=example_index,
            prompt_ids=[1, 2, 3],
            completion_ids=[10 + i, 20 + i, 30 + i],
            completion_mask=[True] * 3,
            completion_logprobs=[logprob] * 3,
            temperature=1.0,
            start_version=0,
            end_version=0,
            reward=reward,
        )
        for i, reward in enumerate(rewards)
    ]
    return Group(env_index=0, example={}, example_index=example_index, rollouts=rollouts)


def _cfg(advantage_type: str) -> OrchestratorConfig:
    return OrchestratorConfig.model_validate(
        {
            "model": {"name": "base-model"},
            "batch_size": 12,
            "rollouts_per_example": 4,
            "seq_len": 64,
            "advantage": {"type": advantage_type},
        }
    )


def _build(advantage_type: str, groups: list[Group]) -> tuple[list[Rollout], dict[str, float], bytes]:
    stats: dict[str, float] = {}
    batch, rollouts = build_batch(_cfg(advantage_type), VOCAB, 0, 3, groups, stats)
    blob = encode_batch(batch)
    decode_batch(blob, VOCAB)  # the trainer's receive: raises on what it refuses
    return rollouts, stats, blob


_HUGE = [
    [1e308, 1e308, 0.0, 1.0],  # the group mean overflows to inf
    [2e6, 2e6 + 1, 2e6, 2e6 + 1],  # finite advantages, but a reward scale no verifiable reward has
    [1e6, -1e6, -1e6, -1e6],  # rewards within the bound, an advantage of 1.5e6 beyond it
]
# Normalised advantages stay within sqrt(group size) of any rewards: the last case only applies to
# the estimators that do not divide by a spread.
_NORMALISED = ("grpo", "reinforce_pp", "reinforce_pp_baseline")


@pytest.mark.parametrize(
    ("advantage_type", "huge"),
    [(a, h) for a in _ESTIMATORS for h in _HUGE if not (h[0] == 1e6 and a in _NORMALISED)],
)
def test_a_group_with_huge_rewards_fails_alone_and_the_batch_is_one_the_trainer_accepts(
    advantage_type: str, huge: list[float]
) -> None:
    normal_rewards = [[1.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.25, 1.0]]
    groups = [_group(0, normal_rewards[0]), _group(1, huge), _group(2, normal_rewards[1])]
    rollouts, stats, _blob = _build(advantage_type, groups)

    assert stats["failed/num_groups"] == 1
    assert all(r.failure is not None and r.masked and r.advantage == 0.0 for r in groups[1].rollouts)
    # The other groups train with the advantages they would have had without the huge one.
    expected = compute_advantages(
        AdvantageConfig(type=advantage_type), np.array(normal_rewards), np.full((2, 4), 3.0)
    )
    got = [[r.advantage for r in groups[i].rollouts] for i in (0, 2)]
    assert np.allclose(got, expected) and not any(r.masked for i in (0, 2) for r in groups[i].rollouts)
    assert len(rollouts) == 12


def test_groups_within_the_bound_are_untouched() -> None:
    groups = [_group(0, [1e6, -1e6, 1e6, -1e6]), _group(1, [1.0, 0.0, 0.0, 0.0])]
    _rollouts, stats, _blob = _build("default", groups)
    assert stats["failed/num_groups"] == 0
    assert [r.advantage for r in groups[0].rollouts] == [1e6, -1e6, 1e6, -1e6]


def test_a_group_the_trainer_check_refuses_for_other_values_is_left_out_of_the_batch() -> None:
    # A non-finite sampling logprob: no advantage is wrong, but the trainer refuses the batch.
    groups = [_group(0, [1.0, 0.0, 1.0, 0.0]), _group(1, [1.0, 0.0, 0.0, 0.0], logprob=-math.inf)]
    stats: dict[str, float] = {}
    batch, rollouts = build_batch(_cfg("grpo"), VOCAB, 0, 3, groups, stats)
    decode_batch(encode_batch(batch), VOCAB)
    assert stats["failed/num_groups"] == 1 and all(r.failure is not None for r in groups[1].rollouts)
    assert sum(int(row.loss_mask.sum()) for row in batch.rows) == 4 * 3  # group 0's completions only
    assert len(rollouts) == 8  # both groups are in the step's metrics
