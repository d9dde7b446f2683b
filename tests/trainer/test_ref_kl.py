"""The reference-KL term (loss.kl_beta, loss.kl_estimator): each estimator's value and gradient,
and the term inside grpo_loss against a direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.config.trainer import LossConfig
from grpo.trainer.loss import grpo_loss
from grpo.trainer.ref_kl import kl_estimate

# Two samples of three loss tokens.
TRAINER = [-1.0, -0.6, -2.0, -1.0, -0.3, -1.5]
INFERENCE = [-1.1, -0.5, -1.9, -0.9, -0.4, -1.4]
REFERENCE = [-0.7, -0.9, -2.4, -1.0, -0.1, -2.5]
ADVANTAGES = [1.0, 1.0, 1.0, -2.0, -2.0, -2.0]
SAMPLE_IDS = [0, 0, 0, 1, 1, 1]


def _t(values: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


@pytest.mark.parametrize(
    ("estimator", "value", "grad"),
    [
        # lp = -1, ref = -0.5: r = ref - lp = 0.5
        ("k1", -0.5, 1.0),
        ("k2", 0.125, -0.5),
        ("k3", math.exp(0.5) - 0.5 - 1, 1 - math.exp(0.5)),
    ],
)
def test_each_estimator_has_its_textbook_value_and_gradient(estimator: str, value: float, grad: float):
    lp = _t([-1.0], grad=True)
    out = kl_estimate(lp, _t([-0.5]), estimator)  # type: ignore[arg-type]
    (d,) = torch.autograd.grad(out.sum(), lp)
    assert out.item() == pytest.approx(value)
    assert d.item() == pytest.approx(grad)


def test_k3_is_never_negative_and_zero_only_where_the_policies_agree():
    lp = _t([-3.0, -1.0, -0.2, -1.0])
    ref = _t([-0.1, -2.0, -0.2, -1.0])
    k3 = kl_estimate(lp, ref, "k3")
    assert (k3[:2] > 0).all() and k3[2:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("ratio_type", ["token", "sequence_geometric_mean"])
def test_the_kl_term_adds_beta_times_the_estimate_normalised_like_the_policy_term(
    estimator: str, ratio_type: str
):
    beta, loss_scale = 0.3, 6 if ratio_type == "token" else 2
    plain = LossConfig(ratio_type=ratio_type)
    with_kl = LossConfig(ratio_type=ratio_type, kl_beta=beta, kl_estimator=estimator)
    args = (_t(INFERENCE), _t(ADVANTAGES), torch.ones(6, dtype=torch.bool), torch.tensor(SAMPLE_IDS))

    lp = _t(TRAINER, grad=True)
    loss, sums = grpo_loss(lp, *args, with_kl, loss_scale, ref_lp=_t(REFERENCE))
    (grad,) = torch.autograd.grad(loss, lp)
    lp0 = _t(TRAINER, grad=True)
    loss0, _ = grpo_loss(lp0, *args, plain, loss_scale)
    (grad0,) = torch.autograd.grad(loss0, lp0)

    # Direct: the estimate per token, weighted 1 (token) or 1 / 3 (each sample's three tokens), over L.
    direct_lp = _t(TRAINER, grad=True)
    r = _t(REFERENCE) - direct_lp
    per_token = {"k1": -r, "k2": r * r / 2, "k3": torch.exp(r) - r - 1}[estimator]
    weight = 1.0 if ratio_type == "token" else 1.0 / 3
    term = beta * (per_token * weight).sum() / loss_scale
    (term_grad,) = torch.autograd.grad(term, direct_lp)

    assert loss.item() == pytest.approx(loss0.item() + term.item())
    assert grad.tolist() == pytest.approx((grad0 + term_grad).tolist())
    assert sums.metrics()["kl_ref"] == pytest.approx(per_token.sum().item() / 6)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_with_the_policy_equal_to_the_reference_the_term_and_its_gradient_are_zero(estimator: str):
    args = (_t(INFERENCE), _t(ADVANTAGES), torch.ones(6, dtype=torch.bool), torch.tensor(SAMPLE_IDS))
    lp = _t(TRAINER, grad=True)
    cfg = LossConfig(kl_beta=5.0, kl_estimator=estimator)
    loss, sums = grpo_loss(lp, *args, cfg, 6, ref_lp=_t(TRAINER))
    (grad,) = torch.autograd.grad(loss, lp)
    lp0 = _t(TRAINER, grad=True)
    loss0, _ = grpo_loss(lp0, *args, LossConfig(), 6)
    (grad0,) = torch.autograd.grad(loss0, lp0)
    assert loss.item() == loss0.item()
    assert torch.equal(grad, grad0)
    assert sums.metrics()["kl_ref"] == 0.0


def test_a_masked_token_adds_nothing_to_the_term_even_with_an_infinite_logprob():
    # Token 1's ratio e^3 is above token_mask_high 8 -> masked; its reference logprob is -inf.
    inference = list(INFERENCE)
    inference[1] = TRAINER[1] - 3.0
    reference = list(REFERENCE)
    reference[1] = -math.inf
    lp = _t(TRAINER, grad=True)
    cfg = LossConfig(kl_beta=1.0, kl_estimator="k3", geo_mask_high=math.inf)
    loss, sums = grpo_loss(
        lp,
        _t(inference),
        _t(ADVANTAGES),
        torch.ones(6, dtype=torch.bool),
        torch.tensor(SAMPLE_IDS),
        cfg,
        6,
        ref_lp=_t(reference),
    )
    (grad,) = torch.autograd.grad(loss, lp)
    assert math.isfinite(loss.item()) and grad[1].item() == 0.0 and torch.isfinite(grad).all()
    assert sums.num_masked_tokens == 1 and math.isfinite(sums.metrics()["kl_ref"])
