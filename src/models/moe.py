"""Mixture-of-experts shape facts read from an HF config alone (before any weights load): what the FLOP
counter counts as active, what `--dry-run` reports (parameters total and active per token), what
the memory plan holds (every expert: grpo.models.shape), and what co-located mode refuses and
backend megatron tells apart (grpo.trainer.megatron.preflight).

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
    router: int = 0
    """Router weights of every MoE layer (num_experts x hidden each), used by every token; not in
    total or active."""

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
    num_moe = len(moe_layer_indices(config))
    dense = (num_layers - num_moe) * dense_per_layer
    return MlpWeights(
        total=dense + num_moe * (num_experts * per_expert + shared),
        active=dense + num_moe * (top_k * per_expert + shared),
        num_experts=num_experts,
        top_k=top_k,
        router=num_moe * num_experts * hidden,
    )


def moe_layer_indices(config: Any) -> list[int]:
    """The decoder layers with routed experts (all of them unless the family keeps some dense:
    Qwen2/3-MoE's `mlp_only_layers` and `decoder_sparse_step`); [] for a dense model."""
    text = _text(config)
    if not is_moe_config(config):
        return []
    dense_layers = set(getattr(text, "mlp_only_layers", None) or [])
    step = int(getattr(text, "decoder_sparse_step", None) or 1)
    return [i for i in range(int(text.num_hidden_layers)) if i not in dense_layers and (i + 1) % step == 0]


@dataclass(frozen=True)
class ParameterCounts:
    """Weights of a whole model (embeddings, lm_head, attention, MLPs, routers; norms and biases
    left out): all it holds, and those one token uses."""

    total: int
    active: int


def parameter_counts(config: Any) -> ParameterCounts:
    """From an HF config object (or anything with its attributes); a dense model's active equals total."""
    text = _text(config)
    hidden, num_layers = int(text.hidden_size), int(text.num_hidden_layers)
    num_heads = int(text.num_attention_heads)
    num_kv_heads = int(getattr(text, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // num_heads)
    attention = num_layers * hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)  # q, o; k, v
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
    embeddings = (1 if tied else 2) * int(text.vocab_size) * hidden
    mlp = mlp_weights(config)
    shared = embeddings + attention + mlp.router
    return ParameterCounts(total=shared + mlp.total, active=shared + mlp.active)


def is_moe_config(config: Any) -> bool:
    text = _text(config)
    num_experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    return bool(num_experts and getattr(text, "num_experts_per_tok", None))


def describe_moe(model_path: str | Path) -> str | None:
    """ "mixture of experts: ..." with the parameters (and MLP weights) held and used per token, from
    config.json; None for a dense model."""
    config = config_namespace(model_path)
    weights = mlp_weights(config)
    if not weights.is_moe:
        return None
    params = parameter_counts(config)
    return (
        f"mixture of experts: {weights.num_experts} experts, top-{weights.top_k}; parameters "
        f"{params.total / 1e6:.3g}M total, {params.active / 1e6:.3g}M active per token (MLP weights "
        f"{weights.total / 1e6:.3g}M total, {weights.active / 1e6:.3g}M active)"
    )


def config_namespace(model_path: str | Path) -> SimpleNamespace:
    """The (text) config.json of the model in `model_path` as attributes, read without transformers."""
    raw = json.loads((Path(model_path) / "config.json").read_text())
    text = raw.get("text_config", raw)
    return SimpleNamespace(
        **{"intermediate_size": 0, "tie_word_embeddings": raw.get("tie_word_embeddings"), **text}
    )
