"""Backend megatron's mixture-of-experts layers: what megatron-core's MoELayer needs around it.

The layers themselves are megatron-core's (grpo.trainer.megatron.layer_spec: MoELayer, TopKRouter,
SequentialMLP experts; grpo.trainer.megatron.model.moe_fields: routing that matches the HF
family's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch


@functools.cache
def define_missing_te_gemm() -> None:
    """megatron-core 0.16's router gating reads `te_general_gemm` (None meaning "use torch"), but
    its module binds that name only when Transformer Engine imports: without TE every router
    forward raises NameError. Bind it to None there, as megatron-core means it to be."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@dataclass
class RoutingReplay:
    """Rollout routing replay (R3, as grpo.trainer.hf.moe does it for the HF backend) on
    megatron-core's routers: each TopKRouter gets this as its `router_replay`, which megatron-core's
    top-k routing asks for the chosen experts (`get_replay_topk`) instead of taking its own top-k.

    The router still computes its scores (softmax inputs) from its own logits; the replayed experts'
    scores are gathered from them, so the mixing weights are the family's own for those experts
    (renormalised over the chosen ones exactly when the router renormalises its own) and gradients
    reach the router. A token without recorded routing (-1, padding included) keeps its own top-k.

    The routing of one decoder call is set before it (`set_call`) and read by every MoE layer's
    router during it, so activation recomputation that reruns a router after later calls (megatron
    recompute: full) or a pipeline schedule that interleaves micro-batches would replay the wrong
    call's routing: the config refuses routing_replay with either. Data- and expert-parallel ranks
    each replay their own rows' routing (a router sees its rank's tokens before they are dispatched);
    the metric sums their counts."""

    num_layers: int
    """Decoder layers (the batch's routing is indexed by decoder layer, as vLLM records it)."""
    top_k: int
    _routing: torch.Tensor | None = None
    """[L * B, layers, k] of the current call, in Megatron's sequence-major token order."""
    _differs: torch.Tensor | None = None
    _replayed: torch.Tensor | None = None
    _num_differing: int = 0
    _num_replayed: int = 0

    @classmethod
    def install(cls, gpt: Any, layer_offset: int, num_layers: int) -> RoutingReplay:
        """Hook the routers of GPTModel `gpt` (one pipeline stage whose first layer is decoder
        layer `layer_offset` of `num_layers`)."""
        routers = [
            (i, layer.mlp.router)
            for i, layer in enumerate(gpt.decoder.layers)
            if hasattr(layer.mlp, "router")
        ]
        assert routers, "preflight lets only MoE models with routers in every layer through"
        replay = cls(num_layers=num_layers, top_k=int(routers[0][1].topk))
        for index, router in routers:
            router.router_replay = _LayerReplay(replay, layer_offset + index)
        return replay

    def set_call(self, routing: torch.Tensor | None, batch_size: int) -> None:
        """The routing [B * L, layers, k] (grpo.trainer.routing.flat_routing's, [B, L] order) of the
        next decoder call over `batch_size` pieces; None: the routers choose for themselves."""
        self._flush()
        if routing is None:
            self._routing = None
            return
        if routing.shape[1] != self.num_layers or routing.shape[2] != self.top_k:
            raise UserError(
                f"routing_replay: the batch's routing is [tokens, {routing.shape[1]} layers, top-{routing.shape[2]}], "
                f"the model has {self.num_layers} layers and top-{self.top_k}: the engine served another model"
            )
        length = routing.shape[0] // batch_size
        # Megatron's routers see the tokens of an [L, B] activation flattened sequence-major.
        self._routing = routing.reshape(batch_size, length, *routing.shape[1:]).transpose(0, 1).flatten(0, 1)

    def choose(
        self, layer: int, scores: torch.Tensor, own: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores of the chosen experts [N, k], the chosen experts [N, k]) for decoder layer
        `layer`, whose router picked `own` [N, k] from `scores` [N, E]."""
        import torch

        if self._routing is None:
            return scores.gather(1, own), own
        assert self._routing.shape[0] == scores.shape[0], (self._routing.shape, scores.shape)
        wanted = self._routing[:, layer].long()
        replayed = wanted[:, 0] >= 0
        chosen = torch.where(replayed[:, None], wanted, own)
        differs = (own.sort(-1).values != chosen.sort(-1).values).any(-1) & replayed
        self._differs = differs if self._differs is None else self._differs | differs
        self._replayed = replayed
        return scores.gather(1, chosen), chosen

    def _flush(self) -> None:
        if self._replayed is not None and self._differs is not None:
            self._num_differing += int(self._differs.sum())
            self._num_replayed += int(self._replayed.sum())
        self._differs = self._replayed = None

    def take_metrics(self, summed_over_data_parallel: bool = False) -> dict[str, float]:
        """`routing_mismatch_fraction` since the last take, as the HF backend reports it: tokens
        whose own top-k differs from the replayed experts in some MoE layer, over the tokens replayed.
        `summed_over_data_parallel`: over every data-parallel rank's tokens (collective)."""
        self._flush()
        num_differing, num_replayed = self._num_differing, self._num_replayed
        self._num_differing = self._num_replayed = 0
        if summed_over_data_parallel:
            import torch
            from megatron.core import parallel_state

            counts = torch.tensor([num_differing, num_replayed], dtype=torch.int64)
            torch.distributed.all_reduce(counts, group=parallel_state.get_data_parallel_group())
            num_differing, num_replayed = (int(c) for c in counts)
        return {"routing_mismatch_fraction": num_differing / max(num_replayed, 1)}


@dataclass
class _LayerReplay:
    """What megatron-core's topk_routing_with_score_function calls in place of its own top-k."""

    replay: RoutingReplay
    layer: int

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None,
        group_topk: int | None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return self.replay.choose(self.layer, scores, own)
