"""Per-token log-probabilities from vocab-parallel logits, at each token's sampling temperature.

Each tensor-parallel rank computes logits for its slice of the vocabulary only; megatron-core's
`vocab_parallel_cross_entropy` combines the slices (max and normaliser all-reduced over the
tensor-parallel group) into -log p(target). It overwrites float32 logits in place, so it always
gets a fresh tensor (the division by the temperature makes one). As in grpo.trainer.logprobs, the
output layer runs on `chunk_size` tokens at a time inside activation checkpointing, so at most one
chunk's [tokens x vocab / tp] logits is alive, and its logits are float32 from 16-bit weights
(grpo.trainer.float32_logits.float32_linear), as the HF backend's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from grpo.trainer.megatron.model import MegatronModel


def _vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[N, V/tp] float32 logits (this rank's slice) -> [N] entropy of the whole softmax (no grad)."""
    import torch
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    multi = parallel_state.get_tensor_model_parallel_world_size() > 1
    with torch.no_grad():
        top = logits.max(dim=-1).values
        if multi:
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = logits - top[:, None]
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])  # [2, N]
        if multi:
            torch.distributed.all_reduce(sums, group=group)
        log_z = sums[0].log()
        return log_z - sums[1] / sums[0]


def _chunk(
    model: MegatronModel,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    untempered: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from grpo.trainer.float32_logits import float32_linear

    # The output layer's own product, in float32 as vLLM computes the logits (head_dtype float32)
    # rather than rounded to bf16. What ColumnParallelLinear adds around it without sequence
    # parallelism or fused weight-gradient accumulation (both off: grpo.trainer.megatron.model) is
    # the all-reduce of the input's gradient over the tensor-parallel ranks.
    layer = model.module.output_layer
    weight = model.output_weight()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        hidden = copy_to_tensor_model_parallel_region(hidden)
    raw = float32_linear(hidden, layer.weight if weight is None else weight, layer.bias)  # [C, V/tp]
    tempered = raw / temperatures.float()[:, None]  # a new tensor: the cross entropy writes into it
    entropy = _vocab_parallel_entropy(tempered.detach())  # before the cross entropy overwrites it
    token_lp = -vocab_parallel_cross_entropy(tempered[:, None, :], targets.long()[:, None])[:, 0]
    plain = raw.new_zeros(0)
    if untempered:
        import torch

        with torch.no_grad():
            plain = -vocab_parallel_cross_entropy(raw.detach().clone()[:, None, :], targets.long()[:, None])[
                :, 0
            ]
    return token_lp, entropy, plain


def token_logprobs(
    model: MegatronModel,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    chunk_size: int | None,
    untempered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, H] predicts targets [N] at temperatures [N] -> (logprobs [N], entropy [N] without
    gradient, logprobs at temperature 1 [N] without gradient when `untempered`, else [0])."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from grpo.trainer.logprobs import logprob_chunk_tokens
    from grpo.trainer.megatron.cpu_compat import on_cpu

    chunk_size = logprob_chunk_tokens(chunk_size, on_gpu=hidden.device.type != "cpu")
    needs_grad = torch.is_grad_enabled()
    chunks = []
    with on_cpu():
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            args = (model, hidden[start:end], targets[start:end], temperatures[start:end], untempered)
            chunks.append(checkpoint(_chunk, *args, use_reentrant=False) if needs_grad else _chunk(*args))
    if not chunks:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty, empty
    lp, entropy, plain = (torch.cat(parts) for parts in zip(*chunks, strict=True))
    return lp, entropy, plain


def every_token_logprobs(
    model: MegatronModel,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    parent_ids: torch.Tensor,
    temperatures: torch.Tensor,
    chunk_size: int | None,
) -> torch.Tensor:
    """[T] logprobs aligned with input_ids (0 where a sequence starts), as
    grpo.trainer.logprobs.every_token_logprobs."""
    import torch

    predicted = (parent_ids >= 0).nonzero().squeeze(-1)
    lp, _, _ = token_logprobs(
        model, hidden[parent_ids[predicted]], input_ids[predicted], temperatures[predicted], chunk_size
    )
    out = torch.zeros(input_ids.shape[0], dtype=lp.dtype, device=lp.device)
    return out.index_copy(0, predicted, lp)
