from __future__ import annotations

import numpy as np
import pytest

from grpo.config.orchestrator import AdvantageConfig
from grpo.orchestrator.advantage import compute_advantages

REWARDS = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
LENGTHS = np.array([[10, 30, 10, 50], [5, 5, 5, 5]])


def _adv(kind: str, **kwargs: object) -> np.ndarray:
    return compute_advantages(AdvantageConfig.model_validate({"type": kind, **kwargs}), REWARDS, LENGTHS)


def test_default_subtracts_group_mean() -> None:
    np.testing.assert_allclose(_adv("default"), [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]])


def test_dr_grpo_does_not_divide_by_std() -> None:
    np.testing.assert_allclose(_adv("dr_grpo"), _adv("default"))


def test_grpo_divides_by_group_std_and_zero_std_groups_get_zero() -> None:
    adv = _adv("grpo")
    np.testing.assert_allclose(adv[0], [1.0, -1.0, -1.0, 1.0])  # std of [1,0,0,1] is 0.5
    assert np.all(adv[1] == 0.0) and np.all(np.isfinite(adv))


def test_rloo_uses_leave_one_out_mean() -> None:
    adv = _adv("rloo")
    np.testing.assert_allclose(adv[0], [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])
    np.testing.assert_allclose(adv[1], 0.0)


def test_reinforce_pp_normalises_over_the_batch() -> None:
    adv = _adv("reinforce_pp")
    centred = np.array([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]])
    np.testing.assert_allclose(adv, centred / centred.std())


def test_length_weighted_mean_weights_rewards_by_length() -> None:
    adv = _adv("default", length_weighted_mean=True)
    mean = (1 * 10 + 1 * 50) / 100
    np.testing.assert_allclose(adv[0], REWARDS[0] - mean)


def scaled(rewards: np.ndarray, lengths: np.ndarray, scale: float) -> np.ndarray:
    return rewards * scale


def flattened(rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return rewards.ravel()


def test_custom_estimator_is_imported_with_kwargs() -> None:
    adv = _adv("custom", import_path=f"{__name__}:scaled", kwargs={"scale": 3.0})
    np.testing.assert_allclose(adv, REWARDS * 3.0)


def test_custom_estimator_with_wrong_shape_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="shape"):
        _adv("custom", import_path=f"{__name__}:flattened")


@pytest.mark.parametrize("kind", ["default", "grpo", "rloo"])
def test_failed_rollouts_are_left_out_of_the_group_baseline(kind: str) -> None:
    cfg = AdvantageConfig.model_validate({"type": kind})
    rewards = np.array([[1.0, 0.0, 0.0, 1.0, 0.0]])
    valid = np.array([[True, True, True, True, False]])  # the last one failed (reward 0.0)
    adv = compute_advantages(cfg, rewards, np.ones_like(rewards), valid)
    alone = compute_advantages(cfg, rewards[:, :4], np.ones((1, 4)))
    np.testing.assert_allclose(adv[:, :4], alone)
    assert adv[0, 4] == 0.0


@pytest.mark.parametrize("kind", ["default", "grpo", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_never_give_non_finite_advantages(kind: str, bad: float) -> None:
    cfg = AdvantageConfig.model_validate({"type": kind})
    rewards = np.array([[1.0, bad, 0.0, 1.0], [bad, bad, bad, bad]])
    adv = compute_advantages(cfg, rewards, np.ones_like(rewards))
    assert np.all(np.isfinite(adv)), adv
    assert adv[0, 1] == 0.0 and np.all(adv[1] == 0.0)
    np.testing.assert_allclose(
        adv[0, [0, 2, 3]], compute_advantages(cfg, rewards[:1, [0, 2, 3]], np.ones((1, 3)))[0]
    )
