"""Per-turn credit (advantage.turn_credit per_turn) against sums written out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from grpo.config.orchestrator import AdvantageConfig
from grpo.orchestrator.batching.advantage import compute_advantages
from grpo.orchestrator.batching.turn_credit import per_turn_advantages, turn_returns


def _per_turn(type_: str = "default", discount: float = 1.0) -> AdvantageConfig:
    return AdvantageConfig(type=type_, turn_credit="per_turn", turn_discount=discount)  # type: ignore[arg-type]


def test_a_turns_return_is_its_reward_plus_the_discounted_later_rewards() -> None:
    # G_2 = 2, G_1 = 0 + 0.5 * 2, G_0 = 1 + 0.5 * 0 + 0.25 * 2
    assert turn_returns([1.0, 0.0, 2.0], 0.5) == [1.5, 1.0, 2.0]
    assert turn_returns([1.0, 0.0, 2.0], 1.0) == [3.0, 2.0, 2.0]
    assert turn_returns([1.0, 0.0, 2.0], 0.0) == [1.0, 0.0, 2.0]


def test_each_turn_is_compared_with_the_group_rollouts_that_reached_that_turn() -> None:
    # one group of three: 3 turns, 2 turns, 1 turn; rewards per turn
    rewards = [[[0.0, 0.0, 1.0], [0.5, 0.0], [0.0]]]
    lengths = [[[2, 3, 4], [5, 6], [7]]]
    out = per_turn_advantages(_per_turn(discount=0.5), rewards, lengths, np.ones((1, 3), bool))
    g0 = [0.25, 0.5, 0.0]  # 0 + 0.5*0 + 0.25*1; 0.5 + 0.5*0; 0
    g1 = [0.5, 0.0]  # turn 1 of the first two rollouts: 0 + 0.5*1; 0
    mean0, mean1 = sum(g0) / 3, sum(g1) / 2
    np.testing.assert_allclose(out[0][0], [g0[0] - mean0, g1[0] - mean1, 0.0])  # turn 2: reached alone
    np.testing.assert_allclose(out[0][1], [g0[1] - mean0, g1[1] - mean1])
    np.testing.assert_allclose(out[0][2], [g0[2] - mean0])


def test_grpo_divides_each_turns_deviation_by_that_turns_sample_std() -> None:
    rewards = [[[1.0, 1.0], [0.0, 3.0], [2.0, 0.0], [0.0, 0.0]]]
    lengths = [[[1, 1]] * 4]
    out = per_turn_advantages(_per_turn("grpo"), rewards, lengths, np.ones((1, 4), bool))
    for t in range(2):
        returns = np.array([sum(r[t:]) for r in rewards[0]])
        expected = (returns - returns.mean()) / returns.std(ddof=1)
        np.testing.assert_allclose([out[0][i][t] for i in range(4)], expected)


def test_identical_rollouts_get_zero_at_every_turn_whatever_the_turn_rewards() -> None:
    rewards = [[[1.0, 2.0, 3.0]] * 4]
    out = per_turn_advantages(_per_turn(discount=0.9), rewards, [[[4, 4, 4]] * 4], np.ones((1, 4), bool))
    assert all(np.all(a == 0.0) for a in out[0])


def test_with_no_turn_rewards_and_no_discount_turn_zero_is_the_final_credit_advantage() -> None:
    # only the score, on each rollout's last turn; groups of mixed turn counts
    rewards = [[[0.0, 1.0], [0.0], [0.0, 0.0, 0.5]], [[2.0], [0.0, 0.0], [1.0]]]
    lengths = [[[3, 4], [5], [1, 2, 3]], [[6], [2, 2], [3]]]
    out = per_turn_advantages(_per_turn("rloo"), rewards, lengths, np.ones((2, 3), bool))
    finals = np.array([[sum(r) for r in group] for group in rewards])
    totals = np.array([[sum(n) for n in group] for group in lengths])
    final = compute_advantages(AdvantageConfig(type="rloo"), finals, totals)
    np.testing.assert_allclose([[a[0] for a in group] for group in out], final)


def test_length_weighted_mean_weighs_each_turn_by_that_turns_model_tokens() -> None:
    cfg = AdvantageConfig(length_weighted_mean=True, turn_credit="per_turn")
    out = per_turn_advantages(cfg, [[[1.0, 0.0], [0.0, 2.0]]], [[[1, 3], [3, 1]]], np.ones((1, 2), bool))
    # turn 0: returns 1, 2 weighted 1, 3; turn 1: returns 0, 2 weighted 3, 1
    mean0, mean1 = (1 * 1 + 2 * 3) / 4, (0 * 3 + 2 * 1) / 4
    np.testing.assert_allclose(out[0][0], [1 - mean0, 0 - mean1])
    np.testing.assert_allclose(out[0][1], [2 - mean0, 2 - mean1])


def test_an_unscored_rollout_gets_zero_at_every_turn_and_joins_no_baseline() -> None:
    rewards = [[[1.0, 0.0], [0.0, 0.0], [5.0, 5.0]]]
    valid = np.array([[True, True, False]])
    out = per_turn_advantages(_per_turn(), rewards, [[[1, 1]] * 3], valid)
    np.testing.assert_allclose(out[0][0], [0.5, 0.0])
    np.testing.assert_allclose(out[0][1], [-0.5, 0.0])
    np.testing.assert_allclose(out[0][2], [0.0, 0.0])


def test_turn_discount_needs_per_turn_credit() -> None:
    with pytest.raises(ValueError, match="turn_discount only applies with advantage"):
        AdvantageConfig(turn_discount=0.9)
    assert AdvantageConfig().turn_credit == "final" and AdvantageConfig().turn_discount == 1.0
