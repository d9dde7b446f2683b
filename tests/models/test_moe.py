"""Mixture-of-experts facts from a config alone: the experts held and those a token uses."""

from __future__ import annotations

from grpo.models.moe import describe_moe, is_moe_config, mlp_weights


def test_a_moe_config_counts_all_experts_as_held_and_top_k_as_active(tmp_path):
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=[0],
    )  # fmt: skip
    per_expert, shared, dense = 3 * 64 * 32, 3 * 64 * 48, 3 * 64 * 128
    weights = mlp_weights(config)
    assert weights.total == dense + 2 * (8 * per_expert + shared)
    assert weights.active == dense + 2 * (2 * per_expert + shared)
    assert is_moe_config(config)
    config.save_pretrained(tmp_path)
    assert describe_moe(tmp_path) == (
        f"mixture of experts: 8 experts, top-2; MLP weights {weights.total / 1e6:.3g}M total, "
        f"{weights.active / 1e6:.3g}M active per token"
    )


def test_a_dense_model_has_no_moe_description(tiny_model_path):
    assert describe_moe(tiny_model_path) is None
