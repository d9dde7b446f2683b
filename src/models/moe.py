"""Mixture-of-experts shape facts read from an HF config alone (before any weights load): what the FLOP
counter counts as active, what `--dry-run` reports, and what backend megatron and co-located mode
refuse.

Every MoE family here (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss) makes each routed expert a gated
MLP of 3 x hidden x expert_intermediate weights (gpt-oss's biases left out). Qwen2-MoE adds a
shared expert (always active) and may keep dense layers (`mlp_only_layers`, `decoder_sparse_step`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any


@dataclass(frozen=True)
class MlpWeights:
    """The MLP weights of every decoder layer of a model, all of them and those a token uses."""

    total: int
    active: int
    num_experts: int
    """Routed experts per MoE layer (0: a dense model)."""
    top_k: int

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _text(config: Any) -> Any:
    if hasattr(config, "get_text_config"):
        return config.get_text_config()
    return getattr(config, "text_config", None) or config


def mlp_weights(config: Any) -> MlpWeights:
    """From an HF config object (or anything with its attributes)."""
    text = _text(config)
    hidden, num_layers = int(text.hidden_size), int(text.num_hidden_layers)
    dense_per_layer = 3 * hidden * int(text.intermediate_size)
    num_experts = int(getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 0)
    top_k = int(getattr(text, "num_experts_per_tok", None) or 0)
    if not num_experts or not top_k:
        total = num_layers * dense_per_layer
        return MlpWeights(total=total, active=total, num_experts=0, top_k=0)
    per_expert = 3 * hidden * int(getattr(text, "moe_intermediate_size", None) or text.intermediate_size)
    shared = 3 * hidden * int(getattr(text, "shared_expert_intermediate_size", None) or 0)
    dense_layers = set(getattr(text, "mlp_only_layers", None) or [])
    step = int(getattr(text, "decoder_sparse_step", None) or 1)
    num_moe = sum(1 for i in range(num_layers) if i not in dense_layers and (i + 1) % step == 0)
    dense = (num_layers - num_moe) * dense_per_layer
    return MlpWeights(
        total=dense + num_moe * (num_experts * per_expert + shared),
        active=dense + num_moe * (top_k * per_expert + shared),
        num_experts=num_experts,
        top_k=top_k,
    )


def is_moe_config(config: Any) -> bool:
    text = _text(config)
    num_experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    return bool(num_experts and getattr(text, "num_experts_per_tok", None))


def describe_moe(model_path: str | Path) -> str | None:
    """ "mixture of experts: ..." with the MLP weights held and used per token, from config.json; None
    for a dense model."""
    raw = json.loads((Path(model_path) / "config.json").read_text())
    raw = raw.get("text_config", raw)
    weights = mlp_weights(SimpleNamespace(**{"intermediate_size": 0, **raw}))
    if not weights.is_moe:
        return None
    return (
        f"mixture of experts: {weights.num_experts} experts, top-{weights.top_k}; MLP weights "
        f"{weights.total / 1e6:.3g}M total, {weights.active / 1e6:.3g}M active per token"
    )
