"""train.yaml `loss`: the policy loss's terms, masks, clips and coefficients (every formula in
docs/loss.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpo.config.base import StrictModel


class LossConfig(StrictModel):
    type: Literal["default", "cispo"] = "default"
    """default: the importance-ratio-weighted policy gradient (AIPO-style), with PPO's
    clipped surrogate when clip_low / clip_high are set (a token the clip catches keeps no
    gradient). cispo (MiniMax-M1's CISPO): the ratio is clamped to [clip_low, clip_high] as a
    weight instead, and every kept token keeps its gradient; needs clip_high and/or clip_low. Both
    ratios are against the behaviour (inference) logprobs; the masks apply to both (docs/loss.md)."""

    ratio_type: Literal["token", "sequence", "sequence_geometric_mean"] = "token"
    """Importance ratio per token, or one per sequence (per sample) shared by its tokens. sequence:
    exp of the sum of the sample's token log-ratios (the sample's probability ratio), clipped at
    sequence_clip_high. sequence_geometric_mean: exp of their mean (GSPO's length-normalised ratio),
    clipped the same way. Both sequence types normalise per sample: each sample's token loss is
    averaged over its own loss tokens and the step over its samples (docs/loss.md)."""

    kl_tau: float = Field(0.0, ge=0.0)
    """Weight of the -log_ratio term that keeps the policy near the inference policy."""

    adv_tau: float = Field(1.0, ge=0.0)
    """Weight of the advantage term."""

    teacher_tau: float = Field(0.0, ge=0.0)
    """Weight of the teacher term (teacher_lp - trainer_lp, both at temperature 1 whatever the
    sampling temperature, since the teacher scores without one); needs teacher logprobs in the batch."""

    token_mask_low: float = Field(0.125, ge=0.0)
    """Mask tokens whose importance ratio is below this."""

    token_mask_high: float = Field(8.0, gt=0.0)
    """Mask tokens whose importance ratio is above this."""

    geo_mask_low: float = Field(0.1, ge=0.0)
    """Mask a whole sequence when the geometric mean of its ratios is below this."""

    geo_mask_high: float = Field(10.0, gt=0.0)
    """Mask a whole sequence when the geometric mean of its ratios is above this."""

    sequence_mask_low: float = Field(0.0, ge=0.0)
    """Mask a sequence when its smallest token ratio is below this."""

    sequence_mask_high: float = Field(100.0, gt=0.0)
    """Mask a sequence when its largest token ratio is above this."""

    sequence_clip_high: float = Field(10.0, gt=0.0)
    """Upper clip of the sequence-level ratio (ratio_type: sequence or sequence_geometric_mean)."""

    clip_low: float | None = Field(None, ge=0.0)
    """Lower ratio bound, a ratio below 1 (1 - epsilon: 0.8 for TRL's epsilon / verl's
    clip_ratio_low 0.2); null: no lower bound. type default: PPO's clip, a token whose ratio is
    below it and whose signal (advantage term and the kl/teacher terms) is negative keeps no
    gradient. type cispo: ratios below it are raised to it in the weight."""

    clip_high: float | None = Field(None, gt=0.0)
    """Upper ratio bound, a ratio above 1 (1 + epsilon_high: 1.28 for DAPO's clip-higher 0.28);
    null: no upper bound. type default: PPO's clip, a token whose ratio is above it and whose
    signal is positive keeps no gradient. type cispo: ratios above it are lowered to it in the
    weight (MiniMax-M1 sets only this bound; e.g. 5.0)."""

    tis_cap: float | None = Field(None, ge=1.0)
    """Truncated importance sampling: the token's ratio in the loss coefficient becomes
    min(ratio, tis_cap) (a detached weight that corrects the trainer/vLLM mismatch without letting
    one token's weight explode; TRL's vllm_importance_sampling_cap, e.g. 2 or 3). null: off.
    ratio_type token and type default only."""

    kl_beta: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty against a frozen reference policy (TRL's beta, verl's kl_loss_coef):
    kl_beta * kl_estimator(lp, ref_lp) per kept loss token, normalised like the policy term, with
    its gradient through lp. The reference is the base model with the LoRA adapters disabled (no
    second copy), or for full-parameter training a frozen copy of the initial weights on the
    training device. 0: off (no reference forward). Backend hf only; metric kl_ref. With
    kl_in_reward the penalty goes into the reward instead of the loss."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token estimate of KL(policy || reference) that kl_beta weights, with r = ref_lp - lp:
    k1 = -r (verl's kl), k2 = r^2 / 2 (verl's mse), k3 = exp(r) - r - 1 (verl's low_var_kl, TRL's;
    never negative). Formulas and gradients in docs/loss.md."""

    kl_in_reward: bool = False
    """Apply kl_beta's KL as a reward penalty instead of a loss term (verl's use_kl_in_reward): each
    token's reward gets -kl_beta * kl_estimator(lp, ref_lp), and each kept token's advantage A[t]
    becomes A[t] - kl_beta * (the sum of the estimate over the kept tokens of its sample from t on),
    a detached return-to-go, with no gradient of its own. The orchestrator's group advantage A is
    normalised as configured; the penalty is neither centred nor scaled by the group (docs/loss.md,
    "KL as a reward penalty"). The estimate uses the first pass's logprobs on every update. Needs
    kl_beta > 0 and adv_tau > 0."""

    normalization: Literal["tokens", "constant"] = "tokens"
    """What the step's summed token loss is divided by. tokens: the step's loss tokens (every token
    weighs the same within a step); with a sequence ratio_type, per sample instead: each sample's
    mean over its loss tokens, divided by the step's samples. constant: normalization_constant,
    whatever the step's lengths (Dr. GRPO's unbiased aggregation; orch advantage.type dr_grpo needs
    it; ratio_type token only)."""

    normalization_constant: int | None = Field(None, gt=0)
    """(constant) The divisor; Dr. GRPO uses rollouts per step x max completion tokens
    (orch batch_size x sampling.max_tokens)."""

    @model_validator(mode="after")
    def _constant_with_its_value(self) -> LossConfig:
        if self.normalization == "constant" and self.normalization_constant is None:
            raise ValueError(
                "loss.normalization constant needs loss.normalization_constant (Dr. GRPO: orch batch_size x "
                "sampling.max_tokens)"
            )
        if self.normalization == "tokens" and self.normalization_constant is not None:
            raise ValueError(
                "loss.normalization_constant is only used with loss.normalization: constant; set one or "
                "remove the constant"
            )
        if self.normalization == "constant" and self.ratio_type != "token":
            raise ValueError(
                f"loss.ratio_type {self.ratio_type} averages each sample over its own tokens, which "
                "loss.normalization: constant (Dr. GRPO) exists to avoid; use ratio_type: token with it, "
                "or normalization: tokens"
            )
        return self

    def loss_scale(self, num_loss_tokens: int, num_loss_samples: int) -> int:
        """Divisor of a step's summed (per-sample weighted, for a sequence ratio_type) token loss,
        given the step's loss tokens and the samples that have some (all ranks)."""
        if self.normalization == "constant":
            assert self.normalization_constant is not None  # the validator guarantees it
            return self.normalization_constant
        if self.ratio_type == "token":
            return max(num_loss_tokens, 1)
        return max(num_loss_samples, 1)

    @model_validator(mode="after")
    def _kl_in_reward_has_a_reference(self) -> LossConfig:
        if self.kl_in_reward and self.kl_beta == 0:
            raise ValueError(
                "loss.kl_in_reward needs the frozen reference of loss.kl_beta > 0 (its penalty is "
                "kl_beta * the KL estimate); set kl_beta (e.g. 0.05) or remove kl_in_reward"
            )
        if self.kl_in_reward and self.adv_tau == 0:
            raise ValueError(
                "loss.kl_in_reward puts the KL penalty into the advantage, which loss.adv_tau 0 switches off; "
                "set adv_tau > 0 or kl_in_reward: false"
            )
        return self

    @model_validator(mode="after")
    def _ranges_ordered(self) -> LossConfig:
        for low, high in (
            ("token_mask_low", "token_mask_high"),
            ("geo_mask_low", "geo_mask_high"),
            ("sequence_mask_low", "sequence_mask_high"),
        ):
            if getattr(self, low) >= getattr(self, high):
                raise ValueError(f"loss.{low} must be below loss.{high}")
        return self

    @model_validator(mode="after")
    def _clip_bounds_make_sense(self) -> LossConfig:
        if self.clip_low is not None and self.clip_low >= 1.0:
            raise ValueError(
                f"loss.clip_low {self.clip_low:g} is a ratio bound below 1 (1 - epsilon): use 0.8 for epsilon 0.2"
            )
        if self.clip_high is not None and self.clip_high <= 1.0:
            raise ValueError(
                f"loss.clip_high {self.clip_high:g} is a ratio bound above 1 (1 + epsilon_high): use 1.28 for "
                "DAPO's 0.28"
            )
        if self.type == "cispo" and self.clip_low is None and self.clip_high is None:
            raise ValueError(
                "loss.type cispo clamps the ratio to [clip_low, clip_high] and neither is set (it would be the "
                "default loss): set loss.clip_high (e.g. 5.0)"
            )
        if self.tis_cap is not None and self.type == "cispo":
            raise ValueError(
                "loss.tis_cap with loss.type cispo: cispo already caps the weight at clip_high; set clip_high "
                "instead of tis_cap"
            )
        if self.tis_cap is not None and self.ratio_type != "token":
            raise ValueError(
                f"loss.tis_cap truncates the token ratio, and ratio_type {self.ratio_type} has one ratio per "
                "sample capped by sequence_clip_high: lower sequence_clip_high instead of tis_cap"
            )
        # With a token ratio, a token beyond a mask bound is dropped: a clip bound beyond it never acts.
        if self.ratio_type == "token":
            for name, bound, mask_name, mask in (
                ("clip_low", self.clip_low, "token_mask_low", self.token_mask_low),
                ("clip_high", self.clip_high, "token_mask_high", self.token_mask_high),
                ("tis_cap", self.tis_cap, "token_mask_high", self.token_mask_high),
            ):
                if bound is None:
                    continue
                outside = bound <= mask if name == "clip_low" else bound >= mask
                if outside:
                    raise ValueError(
                        f"loss.{name} {bound:g} is not inside loss.{mask_name} {mask:g}: every token it would "
                        f"act on is masked; move {name} inside the mask band or widen {mask_name}"
                    )
        return self
