"""PPO clip (with clip-higher), truncated importance sampling and CISPO, each against its textbook
formula written out directly with autograd: the loss value and the gradient of grpo_loss."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.config.trainer import LossConfig
from grpo.trainer.loss import LossSums, grpo_loss

# Two samples of three loss tokens. Log-ratios chosen so each clip case occurs: ratios e^0.4 = 1.49 and e^-0.5 = 0.61 are outside [0.8, 1.28], e^0.1 and e^-0.1 inside.
TRAINER = [-1.0, -0.6, -2.0, -1.0, -0.3, -1.5]
INFERENCE = [-1.4, -0.1, -1.9, -0.6, -0.8, -1.4]  # log-ratios 0.4, -0.5, -0.1, -0.4, 0.5, -0.1
ADVANTAGES = [1.0, 1.0, 1.0, -2.0, -2.0, -2.0]
SAMPLE_IDS = [0, 0, 0, 1, 1, 1]


def _inputs(advantages: list[float] = ADVANTAGES):
    lp = torch.tensor(TRAINER, dtype=torch.float64, requires_grad=True)
    return (
        lp,
        torch.tensor(INFERENCE, dtype=torch.float64),
        torch.tensor(advantages, dtype=torch.float64),
        torch.ones(len(TRAINER), dtype=torch.bool),
        torch.tensor(SAMPLE_IDS),
    )


def _ours(
    cfg: LossConfig, loss_scale: int = 6, advantages: list[float] = ADVANTAGES
) -> tuple[float, list[float], LossSums]:
    lp, inf, adv, mask, ids = _inputs(advantages)
    loss, sums = grpo_loss(lp, inf, adv, mask, ids, cfg, loss_scale)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad.tolist(), sums


@pytest.mark.parametrize("kl_tau", [0.0, 3.0])
def test_ppo_clip_has_the_gradient_of_the_clipped_surrogate_against_the_behaviour_logprobs(kl_tau: float):
    cfg = LossConfig(clip_low=0.8, clip_high=1.28, kl_tau=kl_tau)
    value, grad, sums = _ours(cfg)

    lp, inf, adv, _, _ = _inputs()
    ratio = torch.exp(lp - inf)
    # The kl term is part of the per-token signal the clip compares (as KL folded into the reward):
    # with kl_tau 3, token 0 (A > 0, ratio 1.49) has a negative signal and keeps its gradient.
    signal = adv - kl_tau * (lp - inf).detach()
    surrogate = torch.minimum(ratio * signal, ratio.clamp(0.8, 1.28) * signal)
    (expected_grad,) = torch.autograd.grad(-surrogate.sum() / 6, lp)
    assert grad == pytest.approx(expected_grad.tolist())

    # The value is grpo's usual -sum(coeff * lp) / L, coeff zero where the clip took the constant branch.
    r = ratio.detach()
    s = signal.detach()
    clipped = ((s > 0) & (r > 1.28)) | ((s < 0) & (r < 0.8))
    coeff = torch.where(clipped, torch.zeros_like(r), r * s)
    assert value == pytest.approx((-(coeff * lp.detach()).sum() / 6).item())
    assert sums.num_masked_tokens == 0
    metrics = sums.metrics()
    assert metrics["clip_frac_low"] == pytest.approx(int(((s < 0) & (r < 0.8)).sum()) / 6)
    assert metrics["clip_frac_high"] == pytest.approx(int(((s > 0) & (r > 1.28)).sum()) / 6)


def test_clip_higher_drops_exactly_the_positive_tokens_above_the_high_bound_and_the_negative_below_the_low():
    _, grad, sums = _ours(LossConfig(clip_low=0.8, clip_high=1.28))
    # token 0: A > 0, ratio 1.49 > 1.28 -> no gradient; token 1: A > 0, ratio 0.61 -> kept (PPO's
    # min leaves a ratio below the band unclipped for a positive advantage); token 4: A < 0, ratio
    # 1.65 -> kept; token 3: A < 0, ratio 0.67 < 0.8 -> no gradient.
    assert [g == 0.0 for g in grad] == [True, False, False, True, False, False]
    assert sums.num_clipped_high == 1 and sums.num_clipped_low == 1
    _, grad, sums = _ours(LossConfig(clip_high=1.28))  # one-sided: no lower bound
    assert [g == 0.0 for g in grad] == [True, False, False, False, False, False]
    assert sums.metrics()["clip_frac_low"] == 0.0


def test_gspo_clip_gates_each_sample_on_its_geometric_mean_ratio():
    # sample 0: mean log-ratio -0.067, ratio 0.936 < clip_low with A < 0: no gradient; sample 1: ratio 1
    adv = [-1.0, -1.0, -1.0, 2.0, 2.0, 2.0]
    cfg = LossConfig(ratio_type="sequence_geometric_mean", clip_low=0.95, clip_high=1.1)
    value, grad, sums = _ours(cfg, loss_scale=2, advantages=adv)

    lp, inf, _, _, ids = _inputs()
    log_ratio = lp - inf
    seq_ratio = torch.stack([torch.exp(log_ratio[ids == i].mean()) for i in range(2)])
    seq_adv = torch.tensor([-1.0, 2.0], dtype=torch.float64)
    surrogate = torch.minimum(seq_ratio * seq_adv, seq_ratio.clamp(0.95, 1.1) * seq_adv)
    (expected,) = torch.autograd.grad(-surrogate.sum() / 2, lp)
    assert grad == pytest.approx(expected.tolist())
    assert grad[:3] == [0.0, 0.0, 0.0] and all(g != 0.0 for g in grad[3:])
    # value: -sum(coeff * lp) / L with coeff = ratio 1 * A 2 / 3 tokens on sample 1's tokens
    assert value == pytest.approx(-(2.0 / 3) * sum(TRAINER[3:]) / 2)
    assert sums.num_clipped_low == 3


def test_truncated_importance_sampling_caps_the_detached_ratio_weight():
    value, grad, sums = _ours(LossConfig(tis_cap=1.2))

    lp, inf, adv, _, _ = _inputs()
    weight = torch.exp(lp - inf).detach().clamp(max=1.2)
    direct = -(weight * adv * lp).sum() / 6
    (expected,) = torch.autograd.grad(direct, lp)
    assert value == pytest.approx(direct.item())
    assert grad == pytest.approx(expected.tolist())
    # The same gradient as the two-ratio form (verl, prime-rl): min(pi_old / mu, C) * pi / pi_old
    # with pi_old = pi, as one update per batch has it.
    lp2, *_ = _inputs()
    two_ratio = -(weight * torch.exp(lp2 - lp2.detach()) * adv).sum() / 6
    (expected_two,) = torch.autograd.grad(two_ratio, lp2)
    assert grad == pytest.approx(expected_two.tolist())
    assert sums.metrics()["tis_frac_capped"] == pytest.approx(2 / 6)  # ratios e^0.4 and e^0.5
    assert "clip_frac_low" not in sums.metrics()


def test_tis_with_ppo_clip_gates_on_the_ratio_and_weighs_by_the_capped_ratio():
    _, grad, _ = _ours(LossConfig(tis_cap=1.2, clip_low=0.8, clip_high=1.28))
    lp, inf, adv, _, _ = _inputs()
    r = torch.exp(lp - inf).detach()
    gated = ((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8))
    expected = torch.where(gated, torch.zeros_like(r), -r.clamp(max=1.2) * adv / 6)
    assert grad == pytest.approx(expected.tolist())


def test_cispo_weighs_every_token_by_its_clamped_detached_ratio():
    cfg = LossConfig(type="cispo", clip_low=0.8, clip_high=1.28)
    value, grad, sums = _ours(cfg)

    lp, inf, adv, _, _ = _inputs()
    weight = torch.exp(lp - inf).detach().clamp(0.8, 1.28)
    direct = -(weight * adv * lp).sum() / 6
    (expected,) = torch.autograd.grad(direct, lp)
    assert value == pytest.approx(direct.item())
    assert grad == pytest.approx(expected.tolist())
    assert all(g != 0.0 for g in grad)  # no token loses its gradient, unlike PPO's clip
    metrics = sums.metrics()
    assert metrics["clip_frac_low"] == pytest.approx(2 / 6)  # ratios e^-0.5, e^-0.4
    assert metrics["clip_frac_high"] == pytest.approx(2 / 6)  # ratios e^0.4, e^0.5


def test_cispo_upper_bound_only_as_minimax_m1_sets_it():
    _, grad, _ = _ours(LossConfig(type="cispo", clip_high=1.28))
    r = [math.exp(t - i) for t, i in zip(TRAINER, INFERENCE, strict=True)]
    expected = [-min(ri, 1.28) * a / 6 for ri, a in zip(r, ADVANTAGES, strict=True)]
    assert grad == pytest.approx(expected)


def test_masks_still_apply_under_every_clip():
    # A ratio of e^3 = 20 is above token_mask_high 8: dropped whatever the clip would do.
    lp = torch.tensor([-1.0, -1.0], dtype=torch.float64, requires_grad=True)
    inf = torch.tensor([-4.0, -1.0], dtype=torch.float64)
    for cfg in (
        LossConfig(type="cispo", clip_high=5.0),
        LossConfig(tis_cap=2.0),
        LossConfig(clip_low=0.8, clip_high=1.28),
    ):
        loss, sums = grpo_loss(
            lp, inf, torch.tensor([-1.0, 1.0]), torch.ones(2, dtype=torch.bool), torch.tensor([0, 1]), cfg, 2
        )
        (grad,) = torch.autograd.grad(loss, lp)
        assert grad.tolist() == pytest.approx([0.0, -0.5]), cfg
        assert sums.num_masked_tokens == 1


def test_defaults_report_no_clip_metrics():
    _, _, sums = _ours(LossConfig())
    masked_by = {
        "masked/token_low",
        "masked/token_high",
        "masked/sequence_low",
        "masked/sequence_high",
        "masked/truncated",
    }
    assert set(sums.metrics()) == {"loss", "tokens", "masked", "mismatch_kl", "entropy", *masked_by}


def test_loss_sums_round_trip_through_floats_summed_over_ranks():
    a = LossSums(loss=1.5, num_loss_tokens=3, num_clipped_high=1, has_clip=True)
    b = LossSums(loss=0.5, num_loss_tokens=4, num_tis_capped=2, has_teacher=True, teacher_kl_sum=0.25)
    summed = [x + y for x, y in zip(a.as_floats(), b.as_floats(), strict=True)]
    merged = LossSums.from_floats(summed)
    a.add(b)
    assert merged == a
