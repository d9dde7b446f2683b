"""Gradient checkpointing of the HF decoder, per layer: `gradient_checkpointing` true / false / N
layers, or auto, resolved here when no memory plan did it first (grpo-train alone: against this
device's memory; grpo.trainer.activation_plan says how)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.models.shape import ModelShape
from grpo.trainer.activation_plan import alive_tokens, checkpointing_choice, num_recomputed_layers
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    import torch
    from torch import nn

    from grpo.config.trainer import TrainerConfig

log = get_logger("trainer")


def device_memory_bytes(device: torch.device) -> int:
    """What the trainer plans its activations against: the GPU's memory, or the RAM available now."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().available)


def recomputed_layer_count(cfg: TrainerConfig, shape: ModelShape, device: torch.device) -> int:
    """Decoder layers to recompute: the setting's, or auto's choice for this device's memory."""
    if cfg.gradient_checkpointing != "auto":
        return num_recomputed_layers(cfg, shape.num_layers)
    alive = alive_tokens(cfg, cfg.micro_batch_token_budget, None)
    choice = checkpointing_choice(cfg, shape, alive, device_memory_bytes(device))
    log.info("%s", choice.describe(shape.num_layers))
    return choice.num_layers


def enable_checkpointing(causal_lm: nn.Module, num_layers: int) -> None:
    """Recompute the first `num_layers` decoder layers in backward (none: nothing changes)."""
    if num_layers <= 0:
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in causal_lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        log.warning("this model's decoder layers cannot be checkpointed one by one: every layer recomputes")
        return
    for layer in layers[num_layers:]:
        layer.gradient_checkpointing = False
