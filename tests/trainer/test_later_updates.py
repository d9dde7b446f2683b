"""grpo_loss on a batch's later updates (num_iterations > 1, `old_lp` = the first pass's logprobs):
PPO's clip on pi / pi_old, tis_cap on pi_old / mu, the masks from the first pass; each against
the textbook surrogate written out directly with autograd."""

from __future__ import annotations

import pytest
import torch

from grpo.config.trainer import LossConfig
from grpo.trainer.loss import grpo_loss

# Two samples of three loss tokens: the first pass's logprobs (pi_old), the current ones after an
# update (pi), and vLLM's (mu). log(pi / pi_old) = 0.4, -0.5, -0.1, -0.4, 0.5, 0.05.
OLD = [-1.0, -0.6, -2.0, -1.0, -0.3, -1.5]
CURRENT = [-0.6, -1.1, -2.1, -1.4, 0.2, -1.45]
INFERENCE = [-1.3, -0.5, -2.0, -0.2, -0.3, -1.0]  # log(pi_old / mu) = 0.3, -0.1, 0, -0.8, 0, -0.5
ADVANTAGES = [1.0, 1.0, 1.0, -2.0, -2.0, -2.0]
SAMPLE_IDS = [0, 0, 0, 1, 1, 1]


def _t(values: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def _ours(
    cfg: LossConfig, current: list[float], old: list[float] | None
) -> tuple[float, list[float], object]:
    lp = _t(current, grad=True)
    loss, sums = grpo_loss(
        lp,
        _t(INFERENCE),
        _t(ADVANTAGES),
        torch.ones(6, dtype=torch.bool),
        torch.tensor(SAMPLE_IDS),
        cfg,
        6,
        old_lp=None if old is None else _t(old),
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad.tolist(), sums


@pytest.mark.parametrize(
    "cfg", [LossConfig(), LossConfig(tis_cap=1.2), LossConfig(type="cispo", clip_low=0.9, clip_high=1.1)]
)
def test_without_ppo_clip_old_logprobs_equal_to_the_current_ones_give_the_first_update_loss(cfg: LossConfig):
    # (PPO's clip differs by design: the first update clips pi / mu, a later one pi / pi_old.)
    later, first = _ours(cfg, OLD, OLD), _ours(cfg, OLD, None)
    assert later[0] == pytest.approx(first[0])
    assert later[1] == pytest.approx(first[1])


def test_a_later_update_clips_the_ratio_to_the_first_pass_and_keeps_the_behaviour_weight():
    cfg = LossConfig(clip_low=0.8, clip_high=1.28)
    _, grad, sums = _ours(cfg, CURRENT, OLD)

    lp = _t(CURRENT, grad=True)
    old, mu, adv = _t(OLD), _t(INFERENCE), _t(ADVANTAGES)
    q = torch.exp(lp - old)  # PPO's pi / pi_old
    behaviour = torch.exp(old - mu)  # pi_old / mu, a constant
    surrogate = behaviour * torch.minimum(q * adv, q.clamp(0.8, 1.28) * adv)
    (expected,) = torch.autograd.grad(-surrogate.sum() / 6, lp)
    assert grad == pytest.approx(expected.tolist())
    # Clipped by pi / pi_old: token 0 (A > 0, q = e^0.4) high, token 3 (A < 0, q = e^-0.4) low;
    # token 5 (A < 0, q = e^0.05) is not, though its pi / mu = e^-0.45 is below clip_low.
    assert (sums.num_clipped_high, sums.num_clipped_low) == (1, 1)
    # The first update clips pi / mu instead: token 0 (e^0.3) high, tokens 3 and 5 low.
    first = _ours(cfg, OLD, None)[2]
    assert (first.num_clipped_high, first.num_clipped_low) == (1, 2)


def test_a_later_update_truncates_the_behaviour_ratio_of_the_first_pass():
    cfg = LossConfig(tis_cap=1.2)
    _, grad, sums = _ours(cfg, CURRENT, OLD)

    lp = _t(CURRENT, grad=True)
    old, mu, adv = _t(OLD), _t(INFERENCE), _t(ADVANTAGES)
    surrogate = torch.exp(old - mu).clamp(max=1.2) * torch.exp(lp - old) * adv
    (expected,) = torch.autograd.grad(-surrogate.sum() / 6, lp)
    assert grad == pytest.approx(expected.tolist())
    assert sums.num_tis_capped == 1  # only token 0's pi_old / mu = e^0.3 is above 1.2


def test_the_masks_of_a_later_update_are_those_of_the_first_pass():
    # Token 0: pi_old / mu = e^0.3 inside the band, pi / mu = e^0.7 above token_mask_high 1.5.
    cfg = LossConfig(token_mask_low=0.1, token_mask_high=1.5, geo_mask_low=0.0, geo_mask_high=100.0)
    _, grad_later, sums_later = _ours(cfg, CURRENT, OLD)
    _, _, sums_first = _ours(cfg, OLD, None)
    _, grad_no_old, sums_no_old = _ours(cfg, CURRENT, None)
    assert sums_later.num_masked_tokens == sums_first.num_masked_tokens == 0
    assert sums_no_old.num_masked_tokens > 0 and grad_no_old[0] == 0.0
    assert grad_later[0] != 0.0
