"""The loss of one micro-batch of a training step: the policy loss on its loss tokens (grpo.trainer.loss)
plus, with router_aux_loss_coef > 0, the routers' load-balancing loss (grpo.trainer.hf.load_balancing)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from grpo.trainer.loss import LossSums, loss_of_tokens

if TYPE_CHECKING:
    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.hf.model import Policy
    from grpo.trainer.packing import MicroBatch
    from grpo.transport.batches.batch import SamplingTruncation


def micro_batch_loss(
    policy: Policy,
    cfg: TrainerConfig,
    mb: MicroBatch,
    loss_scale: int,
    truncation: SamplingTruncation,
    ref_lp: Any = None,
    old_lp: Any = None,
    keep_probs: bool = False,
) -> tuple[Any, LossSums, Any]:
    """Forward one micro-batch; logits only at the hidden states that predict its loss tokens,
    truncated as vLLM truncated them when it sampled (top_k/top_p/min_p). Returns (loss, sums,
    its logprobs detached); the loss is already divided by `loss_scale`. `keep_probs`: backward
    reads the probabilities forward computed (grpo.trainer.fused_logprobs)."""
    import torch

    from grpo.trainer.logprobs import token_logprobs_and_untempered

    balancing = policy.load_balancing
    with balancing.capture() if balancing is not None else contextlib.nullcontext():
        hidden = policy.hidden_states(mb)
    aux = balancing.row_losses(mb) if balancing is not None else None  # [rows]
    tokens = mb.loss
    if tokens.targets.numel() == 0:
        # A zero that still depends on every weight the forward used (FSDP's collectives need it).
        return hidden.sum() * 0.0, LossSums(), None
    has_teacher = tokens.teacher_logprobs is not None
    lp, entropy, untempered_lp = token_logprobs_and_untempered(
        hidden[tokens.predicted_from],
        policy.lm_head,
        tokens.targets,
        tokens.temperatures,
        cfg.logprob_chunk_size,
        untempered=has_teacher,
        truncation=truncation,
        keep_probs=keep_probs,
        kept_counts=tokens.kept_counts,
    )
    loss, sums = loss_of_tokens(
        tokens, lp, entropy, untempered_lp, cfg.loss, loss_scale, ref_lp=ref_lp, old_lp=old_lp
    )
    if aux is not None:
        from grpo.trainer.hf.load_balancing import row_loss_units

        units = torch.tensor(row_loss_units(mb, cfg.loss.ratio_type), dtype=aux.dtype, device=aux.device)
        aux_term = (aux * units).sum() / loss_scale
        loss = loss + cfg.router_aux_loss_coef * aux_term
        sums.router_aux_loss = float(aux_term.detach())
        sums.has_router_aux_loss = True
    return loss, sums, lp.detach()
