"""Streaming micro-batches (orch.yaml `streaming`): a step's groups reach the trainer in parts.

The trainer runs forward/backward on each part as it arrives and steps the optimizer once every
part of the step is in, so the update is the one-shot update (same groups, same loss normaliser).
"""

from __future__ import annotations

import math

from pydantic import Field

from grpo.config.base import StrictModel

BATCH_WIDE_ADVANTAGES = frozenset({"reinforce_pp", "reinforce_pp_baseline", "custom"})
"""Advantage types that may look at every group of the step at once (batch whitening; a custom
function sees the whole [groups, n] array): a part does not hold the step's groups."""


class StreamingConfig(StrictModel):
    groups_per_part: int | None = Field(None, gt=0)
    """Send a step to the trainer in parts of this many finished groups (the last part may hold
    fewer), so it trains on the first groups while the slowest ones still generate; the optimizer
    steps once all num_groups_per_step groups are in, and the update equals the one-shot one (the
    gradients are summed and divided by the step's loss tokens at the end). null (default): the
    whole step as one batch. Needs a per-group advantage (not reinforce_pp, reinforce_pp_baseline
    or custom) and a single-process trainer (train gpus 1, infer dp 1 co-located)."""

    def num_parts(self, num_groups_per_step: int) -> int:
        """Parts per step: 1 when streaming is off."""
        if self.groups_per_part is None:
            return 1
        return math.ceil(num_groups_per_step / self.groups_per_part)


def streaming_advantage_problem(groups_per_part: int | None, advantage_type: str) -> str | None:
    if groups_per_part is None or advantage_type not in BATCH_WIDE_ADVANTAGES:
        return None
    return (
        f"streaming.groups_per_part needs a per-group advantage, but advantage.type {advantage_type} "
        "uses every group of the step at once; use default, grpo, dr_grpo or rloo, or set "
        "streaming.groups_per_part: null"
    )


def streaming_trainer_problem(
    groups_per_part: int | None, num_trainer_ranks: int, backend: str = "hf", num_iterations: int = 1
) -> str | None:
    if groups_per_part is None:
        return None
    if num_iterations > 1:
        return (
            f"train num_iterations {num_iterations} trains on the whole batch several times, but orch "
            "streaming.groups_per_part hands the step over in parts; set one of them back (num_iterations: 1, "
            "or streaming.groups_per_part: null)"
        )
    if backend != "hf":
        return (
            f"orch streaming.groups_per_part needs the hf trainer backend (train backend is {backend}); "
            "set streaming.groups_per_part: null, or train with backend: hf"
        )
    if num_trainer_ranks <= 1:
        return None
    return (
        f"orch streaming.groups_per_part streams parts of a step to one trainer process, but the trainer "
        f"has {num_trainer_ranks} data-parallel ranks; set streaming.groups_per_part: null, or train "
        "on one rank (train gpus 1; co-located: infer dp 1)"
    )
