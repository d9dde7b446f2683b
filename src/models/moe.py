"""Mixture-of-experts shape facts read from an HF config alone (before any weights load): the memory
plan, the FLOP counter and `--dry-run` count all experts' parameters as held and the top-k as active."""

from __future__ import annotations

from typing import Any


def parameter_counts(config: Any) -> tuple[int, int] | None:
    """(routed experts' weights, of which active per token) from an HF config, or None for a dense
    model. Each routed expert is a gated MLP of 3 * hidden * expert_intermediate weights (biases,
    gpt-oss's, left out); shared experts and dense layers count as dense parameters elsewhere."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if not num_experts or not top_k:
        return None
    intermediate = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    num_layers = text.num_hidden_layers
    dense = set(getattr(text, "mlp_only_layers", None) or [])
    step = getattr(text, "decoder_sparse_step", 1) or 1
    num_moe_layers = sum(1 for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    per_expert = 3 * text.hidden_size * intermediate
    return num_moe_layers * num_experts * per_expert, num_moe_layers * top_k * per_expert
