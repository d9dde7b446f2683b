"""Gradient checkpointing of the HF decoder, per layer: `gradient_checkpointing` true / false / N
layers, or auto, decided for each group of micro-batches backpropagated together from its tokens
(grpo.trainer.activation_plan says how much each layer keeps)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.models.shape import ModelShape
from grpo.trainer.activation_plan import (
    activation_budget_bytes,
    checkpointing_choice,
    keeps_probabilities,
    num_recomputed_layers,
    tokens_without_recompute,
)
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    import torch
    from torch import nn

    from grpo.config.trainer import TrainerConfig

log = get_logger("trainer")


def device_memory_bytes(device: torch.device) -> int:
    """What auto plans against without activation_memory_gib: the GPU's memory, or the RAM available now."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().available)


class LayerCheckpointing:
    """Which decoder layers recompute their activations in backward: the first `num_layers`."""

    def __init__(
        self, causal_lm: nn.Module, cfg: TrainerConfig, shape: ModelShape, device: torch.device
    ) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.cfg, self.shape = cfg, shape
        self.auto = cfg.gradient_checkpointing == "auto"
        self.budget_bytes = activation_budget_bytes(cfg, device_memory_bytes(device))
        # Kept probabilities are memory beyond an explicit setting's activations: only against a
        # budget someone planned (auto's, or activation_memory_gib set by the user or the co-located
        # memory plan). The default half of the device is not one: co-located with
        # gradient_checkpointing false, the rest of the GPU is vLLM's.
        planned = self.auto or cfg.activation_memory_gib is not None
        self._probability_budget_bytes = self.budget_bytes if planned else 0
        self._causal_lm = causal_lm
        self._layers = [m for m in causal_lm.modules() if isinstance(m, GradientCheckpointingLayer)]
        self._enabled = False
        self.num_layers = 0
        if self.auto:
            log.info(
                "gradient checkpointing auto: off while a group of micro-batches holds at most %d tokens "
                "(%.2f GiB for activations), else the fewest layers that fit",
                tokens_without_recompute(shape, self.budget_bytes),
                self.budget_bytes / 2**30,
            )
        else:
            self.set_layers(num_recomputed_layers(cfg, shape.num_layers))

    def fit(self, num_tokens: int, num_loss_tokens: int = 0) -> int:
        """Under auto, the layers to recompute for `num_tokens` tokens alive at once, `num_loss_tokens`
        of them loss tokens (set, and returned); otherwise the fixed setting's."""
        if self.auto:
            choice = checkpointing_choice(
                self.cfg, self.shape, num_tokens, self.budget_bytes, num_loss_tokens
            )
            self.set_layers(choice.num_layers)
        return self.num_layers

    def keeps_probabilities(self, num_tokens: int, num_loss_tokens: int) -> bool:
        """Whether the group `fit` last sized keeps its loss tokens' probabilities for backward
        (grpo.trainer.activation_plan.keeps_probabilities): against auto's budget, or an explicit
        setting's activation_memory_gib; never against an explicit setting's default."""
        return keeps_probabilities(
            self.shape, num_tokens, num_loss_tokens, self.num_layers, self._probability_budget_bytes
        )

    def set_layers(self, num_layers: int) -> None:
        if num_layers > 0 and not self._enabled:
            self._causal_lm.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            self._enabled = True
        if not self._layers:  # a decoder without per-layer flags: all or nothing
            if self._enabled and num_layers == 0:
                self._causal_lm.gradient_checkpointing_disable()
                self._enabled = False
            self.num_layers = self.shape.num_layers if self._enabled else 0
            return
        for index, layer in enumerate(self._layers):
            layer.gradient_checkpointing = index < num_layers
        self.num_layers = min(num_layers, len(self._layers))
