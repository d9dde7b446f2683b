"""orch.yaml `advantage`: how a group's rewards become the advantages the loss weighs tokens by
(formulas in docs/loss.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from grpo.config.base import StrictModel

GROUP_RELATIVE_ADVANTAGES = ("default", "grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
"""Advantage types whose baseline is the prompt's group: all 0 for a group of one rollout."""


class AdvantageConfig(StrictModel):
    type: Literal["default", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "custom"] = (
        "default"
    )
    """default: reward minus the group mean. grpo: that divided by the group's std (a group of equal
    rewards gets 0). dr_grpo (Dr. GRPO): reward minus the group mean, and the loss divided by a
    constant instead of the step's loss tokens, so it needs train loss.normalization: constant.
    rloo: reward minus the mean of the group's other rollouts (never whitened). reinforce_pp
    (REINFORCE++): rewards whitened over the batch's completion tokens, (r - mean) / (std + 1e-6),
    each rollout weighing its completion length. reinforce_pp_baseline: group mean removed, then
    whitened the same way. custom: import_path. The grpo group std is the sample std (ddof=1), as
    TRL's GRPO and OpenRLHF's group_norm compute it."""

    length_weighted_mean: bool = False
    """(default only) Weight the group mean by completion length; the other types use the baseline
    their paper defines and refuse it."""

    import_path: str | None = None
    """(custom) "pkg.module:function" or "file.py:function" (relative to the YAML file) taking (rewards
    [groups x n], lengths, **kwargs) and returning advantages."""

    kwargs: dict[str, Any] = Field(default_factory=dict)
    """(custom) keyword arguments for the function."""

    on_rollout_failure: Literal["exclude", "drop_group"] = "exclude"
    """A failed rollout (its environment raised or timed out, a reward function raised or timed out,
    a reward that is not a finite number) never trains and never counts as reward 0. exclude: its
    group's baseline and scale come from the rollouts that finished; a group left with fewer than 2
    of them is dropped. drop_group: it fails its whole group. Dropped groups count in
    failed/num_groups."""

    turn_credit: Literal["final", "per_turn"] = "final"
    """Multi-turn credit. final: one advantage per rollout from its reward (the score plus every
    turn's reward), on all its tokens. per_turn: each model turn's tokens carry that turn's own
    advantage: its return (its reward and the later turns', discounted by turn_discount) compared by
    `type` with the returns of the group's rollouts at the same turn index that reached it
    (docs/loss.md, "Multi-turn credit"). Single-turn rollouts are the same under both."""

    turn_discount: float = Field(1.0, ge=0.0, le=1.0)
    """(per_turn) gamma of a turn's return, sum over k >= t of gamma^(k-t) * r_k."""

    @model_validator(mode="after")
    def _options_the_type_uses(self) -> AdvantageConfig:
        if self.turn_discount != 1.0 and self.turn_credit != "per_turn":
            raise ValueError(
                "advantage.turn_discount only applies with advantage.turn_credit: per_turn; "
                "set turn_credit: per_turn or remove turn_discount"
            )
        if self.type == "custom" and not self.import_path:
            raise ValueError("advantage.type 'custom' needs advantage.import_path ('pkg.module:function')")
        if self.type != "custom" and self.import_path:
            raise ValueError("advantage.import_path is only used with advantage.type: custom")
        if self.type != "custom" and self.kwargs:
            raise ValueError("advantage.kwargs is only used with advantage.type: custom")
        if self.length_weighted_mean and self.type != "default":
            raise ValueError(
                f"advantage.length_weighted_mean only applies to advantage.type default; {self.type} uses "
                "the baseline its definition gives (a custom function receives the lengths itself): "
                "remove length_weighted_mean or use type: default"
            )
        return self
