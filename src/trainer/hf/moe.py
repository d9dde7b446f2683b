"""Mixture-of-experts layers of HF models: their routers, rollout routing replay (R3), parameter counts.

Every MoE family transformers provides here (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss) routes with a
`*TopKRouter` module returning (router_logits [N, E], scores [N, k], expert ids [N, k]); the
experts block then mixes the chosen experts' outputs with the scores.

Routing replay (R3, arXiv 2510.11370): the trainer routes each token to the experts the inference
engine used for it instead of its own top-k, because slightly different numerics flip the discrete
choice and the trainer would otherwise compute logprobs through experts the rollout never used.
The router's logits are still the trainer's, and the scores of the replayed experts are computed
from them the way the family computes its own (softmax over all experts then the chosen ones,
renormalised where the family does; gpt-oss: softmax over the chosen logits), so gradients reach
the router. A token without recorded routing (-1) keeps the trainer's own choice.

The routing reaches each layer as a decoder keyword (`routed_experts`, [B * L, num_layers, top_k]
aligned with the flattened [B, L] input; indexed by decoder layer, as vLLM records it, so a dense
layer's entries are never read): a keyword travels with HF's gradient-checkpointed
layer calls, so the recomputation in backward replays the same experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from grpo.trainer.routing import check_batch_routing
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from grpo.transport.batches.batch import TrainingBatch

REPLAYED_FAMILIES = {
    "Qwen3MoeTopKRouter": "softmax",
    "Qwen2MoeTopKRouter": "softmax",
    "MixtralTopKRouter": "softmax_float",
    "GptOssTopKRouter": "topk_softmax",
}
"""Router class -> how it turns logits into the chosen experts' scores."""


def moe_layers(causal_lm: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, its router) of every MoE layer, in layer order (dense layers left out)."""
    layers = []
    for index, layer in enumerate(causal_lm.get_decoder().layers):
        routers = [m for m in layer.modules() if type(m).__name__.endswith("TopKRouter")]
        if routers:
            assert len(routers) == 1, f"{type(layer).__name__} has {len(routers)} routers"
            layers.append((index, routers[0]))
    return layers


def is_moe(causal_lm: nn.Module) -> bool:
    return bool(moe_layers(causal_lm))


@dataclass
class _Mismatch:
    routing: torch.Tensor
    """The routing tensor of one decoder call, held until the take so that no later tensor can reuse
    its id (a freed micro-batch's id reused by the next one lost the first one's counts)."""
    differs: torch.Tensor
    """[N] bool: some MoE layer's own top-k differs from the replayed experts."""
    replayed: torch.Tensor
    """[N] bool: the token has recorded routing."""


@dataclass
class RoutingReplay:
    """Hooks that make the routers of `causal_lm` use the experts passed as `routed_experts`."""

    num_layers: int
    """Decoder layers (routing is indexed by decoder layer)."""
    top_k: int
    _current: dict[int, torch.Tensor] = field(default_factory=dict)
    _calls: dict[int, _Mismatch] = field(default_factory=dict)

    @classmethod
    def install(cls, causal_lm: nn.Module) -> RoutingReplay:
        """Hook every decoder layer; raise UserError for a model without MoE layers or with a router
        whose scoring is not known here."""
        model_type = causal_lm.config.model_type
        layers = moe_layers(causal_lm)
        if not layers:
            raise UserError(
                f"routing_replay: {model_type} has no mixture-of-experts layers; set routing_replay: false"
            )
        for _, router in layers:
            if type(router).__name__ not in REPLAYED_FAMILIES:
                raise UserError(
                    f"routing_replay: {model_type}'s router {type(router).__name__} is not one grpo replays "
                    "(Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss); set routing_replay: false"
                )
        decoder_layers = causal_lm.get_decoder().layers
        replay = cls(num_layers=len(decoder_layers), top_k=int(layers[0][1].top_k))
        moe_indices = {index for index, _ in layers}
        for index, layer in enumerate(decoder_layers):
            layer_index = index if index in moe_indices else None
            layer.register_forward_pre_hook(partial(replay._take, layer_index), with_kwargs=True)
        for index, router in layers:
            router.register_forward_hook(
                partial(replay._replay, index, REPLAYED_FAMILIES[type(router).__name__])
            )
        return replay

    def _take(
        self, moe_index: int | None, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        routing = kwargs.pop("routed_experts", None)
        if moe_index is not None:
            self._current.pop(moe_index, None)
            if routing is not None:
                self._current[moe_index] = routing
        return args, kwargs

    def _replay(
        self, moe_index: int, scoring: str, router: nn.Module, inputs: Any, output: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...] | None:
        import torch

        routing = self._current.get(moe_index)
        if routing is None:
            return None
        logits, _, own = output
        assert routing.shape[0] == logits.shape[0], (routing.shape, logits.shape)
        if routing.shape[1] != self.num_layers or routing.shape[2] != self.top_k:
            raise UserError(
                f"routing_replay: the batch's routing is [tokens, {routing.shape[1]} layers, top-{routing.shape[2]}], "
                f"the model has {self.num_layers} layers and top-{self.top_k}: the engine served another model"
            )
        wanted = routing[:, moe_index].long()  # [N, k]
        replayed = wanted[:, 0] >= 0
        chosen = torch.where(replayed[:, None], wanted, own)
        scores = _scores(scoring, router, logits, chosen)
        differs = (own.sort(-1).values != chosen.sort(-1).values).any(-1) & replayed
        call = self._calls.get(id(routing))
        if call is None:
            self._calls[id(routing)] = _Mismatch(routing, differs.detach(), replayed)
        else:  # a later layer, or the recomputation in backward (idempotent)
            call.differs = call.differs | differs.detach()
        return logits, scores, chosen

    @staticmethod
    def check_batch(batch: TrainingBatch) -> None:
        """UserError unless every row of `batch` carries routing to replay."""
        check_batch_routing(batch)

    def take_metrics(self) -> dict[str, float]:
        """`routing_mismatch_fraction` since the last take: tokens whose own top-k differs from the
        replayed experts in some MoE layer, over the tokens replayed."""
        differing, replayed = self.take_mismatch()
        return {"routing_mismatch_fraction": differing / max(replayed, 1)}

    def take_mismatch(self) -> tuple[int, int]:
        """(tokens whose own routing differs from the replayed one in some layer, tokens replayed)
        over the decoder calls since the last take."""
        differing = sum(int(c.differs.sum()) for c in self._calls.values())
        replayed = sum(int(c.replayed.sum()) for c in self._calls.values())
        self._calls.clear()
        return differing, replayed


def _scores(scoring: str, router: nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The chosen experts' mixing weights [N, k], as the family's router computes its own."""
    import torch

    if scoring == "topk_softmax":
        return torch.softmax(logits.gather(-1, chosen), dim=-1, dtype=logits.dtype)
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, chosen)
    if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises
        weights = weights / weights.sum(-1, keepdim=True)
    return weights if scoring == "softmax_float" else weights.to(logits.dtype)
