"""Megatron's process groups (tensor, pipeline, data, expert parallel) and the layout checks behind them.

megatron-core needs torch.distributed even for one process, so a single trainer process starts a
one-rank group of its own over an in-process store. Under torchrun the group is the one
grpo.trainer.distributed.init_distributed joined. Data parallel = world / (tensor x pipeline).
Expert parallelism (mixture-of-experts models) splits each MoE layer's experts over
expert_model_parallel_size of the data-parallel ranks (megatron-core carves its expert groups out
of the data-parallel dimension): those ranks train different rows, and megatron-core's all-to-all
dispatcher sends each token to the rank holding its expert; what remains of the data-parallel
dimension (world / (pipeline x expert x tensor)) holds copies of the same experts (expert data
parallel: their gradients are reduced over that group only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    from grpo.config.sections.megatron import MegatronConfig

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}
"""Llama-style decoders: RMSNorm, RoPE, grouped-query attention, gated SiLU MLP (Qwen2 adds q/k/v
biases). Others need their own name and layout mapping (grpo.trainer.megatron.convert); the
config fields within these that the mapping does not reproduce are refused by
grpo.trainer.megatron.preflight."""

MOE_ARCHITECTURES = {"Qwen3MoeForCausalLM"}
"""Mixture-of-experts decoders: a Llama-style decoder with per-head q/k RMSNorm and, in every
layer, a softmax top-k router over SwiGLU experts (megatron-core's MoELayer, SequentialMLP)."""


@dataclass(frozen=True)
class ParallelRanks:
    """This process's place in Megatron's groups."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int = 0
    ep_size: int = 1
    """Expert-parallel rank and size: a rank holds experts ep_rank * n .. (ep_rank + 1) * n - 1 of
    each MoE layer, n = num_experts / ep_size."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def check_layout(mp: MegatronConfig, hf_config: Any, world_size: int) -> None:
    """UserError (one line with the fix) when the model cannot be split as `mp` asks (whether
    the model is supported at all: grpo.trainer.megatron.preflight)."""
    tp, pp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        raise UserError(
            f"megatron tensor_model_parallel_size {tp} must divide the model's {heads} attention heads and "
            f"{kv_heads} KV heads; pick a common divisor"
        )
    if hf_config.vocab_size % tp:
        raise UserError(
            f"megatron tensor_model_parallel_size {tp} must divide the vocabulary ({hf_config.vocab_size}); "
            "pick a divisor"
        )
    if hf_config.num_hidden_layers % pp:
        raise UserError(
            f"megatron pipeline_model_parallel_size {pp} must divide the model's {hf_config.num_hidden_layers} "
            "layers; pick a divisor"
        )
    if world_size % (tp * pp):
        raise UserError(
            f"{world_size} trainer ranks cannot hold whole copies of a model split {tp} (tensor) x {pp} "
            f"(pipeline) ways; launch a multiple of {tp * pp} ranks"
        )
    check_expert_layout(mp, hf_config, world_size)


def check_expert_layout(mp: MegatronConfig, hf_config: Any, world_size: int) -> None:
    ep = mp.expert_model_parallel_size
    if ep == 1:
        return
    num_experts = int(getattr(hf_config, "num_experts", None) or 0)
    if not num_experts:
        raise UserError(
            f"megatron expert_model_parallel_size {ep}: the model has no mixture-of-experts layers; "
            "set expert_model_parallel_size: 1"
        )
    if num_experts % ep:
        raise UserError(
            f"megatron expert_model_parallel_size {ep} must divide the model's {num_experts} experts; "
            "pick a divisor"
        )
    # megatron-core's expert groups: tensor x expert x pipeline ranks must tile the world.
    if world_size % (ep * mp.model_parallel_size):
        raise UserError(
            f"{world_size} trainer ranks cannot split the experts {ep} ways; launch a multiple of "
            f"{ep * mp.model_parallel_size} ranks"
        )


_FALLBACK_NOTICES = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "If you are using transformer_engine as the transformer implementation",
    r"`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
)
"""megatron-core's notices that it uses plain torch kernels (no Apex/TransformerEngine: the CPU
path, by design), that a default of its own config is deprecated, that TransformerEngine's fused
attention needs no selective recomputation (a hint for TE users, printed for every spec), and torch's deprecation of
collectives megatron-core 0.16 calls: nothing a user can act on."""


def silence_fallback_notices() -> None:
    import warnings

    for message in _FALLBACK_NOTICES:
        warnings.filterwarnings("ignore", message=message)
    # Its zero_grad reads `.grad` of the main-weight shards, which are views (never given a .grad).
    warnings.filterwarnings(
        "ignore", message="The .grad attribute of a Tensor that is not a leaf", module="megatron"
    )


def init_model_parallel(mp: MegatronConfig, device_type: str) -> ParallelRanks:
    """Create (or reuse, when the sizes match) Megatron's groups over the default process group."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        # One process: an in-process store (a TCP one would, under torchrun, look for the agent's).
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    tp, pp, ep = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size, mp.expert_model_parallel_size
    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size() == tp
            and parallel_state.get_pipeline_model_parallel_world_size() == pp
            and parallel_state.get_expert_model_parallel_world_size() == ep
        )
        if not same:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
        )
    if device_type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(int(torch.initial_seed()) % (2**31))
    return ParallelRanks(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=tp,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=pp,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=ep,
    )
