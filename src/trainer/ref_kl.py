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


def return_to_go(values: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
    """values [T], sample_ids [T] -> [T]: for each token, the sum of its sample's values from it to
    the sample's last token. A sample's tokens must be contiguous and in order, as a micro-batch's
    loss tokens are (grpo.trainer.packing: a sample's loss tokens lie in one segment, and segment
    ids never decrease)."""
    import torch

    assert not sample_ids.numel() or bool((sample_ids[1:] >= sample_ids[:-1]).all()), "samples in order"
    # float64 for the difference of two suffix sums, which would lose a short sample's few tokens
    # against a long micro-batch's total in float32.
    suffix = torch.flip(torch.cumsum(torch.flip(values.to(torch.float64), (0,)), 0), (0,))
    is_last = torch.ones_like(sample_ids, dtype=torch.bool)
    is_last[:-1] = sample_ids[1:] != sample_ids[:-1]
    # after[t]: what follows t's sample (the suffix sum at its last token, less that token).
    after_last = suffix - values.to(torch.float64)
    last_index = torch.zeros(int(sample_ids.max().item()) + 1 if sample_ids.numel() else 0, dtype=torch.long)
    last_index = last_index.to(sample_ids.device).index_copy_(
        0, sample_ids[is_last], is_last.nonzero().squeeze(-1)
    )
    return (suffix - after_last[last_index[sample_ids]]).to(values.dtype)
