"""What `backend: megatron` checks before anything starts: the extra installed, the launch, the
model's features and its split.

grpo-train runs these before it waits for the orchestrator, and `grpo` before vLLM starts, so a
run that could never train fails in one line at once rather than minutes later (the trainer runs
them again when it starts). Nothing here imports torch or megatron-core.

A model is supported when every tensor and every config field that changes its outputs is one
the HF -> Megatron mapping (grpo.trainer.megatron.convert) and GPTModel reproduce; anything else
is refused, naming the field, never trained on as a different model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.trainer.megatron.parallel import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, check_layout
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    from grpo.config.trainer import TrainerConfig


def megatron_installed() -> bool:
    return (
        importlib.util.find_spec("megatron") is not None
        and importlib.util.find_spec("megatron.core") is not None
    )


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE variants that change only the frequencies (grpo.trainer.megatron.model.rope_inv_freq);
yarn and longrope also scale attention, dynamic depends on the sequence length."""


def rope_type(hf_config: Any) -> str:
    """The RoPE variant (`default` = plain RoPE at rope_theta), from transformers 5's
    `rope_parameters` or an older config's `rope_scaling`."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    return str(params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default")


def sliding_window(hf_config: Any) -> int | None:
    """The attention window of the model's sliding-window layers (None: every layer attends to
    the whole sequence). Qwen2 names its layers' kinds in `layer_types` (sliding_window is set
    only with use_sliding_window); Mistral applies sliding_window to every layer."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def check_supported_model(hf_config: Any, sequence_len: int) -> None:
    """UserError (one line naming the model's field and the fix) unless backend megatron computes
    what the HF model computes."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    from grpo.models.moe import is_moe_config

    if is_moe_config(hf_config):
        check_supported_moe(hf_config, architectures)
    elif not architectures or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"backend megatron supports {sorted(SUPPORTED_ARCHITECTURES | MOE_ARCHITECTURES)}, the model is "
            f"{architectures or 'unknown'}; use backend: hf for it"
        )
    unsupported = "backend megatron does not support it; use backend: hf"
    kind = rope_type(hf_config)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UserError(
            f"the model's RoPE is rope_type {kind!r}; backend megatron supports {', '.join(SUPPORTED_ROPE_TYPES)}: "
            "use backend: hf"
        )
    activation = getattr(hf_config, "hidden_act", "silu")
    if activation != "silu":
        raise UserError(
            f"the model's hidden_act is {activation!r}; backend megatron supports silu (a gated SiLU MLP): "
            "use backend: hf"
        )
    # Qwen2's q/k/v biases map to linear_qkv's; Llama's attention_bias also puts one on o_proj.
    if architectures[0] != "Qwen2ForCausalLM" and getattr(hf_config, "attention_bias", False):
        raise UserError(f"the model's config sets attention_bias (q, k, v and o_proj biases); {unsupported}")
    if getattr(hf_config, "mlp_bias", False):
        raise UserError(f"the model's config sets mlp_bias (biases on the MLP projections); {unsupported}")
    window = sliding_window(hf_config)
    if window is not None and window < sequence_len:
        raise UserError(
            f"the model attends within a sliding window of {window} tokens (config sliding_window) and "
            f"backend megatron over whole sequences: set train sequence_len <= {window} (the window then "
            "never applies) or use backend: hf"
        )


def check_supported_moe(hf_config: Any, architectures: list[str]) -> None:
    """UserError unless the MoE model is one whose every decoder layer backend megatron builds:
    Qwen3-MoE with routed experts in every layer (no shared expert, no dense layers between)."""
    name = architectures[0] if architectures else "unknown"
    if name not in MOE_ARCHITECTURES:
        raise UserError(
            f"the model ({name}) has mixture-of-experts layers; backend megatron converts "
            f"{', '.join(sorted(MOE_ARCHITECTURES))} only: use backend: hf"
        )
    if (
        list(getattr(hf_config, "mlp_only_layers", None) or [])
        or int(getattr(hf_config, "decoder_sparse_step", 1)) != 1
    ):
        raise UserError(
            "the model mixes dense and mixture-of-experts layers (config mlp_only_layers / decoder_sparse_step); "
            "backend megatron builds MoE in every layer: use backend: hf"
        )


def check_megatron_start(cfg: TrainerConfig, model_path: Path, world_size: int) -> None:
    """Every check that needs no process group: the extra, the launch, the model, the layout."""
    from transformers import AutoConfig

    if not megatron_installed():
        raise UserError(
            "backend megatron needs megatron-core, which is not installed: pip install 'grpo-rl[megatron]' "
            "(or use backend: hf)"
        )
    if cfg.gpus > 1 and world_size == 1:
        raise UserError(
            f"train gpus is {cfg.gpus} but this trainer is a single process; launch it with "
            f"torchrun --nproc_per_node {cfg.gpus} $(which grpo-train) train.yaml (or set gpus: 1)"
        )
    if world_size > 1 and world_size != cfg.gpus:
        # The sizes are checked against gpus at load; the ranks that run must be the ones checked.
        raise UserError(
            f"train gpus is {cfg.gpus} but {world_size} trainer processes were launched; set gpus: {world_size} "
            f"(or launch torchrun --nproc_per_node {cfg.gpus})"
        )
    hf_config = AutoConfig.from_pretrained(model_path)
    check_supported_model(hf_config, cfg.sequence_len)
    check_layout(cfg.megatron, hf_config, world_size)
