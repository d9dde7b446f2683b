"""The per-token estimates of KL(policy || reference) that loss.kl_beta weights (docs/loss.md,
"KL to a frozen reference"), by loss.kl_estimator. With r = ref_lp - lp for a token the policy
sampled (Schulman's estimators, as verl names them):

    k1 = -r                    = lp - ref_lp            unbiased, can be negative      (verl "kl")
    k2 = r^2 / 2                                        biased, low variance            (verl "mse")
    k3 = exp(r) - r - 1                                 unbiased, never negative       (verl "low_var_kl")

Their gradients with respect to lp (what the loss backpropagates): 1, lp - ref_lp, 1 - exp(r).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

KlEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(lp: torch.Tensor, ref_lp: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """lp [T] (may carry a gradient), ref_lp [T] (data) -> the estimator's value per token [T]."""
    import torch

    r = ref_lp.detach() - lp
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r * r
    return torch.exp(r) - r - 1
