"""The routers' auxiliary load-balancing loss of mixture-of-experts models (router_aux_loss_coef).

Switch Transformer's loss, as transformers computes it for every MoE family here
(`load_balancing_loss_func` of Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss): over a set of real tokens,
pooled over the MoE layers (every (token, layer) pair counts once),

    aux = num_experts * sum_e f_e * P_e

f_e: the (token, layer) pairs routed to expert e over the pairs, each of a token's top-k experts
counted (so sum_e f_e = top_k); P_e: the mean over the pairs of e's softmax probability from the
router's logits. Only P carries a gradient (f counts a discrete choice), so the loss pulls each
router's probabilities away from the experts it overloads.

**Over which tokens.** HF pools one forward call's real tokens. Here the unit is one packed row
(`MicroBatch.rows`): its real tokens, a shared prefix's once (its router logits are the same for
every sample that shares it). A row is what the orchestrator packed, whatever micro_batch_tokens,
micro_batches_per_backward or gradient checkpointing do with it, so none of these changes the loss.
A micro-batch of several rows gives each row its own aux.

**Across rows.** The policy loss is a sum over loss units (loss tokens; samples for a sequence
ratio_type) divided by the step's `loss_scale`; each row's aux is weighted by the row's units
in the same way, so the step's term is a units-weighted mean of the rows' aux (with
loss.normalization constant: the units' sum over the constant, as the policy loss is) and
micro-batches add up as the policy loss's do. Rows without loss tokens weigh nothing.
The trainer adds router_aux_loss_coef * that term to the loss and reports it as `router_aux_loss`.

**Routing replay.** With routing_replay the experts a token is dispatched to are the replayed ones
(RoutingReplay's hook rewrites the router's output before this one reads it), and f_e counts those:
f is the load the experts actually carried in this forward (and in the rollout), which is what
Switch's f measures; the router's own top-k is not used by anything else. P_e stays the router's
probabilities, so the gradient is the same kind as without replay.

**Capture.** A forward hook on every router keeps its (logits [N, E], experts [N, k]) only while
`capture()` is open, around the trainer's own forward of a micro-batch: the reference's and
score()'s forwards are not counted, and a layer recomputed by gradient checkpointing runs its router
again in backward, after the window has closed, so it never counts twice (the logits captured in the
forward keep their graph; backward recomputes through them like any activation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from grpo.trainer.hf.moe import moe_layers
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from grpo.trainer.packing import Forward, MicroBatch


@dataclass
class LoadBalancingLoss:
    """Hooks on the routers of a causal LM that capture what the load-balancing loss needs."""

    num_experts: int
    num_moe_layers: int
    _capturing: bool = False
    _calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    """Per MoE layer (in layer order), per decoder call: (router logits [N, E], experts [N, k])."""

    @classmethod
    def install(cls, causal_lm: nn.Module) -> LoadBalancingLoss:
        """Hook every router (after routing replay's hooks, so that replayed experts are seen);
        UserError for a model without MoE layers."""
        layers = moe_layers(causal_lm)
        if not layers:
            raise UserError(
                f"router_aux_loss_coef: {causal_lm.config.model_type} has no mixture-of-experts layers; "
                "set router_aux_loss_coef: 0"
            )
        loss = cls(num_experts=int(layers[0][1].num_experts), num_moe_layers=len(layers))
        for position, (_, router) in enumerate(layers):
            router.register_forward_hook(partial(loss._record, position))
        return loss

    def _record(self, position: int, router: nn.Module, inputs: Any, output: tuple[Any, ...]) -> None:
        if self._capturing:
            logits, _, experts = output
            self._calls[position].append((logits, experts))

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the routers' outputs of the forward inside (a micro-batch's, for `row_losses`)."""
        self._calls = [[] for _ in range(self.num_moe_layers)]
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def row_losses(self, batch: MicroBatch) -> torch.Tensor:
        """[rows] each row's aux loss from the forward of `batch` just captured (then forgotten)."""
        import torch

        calls, self._calls = self._calls, []
        assert calls and all(calls), "capture() the micro-batch's forward first"
        num_layers, num_experts = len(calls), self.num_experts
        prob_sums = counts = None  # [T, E]: summed over layers
        for layer_calls in calls:
            logits = _in_token_order([c[0] for c in layer_calls], batch.forwards)  # [T, E]
            experts = _in_token_order([c[1] for c in layer_calls], batch.forwards)  # [T, k]
            probs = torch.softmax(logits.float(), dim=-1)
            chosen = torch.zeros_like(probs).scatter_add_(
                -1, experts.long(), torch.ones(experts.shape, dtype=probs.dtype, device=probs.device)
            )
            prob_sums = probs if prob_sums is None else prob_sums + probs
            counts = chosen if counts is None else counts + chosen
        assert prob_sums is not None and counts is not None
        row_sizes = [row.num_tokens for row in batch.rows]
        assert sum(row_sizes) == batch.num_tokens, "MicroBatch.rows cover its tokens"
        row_ids = torch.repeat_interleave(
            torch.arange(len(row_sizes), device=probs.device),
            torch.tensor(row_sizes, device=probs.device),
        )
        row_probs = prob_sums.new_zeros(len(row_sizes), num_experts).index_add_(0, row_ids, prob_sums)
        row_counts = counts.new_zeros(len(row_sizes), num_experts).index_add_(0, row_ids, counts)
        num_pairs = torch.tensor(row_sizes, dtype=probs.dtype, device=probs.device)[:, None] * num_layers
        return num_experts * ((row_counts / num_pairs) * (row_probs / num_pairs)).sum(-1)


def _in_token_order(per_call: list[torch.Tensor], forwards: list[Forward] | None) -> torch.Tensor:
    """One layer's per-token router outputs of a micro-batch's decoder calls in micro-batch order,
    padding dropped (as Policy.hidden_states reassembles the hidden states)."""
    import torch

    if forwards is None:  # one [1, T] call
        (only,) = per_call
        return only
    assert len(per_call) == len(forwards), (len(per_call), len(forwards))
    parts = torch.cat([out[forward.slots] for out, forward in zip(per_call, forwards, strict=True)])
    order = torch.cat([forward.tokens for forward in forwards])
    return parts[torch.argsort(order)]


def row_loss_units(batch: MicroBatch, ratio_type: str) -> list[int]:
    """What each row adds to the policy loss's normaliser (LossConfig.loss_scale): its loss tokens,
    or its loss samples for a sequence ratio_type."""
    if ratio_type == "token":
        return [row.num_loss_tokens for row in batch.rows]
    return [row.num_loss_samples for row in batch.rows]
