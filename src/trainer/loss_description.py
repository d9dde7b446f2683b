"""train.yaml `loss` as one line for `--dry-run`: the formula of docs/loss.md with only the terms
that are on and their coefficients."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo.config.trainer import LossConfig


def _bound(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _signal(cfg: LossConfig) -> str:
    terms = []
    if cfg.adv_tau > 0:
        terms.append(
            f"{cfg.adv_tau:g}*(A - {cfg.kl_beta:g}*klg)" if cfg.kl_in_reward else f"{cfg.adv_tau:g}*A"
        )
    if cfg.kl_tau > 0:
        terms.append(f"- {cfg.kl_tau:g}*(lp - ilp)")
    if cfg.teacher_tau > 0:
        terms.append(f"+ {cfg.teacher_tau:g}*(tlp - lp1)")
    if not terms:
        return "0 (adv_tau, kl_tau and teacher_tau are all 0)"
    text = " ".join(terms)
    return text[2:] if text.startswith("+ ") else text


def _ratio(cfg: LossConfig) -> str:
    if cfg.ratio_type == "token":
        return "ratio = exp(lp - ilp) per token"
    kind = "product" if cfg.ratio_type == "sequence" else "geometric mean"
    return f"ratio = the {kind} of the sample's exp(lp - ilp), at most {cfg.sequence_clip_high:g}"


def _weight(cfg: LossConfig) -> str:
    if cfg.type == "cispo":
        return f"clamp(ratio, {_bound(cfg.clip_low)}, {_bound(cfg.clip_high)})"
    if cfg.tis_cap is not None:
        return f"min(ratio, {cfg.tis_cap:g})"
    return "ratio"


def _normaliser(cfg: LossConfig) -> str:
    if cfg.normalization == "constant":
        return f"L = {cfg.normalization_constant}"
    if cfg.ratio_type == "token":
        return "L = the step's loss tokens"
    return "L = the step's samples, each averaged over its loss tokens"


_KL_FORMULA = {"k1": "lp - ref", "k2": "(ref - lp)^2 / 2", "k3": "exp(ref - lp) - (ref - lp) - 1"}


def describe_loss(cfg: LossConfig) -> str:
    """One YAML comment line (the --dry-run output around it still parses)."""
    total = "-sum(coeff * lp) / L"
    if cfg.kl_beta > 0 and not cfg.kl_in_reward:
        total += f" + {cfg.kl_beta:g} * sum(w * kl) / L"
    parts = [f"coeff = {_weight(cfg)} * ({_signal(cfg)})", _ratio(cfg)]
    if cfg.kl_in_reward:
        parts.append(
            f"KL as a reward penalty: klg = the sum of kl = {cfg.kl_estimator} = {_KL_FORMULA[cfg.kl_estimator]} "
            "over the sample's kept tokens from this one on (first pass's lp, detached; not group-normalised), "
            "ref = the frozen reference's logprob"
        )
    elif cfg.kl_beta > 0:
        parts.append(
            f"kl = {cfg.kl_estimator} = {_KL_FORMULA[cfg.kl_estimator]} per kept token, ref = the frozen "
            "reference's logprob, w = the token's weight in L (gradient through lp)"
        )
    if cfg.type == "default" and (cfg.clip_low is not None or cfg.clip_high is not None):
        parts.append(
            f"PPO clip [{_bound(cfg.clip_low)}, {_bound(cfg.clip_high)}] (a clipped token keeps no gradient)"
        )
    parts.append(
        f"masks: token ratio [{cfg.token_mask_low:g}, {cfg.token_mask_high:g}], sample geometric mean "
        f"[{cfg.geo_mask_low:g}, {cfg.geo_mask_high:g}], sample token ratios "
        f"[{cfg.sequence_mask_low:g}, {cfg.sequence_mask_high:g}]"
    )
    parts.append(_normaliser(cfg))
    return f"# loss (type {cfg.type}, docs/loss.md): {total}; " + "; ".join(parts)
