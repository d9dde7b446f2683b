"""The one line --dry-run prints for train.yaml `loss`: the terms that are on, with their coefficients."""

from __future__ import annotations

from grpo.config.trainer import LossConfig
from grpo.trainer.loss_description import describe_loss


def test_the_default_loss_is_the_ratio_weighted_advantage_over_the_step_tokens() -> None:
    assert describe_loss(LossConfig()) == (
        "# loss (type default, docs/loss.md): -sum(coeff * lp) / L; coeff = ratio * (1*A); "
        "ratio = exp(lp - ilp) per token; masks: token ratio [0.125, 8], sample geometric mean [0.1, 10], "
        "sample token ratios [0, 100]; L = the step's loss tokens"
    )


def test_each_term_appears_with_its_coefficient_only_when_on() -> None:
    line = describe_loss(LossConfig(adv_tau=0.5, kl_tau=0.01, teacher_tau=2.0))
    assert "coeff = ratio * (0.5*A - 0.01*(lp - ilp) + 2*(tlp - lp1))" in line
    assert "coeff = ratio * (2*(tlp - lp1))" in describe_loss(LossConfig(adv_tau=0.0, teacher_tau=2.0))
    assert "all 0" in describe_loss(LossConfig(adv_tau=0.0))


def test_clip_tis_and_cispo_show_their_bounds() -> None:
    line = describe_loss(LossConfig(clip_low=0.8, clip_high=1.28, tis_cap=2.0))
    assert "coeff = min(ratio, 2) * (1*A)" in line and "PPO clip [0.8, 1.28]" in line
    assert "PPO clip [-, 1.28]" in describe_loss(LossConfig(clip_high=1.28))
    line = describe_loss(LossConfig(type="cispo", clip_high=5.0))
    assert line.startswith("# loss (type cispo") and "coeff = clamp(ratio, -, 5) * (1*A)" in line
    assert "PPO clip" not in line


def test_sequence_ratios_and_the_constant_normaliser_are_named() -> None:
    line = describe_loss(LossConfig(ratio_type="sequence_geometric_mean"))
    assert "ratio = the geometric mean of the sample's exp(lp - ilp), at most 10" in line
    assert "L = the step's samples, each averaged over its loss tokens" in line
    assert describe_loss(LossConfig(normalization="constant", normalization_constant=512)).endswith("L = 512")


def test_the_reference_kl_term_shows_its_weight_and_estimator_only_when_on() -> None:
    line = describe_loss(LossConfig(kl_beta=0.04, kl_estimator="k3"))
    assert "-sum(coeff * lp) / L + 0.04 * sum(w * kl) / L;" in line
    assert "kl = k3 = exp(ref - lp) - (ref - lp) - 1 per kept token" in line
    assert "kl = k1 = lp - ref" in describe_loss(LossConfig(kl_beta=1.0, kl_estimator="k1"))
    assert "ref" not in describe_loss(LossConfig())


def test_the_kl_as_a_reward_penalty_shows_in_the_advantage_not_as_a_loss_term() -> None:
    line = describe_loss(LossConfig(kl_beta=0.05, kl_estimator="k1", kl_in_reward=True))
    assert "coeff = ratio * (1*(A - 0.05*klg))" in line
    assert "klg = the sum of kl = k1 = lp - ref over the sample's kept tokens from this one on" in line
    assert "sum(w * kl)" not in line and "not group-normalised" in line
