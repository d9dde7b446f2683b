"""`train.yaml` `megatron:`: the parallel layout and knobs of the Megatron backend (`backend: megatron`).

Checks that need only the config run at load time (grpo.config.trainer); those that need the
model's shape (heads, KV heads and layers against the parallel sizes, the architecture) or the
world size run before the trainer waits for anything (grpo.trainer.megatron.preflight), and
again when it starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo.config.base import StrictModel


class MegatronConfig(StrictModel):
    tensor_model_parallel_size: int = Field(1, ge=1)
    """Ranks that split each layer's matmuls (attention heads, MLP columns, vocabulary). Must divide
    the attention heads and the KV heads."""

    pipeline_model_parallel_size: int = Field(1, ge=1)
    """Ranks that split the decoder layers into consecutive stages, run with megatron-core's 1F1B
    schedule (each micro-batch's pieces in one padded call; a stage keeps at most as many
    micro-batches' activations as there are later stages plus one, so micro_batches_per_backward
    plays no part). Must divide the layers."""

    expert_model_parallel_size: int = Field(1, ge=1)
    """(mixture-of-experts models) Ranks that split each MoE layer's experts: a rank holds
    num_experts / this of them, and megatron-core's all-to-all token dispatcher sends each token
    to the ranks of its experts. The expert-parallel ranks are data-parallel ranks for everything
    else (each trains its own rows). Must divide the model's experts and the number of GPUs; with
    more than 1, tensor_model_parallel_size and pipeline_model_parallel_size must be 1."""

    use_distributed_optimizer: bool = True
    """Shard the fp32 main weights and Adam moments over the data-parallel ranks (ZeRO-1)."""

    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in fp32 (else in the compute dtype)."""

    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: none; selective (attention's core only); full (each layer's
    activations, recomputed in backward: least memory)."""

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model (tensor x pipeline); data parallel = world / this."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size
