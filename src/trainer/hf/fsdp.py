"""FSDP2 for the HF backend's full-weight training: sharding the decoder layers, gradients and
their norm over a mix of sharded and replicated parameters, and an unsharded copy for publishing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

    from grpo.trainer.distributed import DistContext


def shard_full_model(causal_lm: torch.nn.Module) -> None:
    """FSDP2 for full-weight training: every decoder layer becomes a sharded unit. Embeddings, final
    norm and (tied) lm_head stay whole on every rank: the trainer calls the decoder and the lm_head
    separately, outside one root forward that could gather them; `sum_gradients` reduces theirs.

    FSDP reduce-scatters the MEAN over ranks; `sum_gradients` multiplies it back into a sum (the
    divide-factor hook for that needs PREMUL_SUM, which gloo lacks)."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(causal_lm.get_decoder(), "layers", None)
    if layers is None:
        raise UserError(
            f"{type(causal_lm).__name__} has no decoder .layers to shard; train it with lora: true"
        )
    for layer in layers:
        fully_shard(layer)


def is_sharded(param: torch.nn.Parameter) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def sum_gradients(params: list[torch.nn.Parameter], ctx: DistContext) -> None:
    """Make every gradient the sum over ranks. Replicated parameters: all-reduce in one flat buffer,
    a missing grad counting as zero (a rank whose rows carry no loss skips backward). FSDP-sharded
    parameters already hold the mean over ranks: scale it back."""
    import torch
    import torch.distributed as dist

    for param in params:
        if is_sharded(param) and param.grad is not None:
            param.grad.mul_(ctx.world_size)
    replicated = [p for p in params if not is_sharded(p)]
    if not replicated:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in replicated]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for param, grad in zip(replicated, grads, strict=True):
        numel = grad.numel()
        param.grad = flat[offset : offset + numel].view_as(param).to(param.dtype)
        offset += numel


def clip_mixed_gradients(params: list[torch.nn.Parameter], max_grad_norm: float, ctx: DistContext) -> float:
    """grpo.trainer.optim.clip_gradients for a mix of FSDP-sharded and replicated parameters (torch's
    clip_grad_norm_ refuses the mix): the norm before clipping, over the whole model."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        sharded_sq = torch.zeros((), dtype=torch.float64, device=ctx.device)
        replicated_sq = torch.zeros((), dtype=torch.float64, device=ctx.device)
        for param in params:
            if param.grad is None:
                continue
            if is_sharded(param):
                sharded_sq += param.grad.to_local().double().pow(2).sum()
            else:
                replicated_sq += param.grad.double().pow(2).sum()
        dist.all_reduce(sharded_sq, op=dist.ReduceOp.SUM)
        total_norm = float((sharded_sq + replicated_sq).sqrt())
        if max_grad_norm > 0 and total_norm > max_grad_norm:
            scale = max_grad_norm / (total_norm + 1e-6)
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(scale)
    return total_norm


def whole_model_copy(causal_lm: torch.nn.Module, ctx: DistContext) -> torch.nn.Module | None:
    """On rank 0, an unsharded copy of an FSDP2-sharded HF causal LM (same config, the whole
    weights, on CPU) for writing or sending; None on the other ranks. Collective: every rank calls it.

    A copy because the sharded model's own state_dict/save_pretrained yield its DTensor shards. Its
    non-persistent buffers (rotary frequencies) stay on the meta device: it is for saving, not forward."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    whole = get_model_state_dict(causal_lm, options=options)  # {} on ranks > 0
    if not ctx.is_main:
        return None
    dtypes = {t.dtype for t in whole.values()}
    assert len(dtypes) == 1, f"mixed weight dtypes {dtypes}"
    with torch.device("meta"):
        copy = AutoModelForCausalLM.from_config(causal_lm.config, dtype=dtypes.pop())
    copy.load_state_dict(whole, assign=True)
    copy.tie_weights()  # assign=True replaced the tied tensors one by one
    return copy
