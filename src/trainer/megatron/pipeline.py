"""Pipeline stages (`pipeline_model_parallel_size` > 1): megatron-core's 1F1B schedule over our
micro-batches, and moving the last stage's results to the other stages.

Each micro-batch is one padded decoder call (grpo.trainer.packing with one_forward), so one
activation [L, B, H] travels between stages per micro-batch; its shape differs from micro-batch to
micro-batch, and the stages send it first (variable_seq_lengths, set in
grpo.trainer.megatron.model). Every rank of a pipeline builds the same micro-batches (it needs
their masks and positions); only the first stage embeds tokens and only the last computes
log-probabilities and the loss. With backward, 1F1B keeps at most (stages - stage index)
micro-batches' activations alive on a stage.

The schedule is called without finalize_model_grads_func: the trainer reduces the gradients itself
(data-parallel sum, and the tied embedding's two copies summed over the embedding group) and the
losses are already normalised by the step's loss tokens, so megatron-core must not divide them again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from grpo.trainer.megatron.model import MegatronModel
    from grpo.trainer.packing import MicroBatch

LossOfHidden = Callable[["MicroBatch", "torch.Tensor"], tuple["torch.Tensor", Any]]
"""(micro-batch, its final hidden states [T, H] in token order) -> (a scalar to backpropagate, what
to collect for it)."""


def run_schedule(
    model: MegatronModel,
    ddp: Any,
    micro_batches: list[MicroBatch],
    loss_of_hidden: LossOfHidden,
    forward_only: bool,
) -> list[Any]:
    """Run every micro-batch through the pipeline (forward, and backward unless `forward_only`):
    what `loss_of_hidden` collected per micro-batch, in order, on the last stage; [] elsewhere."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from grpo.trainer.megatron.cpu_compat import on_cpu

    assert micro_batches, "every rank of a pipeline has at least one (padding) row"
    for mb in micro_batches:
        assert mb.forwards is not None and len(mb.forwards) == 1, "one padded call per micro-batch"

    def forward_step(data_iterator: Any, _model: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        (forward,) = mb.forwards
        output = model.stage_output(forward)  # [L, B, H]

        def loss_func(last_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
            loss, collected = loss_of_hidden(mb, model.hidden_states(mb, [last_output]))
            # The token count is what megatron-core would divide by; with calculate_per_token_loss
            # and no finalize_model_grads_func it divides by nothing, so any count serves.
            return loss, torch.zeros((), dtype=torch.int), collected

        return output, loss_func

    first = micro_batches[0].forwards
    assert first is not None
    micro_batch_size, seq_length = first[0].input_ids.shape
    with on_cpu():
        return list(
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=ddp,
                num_microbatches=len(micro_batches),
                seq_length=seq_length,  # the first shape; later ones are sent (variable_seq_lengths)
                micro_batch_size=micro_batch_size,
                forward_only=forward_only,
            )
        )


def from_last_stage(tensor: torch.Tensor, model: MegatronModel) -> torch.Tensor:
    """The last stage's `tensor` on every stage of its pipeline, in place (the other stages pass a
    tensor of the same shape and dtype to receive into)."""
    import torch
    from megatron.core import parallel_state

    if model.ranks.pp_size > 1:
        torch.distributed.broadcast(
            tensor,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return tensor
