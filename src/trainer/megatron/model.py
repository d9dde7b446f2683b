"""megatron-core GPTModel from an HF Llama-style checkpoint: build, load, forward, export.

The layer spec is TransformerEngine's on CUDA where transformer_engine imports, else megatron-core's
local spec (plain torch modules: what runs on CPU), both reading each call's attention mask
(grpo.trainer.megatron.layer_spec). Weights are held in the compute dtype (bf16
where the hardware has it, see grpo.trainer.device.choose_dtype); with bf16, Megatron's optimizer
keeps fp32 main weights, so updates do not round away.

Forward runs the embedding and the decoder on the padded pieces grpo.trainer.packing builds, with
the pieces' tree masks and RoPE at each token's own position (a shared prefix's branches repeat
positions, so positions are not the index in the piece). The output layer then runs only on the
hidden states that predict a needed token (grpo.trainer.megatron.logprobs).

With pipeline stages each rank builds only its stage (pre_process: the embedding on the first,
post_process: the final norm and output layer on the last) and loads its layers under their global
numbers. A tied embedding is also the last stage's output layer: megatron-core keeps a copy there
and sums the two copies' gradients over its embedding group (finalize_model_grads), so both
update alike; export takes the first stage's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.trainer.megatron.convert import (
    LOCAL_SPEC_NORMS,
    TE_SPEC_MOE_NORMS,
    TE_SPEC_NORMS,
    DecoderShape,
    NormNames,
    global_expert_name,
    global_layer_name,
    hf_to_megatron,
    split_dim,
    tp_slice,
)
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.megatron.moe import RoutingReplay
    from grpo.trainer.megatron.parallel import ParallelRanks
    from grpo.trainer.packing import Forward, MicroBatch


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None)
    assert theta is not None, "a Llama-style config names rope_theta"
    return float(theta)


def rope_inv_freq(hf_config: Any, head_dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2] (float32) as the HF model computes them: plain at
    rope_theta (a float: megatron-core's own rotary_base is an int), or rescaled per `rope_type`
    (linear, llama3: both change only the frequencies, never the attention scale; preflight
    refuses the others)."""
    import torch

    from grpo.trainer.megatron.preflight import SUPPORTED_ROPE_TYPES, rope_type

    kind = rope_type(hf_config)
    assert kind in SUPPORTED_ROPE_TYPES, "grpo.trainer.megatron.preflight refuses other RoPE"
    if kind == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (_rope_theta(hf_config) ** exponents)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](hf_config, torch.device("cpu"))
    assert attention_scaling == 1.0, f"rope_type {kind} scales attention"
    return inv_freq.float()


def moe_fields(hf_config: Any, shape: DecoderShape, expert_parallel_size: int = 1) -> dict[str, Any]:
    """TransformerConfig's MoE fields for an HF MoE config (none for a dense one).

    Qwen3-MoE's router takes softmax over all experts, then the top-k, renormalised when
    norm_topk_prob: the same weights as a softmax over the top-k logits (Megatron's default order),
    while without renormalisation they are Megatron's pre-softmax. No load-balancing loss (the
    GRPO loss is the whole objective; the HF backend adds none either) and no token dropping.

    Experts split over expert-parallel ranks need the all-to-all dispatcher (the allgather one
    gathers tokens within a tensor-parallel group only); it is a collective of the expert-parallel
    group in every MoE layer, forward and backward, so those ranks must make the same decoder calls
    (grpo.trainer.megatron.trainer keeps them in lockstep)."""
    if not shape.num_experts:
        return {}
    dispatcher = "alltoall" if expert_parallel_size > 1 else "allgather"
    return {
        "num_moe_experts": shape.num_experts,
        "moe_router_topk": int(hf_config.num_experts_per_tok),
        "moe_ffn_hidden_size": int(hf_config.moe_intermediate_size),
        "moe_router_pre_softmax": not bool(getattr(hf_config, "norm_topk_prob", False)),
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": dispatcher,
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": expert_parallel_size,
    }


def transformer_config(cfg: TrainerConfig, hf_config: Any, dtype: torch.dtype, device: torch.device) -> Any:
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = DecoderShape.from_hf_config(hf_config)
    mp = cfg.megatron
    recompute: dict[str, Any] = {}
    if mp.recompute == "full":
        recompute = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    elif mp.recompute == "selective":
        recompute = {"recompute_granularity": "selective"}
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=int(hf_config.hidden_size),
        ffn_hidden_size=int(hf_config.intermediate_size),
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        # Qwen2 always has q/k/v biases; Llama's attention_bias is refused by preflight (o_proj too).
        add_qkv_bias=hf_config.architectures[0] == "Qwen2ForCausalLM",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=mp.tensor_model_parallel_size,
        pipeline_model_parallel_size=mp.pipeline_model_parallel_size,
        sequence_parallel=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
        # Each rank's loss is divided by the whole step's loss tokens: DDP must sum, not average.
        calculate_per_token_loss=True,
        qk_layernorm=shape.qk_norm,
        **recompute,
        **moe_fields(hf_config, shape, mp.expert_model_parallel_size),
    )
    # Every micro-batch is one padded call of its own [pieces x longest piece] shape: pipeline stages
    # send each activation's shape before it. Set after construction: the constructor refuses it
    # beside the allgather MoE token dispatcher, whose gathers are shaped per call anyway.
    config.variable_seq_lengths = True
    return config


@dataclass
class MegatronModel:
    """One rank's GPTModel (its tensor-parallel slice of its pipeline stage) and how to fill it."""

    module: Any
    """The GPTModel (not yet wrapped in Megatron's DDP)."""
    shape: DecoderShape
    norms: NormNames
    ranks: ParallelRanks
    device: torch.device
    dtype: torch.dtype
    inv_freq: torch.Tensor
    """RoPE's inverse frequencies [head_dim / 2], float32 (rope_inv_freq)."""
    routing_replay: RoutingReplay | None = None
    """Set with routing_replay: micro-batches carrying routed_experts route through those experts."""

    @property
    def layer_offset(self) -> int:
        return self.ranks.pp_rank * (self.shape.num_layers // self.ranks.pp_size)

    @property
    def num_local_experts(self) -> int:
        return self.shape.num_experts // self.ranks.ep_size

    def global_name(self, local: str, ep_rank: int | None = None) -> str:
        """A local parameter name -> its whole-model Megatron name (global layer and expert numbers;
        `ep_rank`: the name of the same local expert on that expert-parallel rank)."""
        name = global_layer_name(local, self.layer_offset)
        rank = self.ranks.ep_rank if ep_rank is None else ep_rank
        return global_expert_name(name, rank, self.num_local_experts)

    def local_names(self) -> dict[str, str]:
        """Local parameter name -> whole-model Megatron name."""
        return {name: self.global_name(name) for name, _ in self.module.named_parameters()}

    def mark_tensor_parallel(self) -> None:
        """Tag each split parameter as megatron-core's initialisers do. With perform_initialization
        off (the checkpoint's weights are loaded instead) they never run, and without the tags the
        optimizer counts a split weight as a replica: the gradient norm would see rank 0's parts only."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for local, param in self.module.named_parameters():
            dim = split_dim(global_layer_name(local, self.layer_offset))
            if dim is not None and not getattr(param, "tensor_model_parallel", False):
                for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                    if hasattr(param, attribute):
                        delattr(param, attribute)
                set_tensor_model_parallel_attributes(param, True, dim, 1)

    def load_whole(self, whole: dict[str, torch.Tensor]) -> None:
        """Copy this rank's slice of a whole Megatron state dict into the parameters (its
        tensor-parallel part of its stage's layers, and of the MoE layers its own experts)."""
        import torch

        with torch.no_grad():
            for local, param in self.module.named_parameters():
                name = self.global_name(local)
                if name == "output_layer.weight" and self.is_tied_copy(param):
                    name = "embedding.word_embeddings.weight"
                source = tp_slice(name, whole[name], self.ranks.tp_rank, self.ranks.tp_size)
                if source.shape != param.shape:
                    raise ValueError(
                        f"{name}: checkpoint slice {tuple(source.shape)}, model {tuple(param.shape)}"
                    )
                param.copy_(source)

    def is_tied_copy(self, param: torch.Tensor) -> bool:
        """Whether `param` is the last pipeline stage's copy of the first stage's tied embedding
        (megatron-core keeps one per stage and sums their gradients over its embedding group)."""
        return self.shape.tied_embeddings and not self.ranks.is_first_stage and param is self.output_weight()

    def stage_output(self, forward: Forward, routing: torch.Tensor | None = None) -> torch.Tensor:
        """This pipeline stage's output [L, B, H] for one padded call. The first stage embeds the
        tokens; a later stage starts from the hidden states the pipeline schedule handed to the
        decoder (megatron-core's set_input_tensor); the last stage's are final-normed. `routing`:
        the micro-batch's routed experts [T, layers, k] to replay (routing_replay)."""
        from grpo.trainer.megatron.cpu_compat import on_cpu

        if self.routing_replay is not None:
            from grpo.trainer.routing import flat_routing

            num_slots = forward.input_ids.numel()
            flat = (
                None if routing is None else flat_routing(routing, forward.slots, forward.tokens, num_slots)
            )
            self.routing_replay.set_call(flat, batch_size=forward.input_ids.shape[0])
        gpt = self.module
        with on_cpu():
            embedded = None
            if self.ranks.is_first_stage:
                embedded = gpt.embedding(input_ids=forward.input_ids, position_ids=forward.position_ids)
            return gpt.decoder(
                hidden_states=embedded,  # [L, B, H]; ignored after the first stage
                attention_mask=~forward.attention_mask,  # Megatron masks where True
                rotary_pos_emb=self._rope(forward.position_ids),
            )

    def hidden_states(self, mb: MicroBatch, outputs: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Final (normed) hidden states [T, H] of a packed micro-batch, in token order (last
        pipeline stage): from the decoder's `outputs` [L, B, H] of each of mb.forwards, or, without
        pipeline stages, running them here."""
        import torch

        assert mb.forwards is not None, "the Megatron backend runs padded pieces with masks"
        if outputs is None:
            assert self.ranks.pp_size == 1, "with pipeline stages the schedule runs the forwards"
            outputs = [self.stage_output(forward, mb.routed_experts) for forward in mb.forwards]
        parts, tokens = [], []
        for forward, hidden in zip(mb.forwards, outputs, strict=True):
            flat = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
            parts.append(flat[forward.slots])
            tokens.append(forward.tokens)
        order = torch.cat(tokens)
        return torch.cat(parts)[torch.argsort(order)]

    def _rope(self, position_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] positions -> [L, B, 1, head_dim] rotary angles (Megatron's non-interleaved layout)."""
        import torch

        inv_freq = self.inv_freq.to(position_ids.device)  # [head_dim / 2]
        freqs = position_ids.t().float()[..., None] * inv_freq  # [L, B, head_dim / 2]
        return torch.cat([freqs, freqs], dim=-1)[:, :, None, :]

    def output_weight(self) -> torch.Tensor | None:
        """The embedding matrix when the output layer shares it, else None (the layer's own)."""
        if self.module.share_embeddings_and_output_weights:
            return self.module.shared_embedding_or_output_weight()
        return None


def read_hf_weights(model_path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise UserError(
            f"no *.safetensors weights in {model_path}; backend megatron loads safetensors checkpoints"
        )
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


def build_model(
    cfg: TrainerConfig, model_path: Path, ranks: ParallelRanks, device: torch.device, dtype: torch.dtype
) -> MegatronModel:
    """This rank's GPTModel with the checkpoint's weights."""
    from megatron.core.models.gpt import GPTModel
    from transformers import AutoConfig

    from grpo.trainer.megatron.cpu_compat import on_cpu
    from grpo.trainer.megatron.layer_spec import gpt_layer_spec, use_transformer_engine

    hf_config = AutoConfig.from_pretrained(model_path)
    shape = DecoderShape.from_hf_config(hf_config)
    config = transformer_config(cfg, hf_config, dtype, device)
    use_te = use_transformer_engine(device)
    spec = gpt_layer_spec(use_te, shape.num_experts, shape.qk_norm)
    if shape.num_experts:
        from grpo.trainer.megatron.moe import define_missing_te_gemm

        define_missing_te_gemm()
    with on_cpu():
        module = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=int(hf_config.vocab_size),
            max_sequence_length=int(hf_config.max_position_embeddings),
            pre_process=ranks.is_first_stage,
            post_process=ranks.is_last_stage,
            share_embeddings_and_output_weights=shape.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=int(_rope_theta(hf_config)),  # its rotary_pos_emb is unused: see _rope
        )
    # Every weight in the compute dtype, norms included (torch's RMSNorm keeps fp32 weights
    # otherwise, and a bf16 input with an fp32 weight misses its fused kernel), as Megatron's own
    # Float16Module does; the optimizer keeps the fp32 main weights.
    module.to(device=device, dtype=dtype)
    norms = (TE_SPEC_MOE_NORMS if shape.num_experts else TE_SPEC_NORMS) if use_te else LOCAL_SPEC_NORMS
    inv_freq = rope_inv_freq(hf_config, shape.head_dim)
    model = MegatronModel(module, shape, norms, ranks, device, dtype, inv_freq)
    if cfg.routing_replay:
        from grpo.trainer.megatron.moe import RoutingReplay

        if not shape.num_experts:
            raise UserError(
                f"routing_replay: {hf_config.model_type} has no mixture-of-experts layers; set routing_replay: false"
            )
        model.routing_replay = RoutingReplay.install(module, model.layer_offset, shape.num_layers)
    model.mark_tensor_parallel()
    model.load_whole(hf_to_megatron(read_hf_weights(model_path), shape, norms))
    return model
