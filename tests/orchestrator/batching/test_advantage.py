from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from grpo.config.orchestrator import AdvantageConfig
from grpo.orchestrator.batching.advantage import compute_advantages

REWARDS = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
LENGTHS = np.array([[10, 30, 10, 50], [5, 5, 5, 5]])


def _adv(kind: str, **kwargs: object) -> np.ndarray:
    return compute_advantages(AdvantageConfig.model_validate({"type": kind, **kwargs}), REWARDS, LENGTHS)


def test_default_subtracts_group_mean() -> None:
    np.testing.assert_allclose(_adv("default"), [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]])


def test_dr_grpo_subtracts_the_plain_group_mean_and_never_divides_by_std() -> None:
    rewards = np.array([[3.0, 0.0, 1.0, 0.0], [2.0, 2.0, 2.0, 6.0]])
    lengths = np.array([[5, 900, 5, 5], [1, 1, 1, 1]])  # a long rollout must not shift the mean
    adv = compute_advantages(AdvantageConfig(type="dr_grpo"), rewards, lengths)
    np.testing.assert_allclose(adv, [[2.0, -1.0, 0.0, -1.0], [-1.0, -1.0, -1.0, 3.0]])


def test_grpo_divides_by_the_sample_std_of_its_group() -> None:
    rewards = np.array([[0.2, 0.9, 0.4, 0.7, 1.0], [1.0, 1.0, 0.0, 0.0, 0.0]])
    adv = compute_advantages(AdvantageConfig(type="grpo"), rewards, np.ones_like(rewards))
    # the unbiased std, as TRL's torch.std and OpenRLHF's group_norm compute it
    expected = (rewards - rewards.mean(axis=1, keepdims=True)) / rewards.std(axis=1, ddof=1, keepdims=True)
    np.testing.assert_allclose(adv, expected)
    np.testing.assert_allclose(adv[1], [1.0954451, 1.0954451, -0.7302967, -0.7302967, -0.7302967], rtol=1e-6)


def test_grpo_zero_std_groups_get_zero() -> None:
    adv = _adv("grpo")
    np.testing.assert_allclose(adv[0], np.array([0.5, -0.5, -0.5, 0.5]) / np.std([1, 0, 0, 1], ddof=1))
    assert np.all(adv[1] == 0.0) and np.all(np.isfinite(adv))


def test_rloo_uses_leave_one_out_mean() -> None:
    adv = _adv("rloo")
    np.testing.assert_allclose(adv[0], [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])
    np.testing.assert_allclose(adv[1], 0.0)


def _token_whitened(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Whitening over tokens written out: every rollout's value repeated once per completion token."""
    tokens = np.repeat(values.ravel(), lengths.ravel().astype(int))
    return (values - tokens.mean()) / (tokens.std() + 1e-6)


def test_rloo_is_never_whitened_its_scale_is_the_rewards():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [30.0, 30.0, 30.0, 50.0]])
    adv = compute_advantages(AdvantageConfig(type="rloo"), rewards, LENGTHS)
    np.testing.assert_allclose(adv[1], [-20 / 3, -20 / 3, -20 / 3, 20.0])
    np.testing.assert_allclose(
        compute_advantages(AdvantageConfig(type="rloo"), rewards * 10, LENGTHS), adv * 10
    )


def test_reinforce_pp_whitens_the_rewards_over_the_batch_tokens():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 5.0]])
    adv = compute_advantages(AdvantageConfig(type="reinforce_pp"), rewards, LENGTHS)
    np.testing.assert_allclose(adv, _token_whitened(rewards, LENGTHS))
    # zero mean and unit variance over the tokens the loss sees, not over rollouts
    tokens = np.repeat(adv.ravel(), LENGTHS.ravel())
    assert tokens.mean() == pytest.approx(0.0, abs=1e-9) and tokens.std() == pytest.approx(1.0, rel=1e-5)


def test_reinforce_pp_baseline_removes_the_group_mean_then_whitens_over_the_batch_tokens():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 5.0]])
    adv = compute_advantages(AdvantageConfig(type="reinforce_pp_baseline"), rewards, LENGTHS)
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(adv, _token_whitened(centred, LENGTHS))


def test_batch_whitening_of_equal_advantages_gives_zero():
    adv = compute_advantages(AdvantageConfig(type="reinforce_pp"), np.full((2, 4), 0.7), LENGTHS)
    np.testing.assert_allclose(adv, 0.0, atol=1e-9)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_length_weighted_mean_is_refused_where_the_estimator_has_its_own_baseline(kind: str) -> None:
    with pytest.raises(ValueError, match=r"length_weighted_mean only applies to advantage\.type default"):
        AdvantageConfig(type=kind, length_weighted_mean=True)  # type: ignore[arg-type]


def test_length_weighted_mean_is_refused_for_a_custom_function() -> None:
    with pytest.raises(ValueError, match="length_weighted_mean"):
        AdvantageConfig(type="custom", import_path=f"{__name__}:scaled", length_weighted_mean=True)


def test_kwargs_without_a_custom_function_are_refused() -> None:
    with pytest.raises(ValueError, match=r"kwargs is only used with advantage\.type: custom"):
        AdvantageConfig(type="grpo", kwargs={"scale": 2.0})


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


@pytest.mark.parametrize("kind", ["default", "grpo", "dr_grpo", "rloo"])
def test_failed_rollouts_are_left_out_of_the_group_baseline(kind: str) -> None:
    cfg = AdvantageConfig.model_validate({"type": kind})
    rewards = np.array([[1.0, 0.0, 0.0, 1.0, 0.0]])
    valid = np.array([[True, True, True, True, False]])  # the last one failed (reward 0.0)
    adv = compute_advantages(cfg, rewards, np.ones_like(rewards), valid)
    alone = compute_advantages(cfg, rewards[:, :4], np.ones((1, 4)))
    np.testing.assert_allclose(adv[:, :4], alone)
    assert adv[0, 4] == 0.0


@pytest.mark.parametrize(
    "kind", ["default", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
)
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


def test_a_custom_advantage_in_a_file_is_imported_by_its_path(tmp_path: Path) -> None:
    (tmp_path / "my_advantage.py").write_text("def doubled(rewards, lengths):\n    return rewards * 2\n")
    adv = _adv("custom", import_path=f"{tmp_path}/my_advantage.py:doubled")
    np.testing.assert_allclose(adv, 2 * REWARDS)
