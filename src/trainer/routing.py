"""Rollout routing replay's backend-neutral parts: the batch check and the per-call routing layout
(each backend hooks its own routers: grpo.trainer.hf.moe, grpo.trainer.megatron.moe)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

    from grpo.transport.batches.batch import TrainingBatch


def check_batch_routing(batch: TrainingBatch) -> None:
    """UserError unless every row of `batch` carries routing to replay."""
    if any(row.routed_experts is None for row in batch.rows):
        raise UserError(
            f"routing_replay is on but batch step {batch.step} carries no routed_experts: start grpo-infer "
            "with return_routed_experts: true, or set routing_replay: false"
        )


def flat_routing(
    routing: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, num_slots: int
) -> torch.Tensor:
    """A micro-batch's [T, layers, k] routing laid out for one padded call of `num_slots` = B * L
    positions (`slots`/`tokens` as in grpo.trainer.packing.Forward); padding gets -1 (its own)."""
    out = routing.new_full((num_slots, *routing.shape[1:]), -1)
    out[slots] = routing[tokens]
    return out
