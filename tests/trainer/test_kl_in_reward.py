"""The reference KL as a reward penalty (loss.kl_in_reward): the return-to-go of the per-token
penalty enters each token's advantage, detached, and the loss has no KL term of its own; checked
against a direct computation of the loss value and its gradient."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.config.trainer import LossConfig
from grpo.trainer.loss import grpo_loss
from grpo.trainer.ref_kl import return_to_go

# Two samples, of three and two loss tokens.
TRAINER = [-1.0, -0.6, -2.0, -1.0, -0.3]
INFERENCE = [-1.1, -0.5, -1.9, -0.9, -0.4]
REFERENCE = [-0.7, -0.9, -2.4, -1.0, -0.1]
ADVANTAGES = [1.0, 1.0, 1.0, -2.0, -2.0]
SAMPLE_IDS = [0, 0, 0, 1, 1]


def _t(values: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def _estimate(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    r = ref - lp
    return {"k1": -r, "k2": r * r / 2, "k3": torch.exp(r) - r - 1}[estimator]


def _loss(
    cfg: LossConfig, loss_scale: int, **kwargs: torch.Tensor
) -> tuple[float, list[float], dict[str, float]]:
    lp = _t(TRAINER, grad=True)
    loss, sums = grpo_loss(
        lp,
        kwargs.pop("inference", _t(INFERENCE)),
        _t(ADVANTAGES),
        torch.ones(5, dtype=torch.bool),
        torch.tensor(SAMPLE_IDS),
        cfg,
        loss_scale,
        **kwargs,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad.tolist(), sums.metrics()


def test_the_return_to_go_sums_each_sample_from_the_token_to_its_end() -> None:
    values = _t([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    assert return_to_go(values, torch.tensor([0, 0, 0, 3, 3, 5])).tolist() == [
        7.0,
        6.0,
        4.0,
        24.0,
        16.0,
        32.0,
    ]
    assert return_to_go(_t([]), torch.tensor([], dtype=torch.long)).tolist() == []


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("ratio_type", ["token", "sequence_geometric_mean"])
def test_the_penalty_enters_the_advantage_as_a_detached_return_to_go(estimator: str, ratio_type: str) -> None:
    beta, adv_tau = 0.3, 0.5
    loss_scale = 5 if ratio_type == "token" else 2
    cfg = LossConfig(
        ratio_type=ratio_type, adv_tau=adv_tau, kl_beta=beta, kl_estimator=estimator, kl_in_reward=True
    )
    loss, grad, metrics = _loss(cfg, loss_scale, ref_lp=_t(REFERENCE))

    # Direct: the per-token reward -beta * kl, summed from each token to its sample's end.
    kl = _estimate(_t(TRAINER), _t(REFERENCE), estimator).tolist()
    to_go = [sum(kl[0:3]), sum(kl[1:3]), kl[2], sum(kl[3:5]), kl[4]]
    advantage = torch.tensor(
        [a - beta * g for a, g in zip(ADVANTAGES, to_go, strict=True)], dtype=torch.float64
    )
    lp = _t(TRAINER, grad=True)
    log_ratio = _t(TRAINER) - _t(INFERENCE)
    if ratio_type == "token":
        ratio, weight = torch.exp(log_ratio), torch.ones(5, dtype=torch.float64)
    else:
        means = [
            log_ratio[:3].mean(),
            log_ratio[:3].mean(),
            log_ratio[:3].mean(),
            log_ratio[3:].mean(),
            log_ratio[3:].mean(),
        ]
        ratio = torch.exp(torch.stack(means))
        weight = torch.tensor([1 / 3] * 3 + [1 / 2] * 2, dtype=torch.float64)
    direct = -(ratio * adv_tau * advantage * weight * lp).sum() / loss_scale
    (direct_grad,) = torch.autograd.grad(direct, lp)

    assert loss == pytest.approx(direct.item())
    assert grad == pytest.approx(direct_grad.tolist())
    assert metrics["kl_ref"] == pytest.approx(sum(kl) / 5)


def test_it_is_the_plain_loss_on_the_penalised_advantages_with_no_kl_gradient_of_its_own() -> None:
    # k3's own gradient 1 - exp(ref - lp) is non-zero at every token here: a loss term would show.
    beta = 2.0
    penalised, grad, _ = _loss(LossConfig(kl_beta=beta, kl_in_reward=True), 5, ref_lp=_t(REFERENCE))
    kl = _estimate(_t(TRAINER), _t(REFERENCE), "k3")
    advantages = _t(ADVANTAGES) - beta * return_to_go(kl, torch.tensor(SAMPLE_IDS))
    lp = _t(TRAINER, grad=True)
    plain, _ = grpo_loss(
        lp,
        _t(INFERENCE),
        advantages,
        torch.ones(5, dtype=torch.bool),
        torch.tensor(SAMPLE_IDS),
        LossConfig(),
        5,
    )
    (plain_grad,) = torch.autograd.grad(plain, lp)
    _, loss_term_grad, _ = _loss(LossConfig(kl_beta=beta), 5, ref_lp=_t(REFERENCE))
    assert penalised == pytest.approx(plain.item()) and grad == pytest.approx(plain_grad.tolist())
    assert grad != pytest.approx(loss_term_grad)


def test_later_updates_keep_the_first_pass_penalty() -> None:
    # old_lp (the first pass) differs from the current lp: the reward is the one sampled with old_lp.
    old = [lp - 0.2 for lp in TRAINER]
    cfg = LossConfig(kl_beta=1.0, kl_estimator="k1", kl_in_reward=True)
    _, grad, metrics = _loss(cfg, 5, ref_lp=_t(REFERENCE), old_lp=_t(old))
    kl = [o - r for o, r in zip(old, REFERENCE, strict=True)]
    to_go = [sum(kl[0:3]), sum(kl[1:3]), kl[2], sum(kl[3:5]), kl[4]]
    ratio = [math.exp(t - i) for t, i in zip(TRAINER, INFERENCE, strict=True)]
    expected = [-r * (a - g) / 5 for r, a, g in zip(ratio, ADVANTAGES, to_go, strict=True)]
    assert grad == pytest.approx(expected)
    assert metrics["kl_ref"] == pytest.approx(sum(kl) / 5)


def test_a_masked_token_adds_nothing_to_the_penalty_even_with_an_infinite_reference() -> None:
    # Token 1's ratio e^3 is above token_mask_high 8 -> masked; its reference logprob is -inf.
    inference = list(INFERENCE)
    inference[1] = TRAINER[1] - 3.0
    reference = list(REFERENCE)
    reference[1] = -math.inf
    cfg = LossConfig(kl_beta=1.0, kl_estimator="k1", kl_in_reward=True, geo_mask_high=math.inf)
    loss, grad, metrics = _loss(cfg, 5, ref_lp=_t(reference), inference=_t(inference))
    kl = [t - r for t, r in zip(TRAINER, REFERENCE, strict=True)]
    assert math.isfinite(loss) and grad[1] == 0.0
    assert grad[0] == pytest.approx(-math.exp(TRAINER[0] - INFERENCE[0]) * (1.0 - kl[0] - kl[2]) / 5)
    assert math.isfinite(metrics["kl_ref"])
