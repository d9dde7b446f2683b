"""Build the policy: an HF causal LM, with LoRA (peft), QLoRA NF4 (bitsandbytes) or FP8, or full training.

Precision: base weights in bf16 where the hardware runs bf16 matmuls natively (CUDA with bf16,
or a CPU with AVX512-BF16/AMX that oneDNN uses), else fp32. Trainable parameters are always fp32
(bf16 Adam updates would round away), and the trainer's bf16 forward (`Policy.hidden_states`)
runs under autocast: the small fp32 weights are cast to bf16 for each matmul and activations stay
bf16. There peft's own casting of every LoRA layer's input to fp32 is turned off, because it copies
each activation to fp32 and back (about a fifth of a CPU step) where autocast casts only the r x d
adapter matrices. One code path for CPU and CUDA. A 16-bit LoRA base also rounds its residual
stream where vLLM does (grpo.trainer.hf.vllm_numerics), which lowers the train/rollout mismatch.

qlora_fp8 (and FP8 weights borrowed from the engine) keep the decoder linears as FP8 codes +
128x128 block scales and dequantize them per matmul (grpo.trainer.hf.quantized_base): weight-only,
so it needs no FP8-capable GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from grpo.trainer.device import check_precision_support, choose_dtype, resolve_device
from grpo.trainer.hf.attention import (
    attention_implementation_for,
    attention_layout,
    check_attention,
    decoder_attention_mask,
)
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.flops import StepFlopCounter
    from grpo.trainer.hf.checkpointing import LayerCheckpointing
    from grpo.trainer.hf.load_balancing import LoadBalancingLoss
    from grpo.trainer.hf.moe import RoutingReplay
    from grpo.trainer.packing import MicroBatch
    from grpo.trainer.quantized_weights import FP8BlockWeight, NF4Weight
    from grpo.trainer.vision_inputs import VisionTokens
    from grpo.trainer.weights import BaseWeightSource

log = get_logger("trainer")


@dataclass
class Policy:
    model: nn.Module
    """What is trained and saved: a PeftModel (LoRA) or the causal LM itself (full)."""
    causal_lm: nn.Module
    """The HF causal LM inside `model` (LoRA layers are injected into it in place)."""
    device: torch.device
    dtype: torch.dtype
    """Base weight dtype."""
    autocast_dtype: torch.dtype | None
    """Set when the forward computes in bf16/fp16 with fp32 trainable weights (LoRA or full)."""
    is_lora: bool
    routing_replay: RoutingReplay | None = None
    """Set with routing_replay: micro-batches carrying routed_experts route through those experts."""
    load_balancing: LoadBalancingLoss | None = None
    """Set with router_aux_loss_coef > 0: captures the routers' outputs for their load-balancing loss."""
    checkpointing: LayerCheckpointing | None = None
    """Which decoder layers recompute in backward (set per accumulation group under auto)."""
    vision: VisionTokens | None = None
    """Image token and merge size of a vision-language model (grpo.trainer.hf.vision); None for text."""

    @property
    def lm_head(self) -> nn.Module:
        """Hidden states -> the logits the model samples from (soft-capped where the model caps them)."""
        from grpo.trainer.hf.families import output_layer

        return output_layer(self.causal_lm)

    @property
    def uses_varlen_attention(self) -> bool:
        return str(getattr(self.causal_lm.config, "_attn_implementation", "")).startswith("flash")

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def hidden_states(self, batch: MicroBatch) -> torch.Tensor:
        """Final (normed) hidden states [T, H] of a packed micro-batch."""
        import torch

        precision = contextlib.ExitStack()
        if self.autocast_dtype is not None:
            precision.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
            if self.is_lora:
                from peft.helpers import disable_input_dtype_casting

                precision.enter_context(disable_input_dtype_casting(self.model))
        decoder = self.causal_lm.get_decoder()
        routing = batch.routed_experts if self.routing_replay is not None else None
        with precision:
            if batch.vision is not None:
                from grpo.trainer.hf.vision import vision_hidden_states

                layout = attention_layout(self.causal_lm)
                assert self.vision is not None
                return vision_hidden_states(
                    self.causal_lm, batch, self.vision, layout, self.autocast_dtype or self.dtype
                )
            if batch.forwards is None:
                replay = {} if routing is None else {"routed_experts": routing}
                out = decoder(
                    input_ids=batch.input_ids[None],
                    position_ids=batch.position_ids[None],
                    use_cache=False,
                    **replay,
                )
                return out.last_hidden_state[0]
            if self.uses_varlen_attention:
                raise UserError(
                    "shared-prefix rows need attention that takes a mask (flex_attention, sdpa or eager), but the "
                    "trainer's model uses flash attention; set shared_prefix: false in orch.yaml"
                )
            layout = attention_layout(self.causal_lm)
            mask_dtype = self.autocast_dtype or self.dtype
            parts, tokens = [], []
            replay = {}
            for forward in batch.forwards:
                if routing is not None:
                    from grpo.trainer.routing import flat_routing

                    replay = {
                        "routed_experts": flat_routing(
                            routing, forward.slots, forward.tokens, forward.input_ids.numel()
                        )
                    }
                out = decoder(
                    input_ids=forward.input_ids,
                    position_ids=forward.position_ids,
                    attention_mask=decoder_attention_mask(
                        layout, forward.attention_mask, forward.position_ids, mask_dtype
                    ),
                    use_cache=False,
                    **replay,
                ).last_hidden_state  # [B, L, H]
                parts.append(out.reshape(-1, out.shape[-1])[forward.slots])
                tokens.append(forward.tokens)
        # Back to micro-batch order: position k of the concatenation holds token order[k].
        order = torch.cat(tokens)
        hidden = torch.cat(parts)
        return hidden[torch.argsort(order)]

    def token_logprobs(self, batch: MicroBatch, chunk_size: int | None) -> np.ndarray:
        """Logprobs [num_tokens] (float32) of every token of a micro-batch under this policy, without
        gradients, aligned like inference_logprobs (grpo.trainer.logprobs.every_token_logprobs)."""
        import torch

        from grpo.trainer.logprobs import every_token_logprobs

        with torch.no_grad():
            hidden = self.hidden_states(batch)
            logprobs = every_token_logprobs(
                hidden, self.lm_head, batch.input_ids, batch.parent_ids, batch.temperatures, chunk_size
            )
        return logprobs.float().cpu().numpy()

    def attention_pair_weight(self) -> float:
        """What one attended pair costs in tokens, for cutting wide prefix trees at their trunks
        (grpo.trainer.tree_split). Measured on CPU only: 0 (never cut) on other devices."""
        if self.device.type != "cpu":
            return 0.0
        from grpo.trainer.flops import flop_shape
        from grpo.trainer.tree_split import pair_weight_for

        shape = flop_shape(self.causal_lm.config)
        return pair_weight_for(
            shape.num_decoder_linear_params, shape.num_layers, shape.attention_width, not self.is_lora
        )

    def flop_counter(self) -> StepFlopCounter:
        """The model FLOPs of a step's tokens (grpo.trainer.flops), for the mfu metric: LoRA counts
        no base-weight gradients."""
        from grpo.trainer.flops import StepFlopCounter, flop_shape

        num_lora = sum(p.numel() for p in self.trainable_parameters()) if self.is_lora else 0
        return StepFlopCounter(
            flop_shape(self.causal_lm.config),
            trains_base=not self.is_lora,
            trains_output_layer=not self.is_lora,
            num_lora_params=num_lora,
            device=self.device,
            dtype=self.autocast_dtype or self.dtype,
        )


def _borrowed_dtype(borrowed: Mapping[str, torch.Tensor]) -> torch.dtype:
    """Borrowed base weights are used as they are, so the trainer computes in the engine's dtype."""
    import torch

    dtypes = {t.dtype for t in borrowed.values()}
    if len(dtypes) != 1 or not dtypes <= {torch.bfloat16, torch.float16, torch.float32}:
        raise ValueError(
            f"borrowed base weights have dtypes {sorted(map(str, dtypes))}; the trainer's dtype must be one of "
            "bfloat16, float16 or float32, the same for every weight"
        )
    return dtypes.pop()


def _check_borrowed_device(
    borrowed: Mapping[str, torch.Tensor],
    borrowed_quantized: Mapping[str, FP8BlockWeight | NF4Weight],
    device: torch.device,
) -> None:
    """A borrowed weight on another device would be copied by `.to(device)`: the base model twice in
    memory, and the trainer no longer reading the engine's tensors."""
    lent = [*borrowed.values(), *borrowed_quantized.values()]
    elsewhere = sorted({str(w.device) for w in lent if w.device.type != device.type})
    if elsewhere:
        raise UserError(
            f"the engine lends its base weights on {', '.join(elsewhere)} but the trainer computes on "
            f"{device.type}; co-located, run both on one device (trainer device: auto picks CUDA whenever "
            "it is visible, so run vLLM on the GPU too, or set the trainer's device: cpu)"
        )


def _lora_targets(cfg: TrainerConfig, causal_lm: nn.Module) -> str | list[str]:
    from grpo.config.trainer import DEFAULT_LORA_TARGETS, MOE_DEFAULT_LORA_TARGETS
    from grpo.trainer.hf.moe import is_moe

    targets = cfg.lora_target_modules
    if targets == DEFAULT_LORA_TARGETS and is_moe(causal_lm):
        # Experts are fused 3-D parameters, not linears: the default adapts attention only.
        return list(MOE_DEFAULT_LORA_TARGETS)
    if "all-linear" in targets:
        if len(targets) > 1:
            raise UserError('lora_target_modules: "all-linear" cannot be combined with module names')
        return "all-linear"
    return list(targets)


def _vision_tokens(cfg: TrainerConfig, config: object) -> VisionTokens | None:
    """The vision-language model's image inputs (None for a text model); UserError for what the
    trainer cannot do with one yet."""
    from grpo.trainer.hf.vision import is_vision_language, vision_tokens_for

    if not is_vision_language(config):
        if cfg.train_vision_tower:
            raise UserError("train_vision_tower is set but the model has no vision tower; remove it")
        return None
    vision = vision_tokens_for(config)
    if cfg.qlora_bnb or cfg.qlora_fp8 or cfg.qlora_fp4:
        raise UserError("quantized base weights (qlora_*) are not supported for vision-language models yet")
    if cfg.lora and cfg.train_vision_tower:
        raise UserError(
            "train_vision_tower needs lora: false: LoRA adapts the language model only (vLLM applies "
            "adapters there), so the vision tower can train only in full"
        )
    return vision


def build_policy(cfg: TrainerConfig, source: BaseWeightSource) -> Policy:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from grpo.trainer.hf.families import check_borrowed_names, check_lora_targets
    from grpo.trainer.weights import install_borrowed

    device = resolve_device(cfg)
    check_precision_support(cfg, device)
    borrowed = source.borrowed_tensors()
    borrowed_quantized = source.borrowed_quantized()
    dtype = _borrowed_dtype(borrowed) if borrowed else choose_dtype(device)
    if (borrowed or borrowed_quantized) and not cfg.lora:
        raise UserError(
            "borrowed base weights are frozen; full-parameter training (lora: false) cannot use them"
        )
    if (borrowed or borrowed_quantized) and (cfg.qlora_bnb or cfg.qlora_fp8):
        raise UserError(
            "qlora_bnb / qlora_fp8 quantize the base from disk, but this run borrows the engine's base weights; "
            "turn the trainer's quantization off (the borrowed weights are used as the engine holds them)"
        )
    _check_borrowed_device(borrowed, borrowed_quantized, device)
    if borrowed_quantized and cfg.recipe == "fp8_hybrid":
        raise UserError(
            "recipe fp8_hybrid casts the base's 16-bit weights to FP8 for each matmul, but the engine lends "
            "quantized ones; serve the model unquantized (infer quantization: null) or set recipe: bf16"
        )

    # Full training keeps fp32 weights (bf16 Adam updates would round away); compute is autocast.
    load_dtype = dtype if cfg.lora else torch.float32
    kwargs: dict[str, object] = {"dtype": load_dtype}
    config = AutoConfig.from_pretrained(source.model_path)
    # Co-located, the language model's linears are borrowed; the vision tower is loaded from disk.
    vision = _vision_tokens(cfg, config)
    if (attn_implementation := attention_implementation_for(config, cfg.attention, device.type)) is not None:
        kwargs["attn_implementation"] = attn_implementation
    if cfg.qlora_bnb:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=False,
        )
        kwargs["device_map"] = {"": device}
    if vision is not None:
        from transformers import AutoModelForImageTextToText

        causal_lm = AutoModelForImageTextToText.from_pretrained(source.model_path, config=config, **kwargs)
    else:
        causal_lm = AutoModelForCausalLM.from_pretrained(source.model_path, config=config, **kwargs)
    check_attention(causal_lm)
    check_borrowed_names(causal_lm, [*borrowed, *borrowed_quantized])
    if cfg.qlora_fp8:
        from grpo.trainer.hf.quantized_base import quantize_base_linears_fp8

        # On CPU before `.to(device)`: the GPU never holds the dense linears.
        num_quantized = quantize_base_linears_fp8(causal_lm, compute_dtype=dtype)
        log.info(
            "qlora_fp8: %d base linears stored as float8_e4m3fn with 128x128 block scales, dequantized to %s "
            "for each matmul (weight-only: no FP8 matmuls, so no SM89+ GPU is needed)",
            num_quantized,
            dtype,
        )
    if borrowed_quantized:
        from grpo.trainer.hf.quantized_base import replace_linears

        replace_linears(causal_lm, dict(borrowed_quantized), compute_dtype=dtype)
    if borrowed:
        install_borrowed(causal_lm, borrowed)
        if getattr(causal_lm.config, "tie_word_embeddings", False):
            causal_lm.get_output_embeddings().weight = causal_lm.get_input_embeddings().weight
    if not cfg.qlora_bnb:
        causal_lm.to(device)  # no-op (same tensors) for borrowed weights already on `device`
    if cfg.recipe == "fp8_hybrid":
        from grpo.trainer.hf.fp8_training import convert_to_fp8_hybrid

        num_fp8 = convert_to_fp8_hybrid(causal_lm)
        log.info(
            "recipe fp8_hybrid: %d decoder linears multiply in FP8 (E4M3 forward, E5M2 gradients)", num_fp8
        )
    from grpo.models.shape import ModelShape
    from grpo.trainer.hf.checkpointing import LayerCheckpointing

    # Activations are in the compute dtype: the weights' for LoRA, autocast's for full training.
    shape = replace(ModelShape.from_folder(source.model_path), activation_value_bytes=dtype.itemsize)
    checkpointing = LayerCheckpointing(causal_lm, cfg, shape, device)
    causal_lm.config.use_cache = False

    if vision is not None and not cfg.lora and not cfg.train_vision_tower:
        from grpo.trainer.hf.vision import freeze_vision_tower

        freeze_vision_tower(causal_lm)
    model: nn.Module = causal_lm
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        from grpo.trainer.hf.vision import VISION_TOWER_PATTERN

        targets = _lora_targets(cfg, causal_lm)
        if targets != "all-linear":
            check_lora_targets(causal_lm, targets)
        lora_cfg = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=targets,
            exclude_modules=VISION_TOWER_PATTERN if vision is not None else None,
            task_type="CAUSAL_LM",
        )
        torch.manual_seed(cfg.seed)  # LoRA A init
        model = get_peft_model(causal_lm, lora_cfg, autocast_adapter_dtype=True)
        from grpo.trainer.hf.lora_fused import fuse_lora_linears

        fuse_lora_linears(model)
    model.train()
    if cfg.lora:
        from grpo.trainer.hf.vllm_numerics import follow_vllm_rounding

        # 16-bit base: round where vLLM's engine does (lowers the step-0 mismatch KL).
        follow_vllm_rounding(causal_lm, engine_compiled=source.engine_compiled)
    autocast_dtype = dtype if dtype != torch.float32 else None
    routing_replay = None
    if cfg.routing_replay:
        from grpo.trainer.hf.moe import RoutingReplay

        routing_replay = RoutingReplay.install(causal_lm)
    load_balancing = None
    if cfg.router_aux_loss_coef > 0:
        from grpo.trainer.hf.load_balancing import LoadBalancingLoss

        # After routing replay's hooks, so that it sees the replayed experts.
        load_balancing = LoadBalancingLoss.install(causal_lm)
    policy = Policy(
        model=model,
        causal_lm=causal_lm,
        device=device,
        dtype=dtype,
        autocast_dtype=autocast_dtype,
        is_lora=cfg.lora,
        routing_replay=routing_replay,
        load_balancing=load_balancing,
        checkpointing=checkpointing,
        vision=vision,
    )
    num_trainable = sum(p.numel() for p in policy.trainable_parameters())
    log.info(
        "policy %s on %s, base %s%s, %d trainable parameters%s",
        source.model_path.name,
        device,
        dtype,
        " NF4" if cfg.qlora_bnb else " FP8 (weight-only)" if cfg.qlora_fp8 else "",
        num_trainable,
        f", {len(borrowed) + len(borrowed_quantized)} borrowed base tensors "
        f"({len(borrowed_quantized)} dequantized per matmul)"
        if borrowed or borrowed_quantized
        else "",
    )
    return policy
