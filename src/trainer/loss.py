"""The GRPO loss on per-token log-probabilities; every formula is written out in docs/loss.md.

Per loss token t of sample s (`sample_ids`), with keep[t] the masks of `keep_mask`:

    log_ratio = trainer_lp - inference_lp
    ratio     = exp(log_ratio)                                  ratio_type token
              = min(exp(sum_s log_ratio), sequence_clip_high)   ratio_type sequence
              = min(exp(mean_s log_ratio), sequence_clip_high)  ratio_type sequence_geometric_mean
    signal    = adv_tau * A + teacher_tau * (teacher_lp - trainer_lp_1) - kl_tau * log_ratio
    coeff     = clipped(ratio) * signal        clipped: grpo.trainer.ratio_clip (identity by default)
    weight    = 1 (token)  or  1 / (loss tokens of s) (both sequence types: per-sample normalisation)
    loss      = -(coeff.detach() * weight * trainer_lp)[keep & has_gradient].sum() / loss_scale
              + kl_beta * (weight * kl_estimator(trainer_lp, ref_lp))[keep].sum() / loss_scale

With loss.kl_in_reward the second line is absent and the KL is a reward penalty instead: A[t] above
becomes A[t] - kl_beta * sum over the kept tokens u >= t of t's sample of kl_estimator(lp, ref_lp)[u]
(detached; lp the first pass's logprobs), the return-to-go of the per-token reward -kl_beta * kl.

where trainer_lp is at the token's sampling temperature (as vLLM's inference_lp is) and
trainer_lp_1 at temperature 1, as the teacher's prompt logprobs are (vLLM scores prompts with no
sampling processor): the teacher term compares the two models' own distributions, whatever the
sampling temperature. So d loss / d trainer_lp[t] = -coeff[t] * weight[t] * keep[t] *
has_gradient[t] / loss_scale (has_gradient, PPO's clip, is false only with loss.clip_low / clip_high).
`loss_scale` is the same for every micro-batch of a step (LossConfig.loss_scale: the step's loss
tokens, its samples for the sequence types, or loss.normalization_constant for Dr. GRPO), so
micro-batches can be backpropagated one at a time and their gradients simply add up.

On a batch's later updates (num_iterations > 1) `old_lp`, the first pass's logprobs, decides the
masks (keep is computed from old_lp - inference_lp, so it is the same on every update) and is
pi_old for the PPO clip and tis_cap (grpo.trainer.ratio_clip). The reference-KL term (kl_beta,
grpo.trainer.ref_kl) is the only term with a gradient other than through coeff; it is neither
weighted by the ratio nor gated by the clip, only by keep. As a reward penalty (kl_in_reward) it is
part of the signal instead, so the ratio weighs it and the clip tests it.

Metrics use the k3 estimator (r - 1) - log r, which is unbiased, never negative, and low-variance
for samples drawn from the denominator policy, averaged over the tokens the loss keeps (a masked
token, whose ratio may have overflowed, counts in `masked` and `tokens` only):
- mismatch_kl: r = p_trainer / p_inference (estimates KL(inference || trainer): how far the trainer's
  logprobs are from vLLM's for the same policy, not a KL to a reference model; that is kl_ref).
- teacher_kl: r = p_teacher / p_trainer, both at temperature 1 (estimates KL(student || teacher)).
kl_ref (only with kl_beta > 0) is the mean of the configured kl_estimator over the kept tokens (with
kl_in_reward, of the first pass's estimate, the one in the reward).
With a clip or tis_cap configured, clip_frac_low / clip_frac_high / tis_frac_capped are the shares of
the kept tokens the clip bounds and the cap acted on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from grpo.trainer.ratio_clip import clip_ratio
from grpo.trainer.ref_kl import kl_estimate, return_to_go
from grpo.trainer.sampling_truncation import OUTSIDE_LOGPROB
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

    from grpo.config.trainer import LossConfig
    from grpo.trainer.packing import LossTokens


@dataclass
class LossSums:
    """Sums over one micro-batch; the trainer adds these up over a step and divides at the end."""

    loss: float = 0.0
    """Already divided by loss_scale: the step loss is the plain sum over micro-batches."""
    num_loss_tokens: int = 0
    num_masked_tokens: int = 0
    """Loss tokens the masks dropped; the kl, entropy and teacher_kl sums leave them out."""
    num_masked_token_low: int = 0
    """Loss tokens each mask dropped (MaskedBy; a token may count under several)."""
    num_masked_token_high: int = 0
    num_masked_sequence_low: int = 0
    num_masked_sequence_high: int = 0
    num_masked_truncated: int = 0
    """Loss tokens outside the kept set of the policy's truncated distribution (top_k/top_p/min_p):
    their logprob is OUTSIDE_LOGPROB, a stand-in for -inf, so they never count, whatever the masks."""
    kl_sum: float = 0.0
    entropy_sum: float = 0.0
    teacher_kl_sum: float = 0.0
    has_teacher: bool = False
    num_clipped_low: int = 0
    """Kept tokens clip_low acted on (ratio_clip.ClippedRatio); likewise clip_high and tis_cap."""
    num_clipped_high: int = 0
    num_tis_capped: int = 0
    has_clip: bool = False
    """clip_low or clip_high configured: the clip fractions are reported."""
    has_tis: bool = False
    kl_ref_sum: float = 0.0
    """Sum over kept tokens of loss.kl_estimator(trainer_lp, ref_lp)."""
    has_kl_ref: bool = False
    router_aux_loss: float = 0.0
    """The routers' load-balancing loss term (router_aux_loss_coef > 0), already divided by
    loss_scale like `loss` and not scaled by the coefficient (grpo.trainer.hf.load_balancing)."""
    has_router_aux_loss: bool = False

    def add(self, other: LossSums) -> None:
        self.loss += other.loss
        self.num_loss_tokens += other.num_loss_tokens
        self.num_masked_tokens += other.num_masked_tokens
        self.num_masked_token_low += other.num_masked_token_low
        self.num_masked_token_high += other.num_masked_token_high
        self.num_masked_sequence_low += other.num_masked_sequence_low
        self.num_masked_sequence_high += other.num_masked_sequence_high
        self.num_masked_truncated += other.num_masked_truncated
        self.kl_sum += other.kl_sum
        self.entropy_sum += other.entropy_sum
        self.teacher_kl_sum += other.teacher_kl_sum
        self.has_teacher = self.has_teacher or other.has_teacher
        self.num_clipped_low += other.num_clipped_low
        self.num_clipped_high += other.num_clipped_high
        self.num_tis_capped += other.num_tis_capped
        self.has_clip = self.has_clip or other.has_clip
        self.has_tis = self.has_tis or other.has_tis
        self.kl_ref_sum += other.kl_ref_sum
        self.has_kl_ref = self.has_kl_ref or other.has_kl_ref
        self.router_aux_loss += other.router_aux_loss
        self.has_router_aux_loss = self.has_router_aux_loss or other.has_router_aux_loss

    def as_floats(self) -> list[float]:
        """Every field as a float, for summing over ranks; from_floats reads the sum back."""
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_floats(cls, values: list[float]) -> LossSums:
        """The fields of `values` (as_floats, possibly summed over ranks): counts rounded, a flag true
        where any rank had it."""
        kinds = {f.name: f.type for f in fields(cls)}
        assert len(values) == len(kinds), "values come from as_floats"
        out: dict[str, float | int | bool] = {}
        for (name, kind), value in zip(kinds.items(), values, strict=True):
            out[name] = value > 0 if kind == "bool" else round(value) if kind == "int" else value
        return cls(**out)  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        num_kept = max(self.num_loss_tokens - self.num_masked_tokens, 1)
        out = {
            "loss": self.loss,
            "tokens": float(self.num_loss_tokens),
            "masked": self.num_masked_tokens / max(self.num_loss_tokens, 1),
            "masked/token_low": self.num_masked_token_low / max(self.num_loss_tokens, 1),
            "masked/token_high": self.num_masked_token_high / max(self.num_loss_tokens, 1),
            "masked/sequence_low": self.num_masked_sequence_low / max(self.num_loss_tokens, 1),
            "masked/sequence_high": self.num_masked_sequence_high / max(self.num_loss_tokens, 1),
            "masked/truncated": self.num_masked_truncated / max(self.num_loss_tokens, 1),
            "mismatch_kl": self.kl_sum / num_kept,
            "entropy": self.entropy_sum / num_kept,
        }
        if self.has_teacher:
            out["teacher_kl"] = self.teacher_kl_sum / num_kept
        if self.has_clip:
            out["clip_frac_low"] = self.num_clipped_low / num_kept
            out["clip_frac_high"] = self.num_clipped_high / num_kept
        if self.has_tis:
            out["tis_frac_capped"] = self.num_tis_capped / num_kept
        if self.has_kl_ref:
            out["kl_ref"] = self.kl_ref_sum / num_kept
        if self.has_router_aux_loss:
            out["router_aux_loss"] = self.router_aux_loss
        return out


def _num_samples(sample_ids: torch.Tensor) -> int:
    return int(sample_ids.max().item()) + 1 if sample_ids.numel() else 0


def _per_sample_sum(values: torch.Tensor, sample_ids: torch.Tensor, num_samples: int) -> torch.Tensor:
    """[num_samples] sum of `values` [T] over each sample's tokens."""
    import torch

    return torch.zeros(num_samples, dtype=values.dtype, device=values.device).index_add_(
        0, sample_ids, values
    )


@dataclass
class MaskedBy:
    """[T] bool each: the loss tokens each mask drops (a token may be dropped by several)."""

    token_low: torch.Tensor
    token_high: torch.Tensor
    sequence_low: torch.Tensor
    """Its sample's geometric-mean ratio below geo_mask_low, or its smallest token ratio below
    sequence_mask_low."""
    sequence_high: torch.Tensor
    truncated: torch.Tensor
    """Outside the kept set of the truncated distribution (grpo.trainer.sampling_truncation)."""

    def keep(self, loss_mask: torch.Tensor) -> torch.Tensor:
        dropped = self.token_low | self.token_high | self.sequence_low | self.sequence_high | self.truncated
        return loss_mask & ~dropped


def masked_by(
    log_ratio: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_ids: torch.Tensor,
    cfg: LossConfig,
    truncated: torch.Tensor | None = None,
) -> MaskedBy:
    """Which loss tokens the token, geometric-mean and min/max sequence masks drop, and why;
    `truncated` [T] bool marks tokens outside the policy's kept set, dropped whatever the masks."""
    import torch

    ratio = torch.exp(log_ratio)
    num_samples = _num_samples(sample_ids)
    count = _per_sample_sum(loss_mask.to(log_ratio.dtype), sample_ids, num_samples)
    masked_lr = torch.where(loss_mask, log_ratio, torch.zeros_like(log_ratio))
    geo_mean = torch.exp(_per_sample_sum(masked_lr, sample_ids, num_samples) / count.clamp(min=1))
    inf = torch.full((num_samples,), float("inf"), dtype=ratio.dtype, device=ratio.device)
    min_ratio = inf.scatter_reduce(0, sample_ids, torch.where(loss_mask, ratio, inf[0]), "amin")
    max_ratio = (-inf).scatter_reduce(0, sample_ids, torch.where(loss_mask, ratio, -inf[0]), "amax")
    sample_low = ((geo_mean < cfg.geo_mask_low) | (min_ratio < cfg.sequence_mask_low)) & (count > 0)
    sample_high = ((geo_mean > cfg.geo_mask_high) | (max_ratio > cfg.sequence_mask_high)) & (count > 0)
    return MaskedBy(
        token_low=loss_mask & (ratio < cfg.token_mask_low),
        token_high=loss_mask & (ratio > cfg.token_mask_high),
        sequence_low=loss_mask & sample_low[sample_ids],
        sequence_high=loss_mask & sample_high[sample_ids],
        truncated=loss_mask & (truncated if truncated is not None else torch.zeros_like(loss_mask)),
    )


def keep_mask(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, sample_ids: torch.Tensor, cfg: LossConfig
) -> torch.Tensor:
    """[T] bool: loss tokens that survive the token, geometric-mean and min/max sequence masks."""
    return masked_by(log_ratio, loss_mask, sample_ids, cfg).keep(loss_mask)


def importance_ratio(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, sample_ids: torch.Tensor, cfg: LossConfig
) -> torch.Tensor:
    """[T] ratio used in coeff: per token, or one per sample (the exp of the sum, or of the mean,
    of its loss tokens' log-ratios) clipped at sequence_clip_high."""
    import math

    import torch

    if cfg.ratio_type == "token":
        return torch.exp(log_ratio)
    num_samples = _num_samples(sample_ids)
    weights = loss_mask.to(log_ratio.dtype)
    seq_log_ratio = _per_sample_sum(log_ratio * weights, sample_ids, num_samples)
    if cfg.ratio_type == "sequence_geometric_mean":
        seq_log_ratio = seq_log_ratio / _per_sample_sum(weights, sample_ids, num_samples).clamp(min=1)
    # Clipped in log space: the exp of a long sequence's sum would overflow before the clip.
    seq_ratio = torch.exp(seq_log_ratio.clamp(max=math.log(cfg.sequence_clip_high)))
    return seq_ratio[sample_ids]


def token_weights(loss_mask: torch.Tensor, sample_ids: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """[T] weight of each token in its micro-batch's sum: 1 (ratio_type token), or 1 / the loss
    tokens of its sample (the sequence types: each sample counts once, whatever its length)."""
    import torch

    weights = loss_mask.to(torch.float64)
    if cfg.ratio_type == "token":
        return weights
    num_samples = _num_samples(sample_ids)
    count = _per_sample_sum(weights, sample_ids, num_samples).clamp(min=1)
    return weights / count[sample_ids]


def _kept_kl(lp: torch.Tensor, ref_lp: torch.Tensor, keep: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """[T] loss.kl_estimator(lp, ref_lp) on the kept tokens, 0 elsewhere (gradient through lp)."""
    import torch

    # A dropped token gets lp = ref = 0 (estimate and gradient exactly 0): either may be -inf, and
    # a `where` after the estimate would still backpropagate 0 * inf = NaN.
    zeros = torch.zeros_like(lp.detach())
    ref_lp = torch.where(keep, ref_lp.detach().to(zeros.dtype), zeros)
    return kl_estimate(torch.where(keep, lp, zeros), ref_lp, cfg.kl_estimator)


def grpo_loss(
    trainer_lp: torch.Tensor,
    inference_lp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_ids: torch.Tensor,
    cfg: LossConfig,
    loss_scale: int,
    teacher_lp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    untempered_lp: torch.Tensor | None = None,
    ref_lp: torch.Tensor | None = None,
    old_lp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossSums]:
    """Loss of one micro-batch's tokens, all tensors [T]; returns (loss, sums).

    `sample_ids` says which sample each token belongs to (any integers >= 0; the sequence masks,
    ratios and per-sample weights group by it, so a sample's loss tokens must all be in this call).
    Only `trainer_lp` may carry a gradient; inference and teacher logprobs are treated as data.
    `untempered_lp` (the trainer's logprobs at temperature 1, no gradient) comes with `teacher_lp`:
    the teacher term and teacher_kl compare it with the teacher. `ref_lp` (the frozen reference's
    logprobs at the same temperature as trainer_lp) comes with loss.kl_beta > 0. `old_lp` (the first
    pass's trainer_lp, detached) only on a batch's later updates (num_iterations > 1).
    """
    import torch

    if teacher_lp is None and cfg.teacher_tau > 0:
        raise UserError(
            "loss.teacher_tau > 0 but the batch has no teacher logprobs; configure teacher_model in "
            "orch.yaml or set loss.teacher_tau: 0"
        )
    assert loss_scale > 0, "loss_scale is the step's normaliser (LossConfig.loss_scale)"
    loss_mask = loss_mask.bool()
    inference_lp = inference_lp.detach().to(trainer_lp.dtype)
    lp = trainer_lp.detach()
    zeros = torch.zeros_like(lp)
    log_ratio = torch.where(loss_mask, lp - inference_lp, zeros)
    old_log_ratio = log_ratio
    policy_ratio = old_ratio = None
    with torch.no_grad():
        ratio = importance_ratio(log_ratio, loss_mask, sample_ids, cfg)
        if old_lp is not None:
            old_lp = old_lp.detach().to(lp.dtype)
            old_log_ratio = torch.where(loss_mask, old_lp - inference_lp, zeros)
            old_ratio = importance_ratio(old_log_ratio, loss_mask, sample_ids, cfg)
            policy_log_ratio = torch.where(loss_mask, lp - old_lp, zeros)
            policy_ratio = importance_ratio(policy_log_ratio, loss_mask, sample_ids, cfg)
        # A token the policy's truncated distribution no longer keeps has a stand-in logprob whose
        # ratio and k3 are meaningless (the loss metric read 833 with token_mask_low 0): never counted.
        truncated = lp <= OUTSIDE_LOGPROB / 2
        if old_lp is not None:
            truncated |= old_lp <= OUTSIDE_LOGPROB / 2
        # The masks guard against the behaviour mismatch: decided by the first pass, kept after it.
        masks = masked_by(old_log_ratio, loss_mask, sample_ids, cfg, truncated)
        keep = masks.keep(loss_mask)
        advantages = advantages.to(lp.dtype)
        kl_ref = None
        if cfg.kl_in_reward:
            assert ref_lp is not None, "loss.kl_in_reward: the trainer passes the reference logprobs"
            # The reward is fixed once the batch is sampled: the first pass's logprobs on every update.
            kl_ref = _kept_kl(lp if old_lp is None else old_lp, ref_lp, keep, cfg)
            advantages = advantages - cfg.kl_beta * return_to_go(kl_ref, sample_ids)
        signal = cfg.adv_tau * advantages - cfg.kl_tau * log_ratio
        if teacher_lp is not None:
            assert untempered_lp is not None, "the teacher term needs the trainer's logprobs at temperature 1"
            teacher_lp = teacher_lp.detach().to(lp.dtype)
            student_lp = untempered_lp.detach().to(lp.dtype)
            signal = signal + cfg.teacher_tau * (teacher_lp - student_lp)
        clipped = clip_ratio(ratio, signal, cfg, policy_ratio, old_ratio)
        weights = token_weights(loss_mask, sample_ids, cfg).to(lp.dtype)
        coeff = clipped.weight * signal * weights
        # `where`, not a multiplication by keep: a dropped token's coeff may be inf (its ratio
        # overflowed), and inf * 0 would make the loss and every gradient NaN. The metrics below
        # select the kept tokens the same way. A token PPO's clip catches stays kept (it counts in
        # the metrics) but keeps no gradient.
        coeff = torch.where(keep & clipped.has_gradient, coeff, zeros)
    loss = -(coeff * trainer_lp).sum() / loss_scale
    if cfg.kl_beta > 0 and not cfg.kl_in_reward:
        assert ref_lp is not None, "loss.kl_beta > 0: the trainer passes the reference logprobs"
        kl_ref = _kept_kl(trainer_lp, ref_lp, keep, cfg)
        loss = loss + cfg.kl_beta * (kl_ref * weights).sum() / loss_scale

    with torch.no_grad():
        k3 = torch.where(keep, torch.exp(log_ratio) - 1 - log_ratio, zeros)
        sums = LossSums(
            loss=float(loss.detach()),
            num_loss_tokens=int(loss_mask.sum()),
            num_masked_tokens=int((loss_mask & ~keep).sum()),
            num_masked_token_low=int(masks.token_low.sum()),
            num_masked_token_high=int(masks.token_high.sum()),
            num_masked_sequence_low=int(masks.sequence_low.sum()),
            num_masked_sequence_high=int(masks.sequence_high.sum()),
            num_masked_truncated=int(masks.truncated.sum()),
            kl_sum=float(k3.sum()),
            num_clipped_low=int((keep & clipped.clipped_low).sum()),
            num_clipped_high=int((keep & clipped.clipped_high).sum()),
            num_tis_capped=int((keep & clipped.tis_capped).sum()),
            has_clip=cfg.clip_low is not None or cfg.clip_high is not None,
            has_tis=cfg.tis_cap is not None,
        )
        if kl_ref is not None:
            sums.kl_ref_sum = float(kl_ref.detach().sum())
            sums.has_kl_ref = True
        if entropy is not None:
            sums.entropy_sum = float(torch.where(keep, entropy.detach().to(lp.dtype), zeros).sum())
        if teacher_lp is not None:
            teacher_log_r = torch.where(keep, teacher_lp - student_lp, zeros)
            sums.teacher_kl_sum = float((torch.exp(teacher_log_r) - 1 - teacher_log_r).sum())
            sums.has_teacher = True
    return loss, sums


def loss_of_tokens(
    tokens: LossTokens,
    lp: torch.Tensor,
    entropy: torch.Tensor,
    untempered_lp: torch.Tensor | None,
    cfg: LossConfig,
    loss_scale: int,
    ref_lp: torch.Tensor | None = None,
    old_lp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossSums]:
    """grpo_loss over a micro-batch's loss tokens (every one counts: the packer kept only those),
    given the trainer's logprobs at them (and the reference's and the first pass's where used);
    shared by both trainer backends."""
    import torch

    has_teacher = tokens.teacher_logprobs is not None
    return grpo_loss(
        lp,
        tokens.inference_logprobs,
        tokens.advantages,
        torch.ones_like(tokens.targets, dtype=torch.bool),
        tokens.sequence_ids,
        cfg,
        loss_scale,
        teacher_lp=tokens.teacher_logprobs,
        entropy=entropy,
        untempered_lp=untempered_lp if has_teacher else None,
        ref_lp=ref_lp,
        old_lp=old_lp,
    )
