"""Mixture-of-experts facts from a config alone: the experts held and those a token uses."""

from __future__ import annotations

import pytest

from grpo.models.moe import describe_moe, is_moe_config, mlp_weights, parameter_counts


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
    params = parameter_counts(config)
    assert describe_moe(tmp_path) == (
        f"mixture of experts: 8 experts, top-2; parameters {params.total / 1e6:.3g}M total, "
        f"{params.active / 1e6:.3g}M active per token (MLP weights {weights.total / 1e6:.3g}M total, "
        f"{weights.active / 1e6:.3g}M active)"
    )


def test_a_dense_model_has_no_moe_description(tiny_model_path):
    assert describe_moe(tiny_model_path) is None


def _moe_config(family: str):
    import transformers as tf

    common = {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts_per_tok": 2,
    }  # fmt: skip
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=8, tie_word_embeddings=False)
    return tf.MixtralConfig(**common, num_local_experts=4, tie_word_embeddings=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_moe_models_parameters_are_every_weight_it_holds_and_active_leaves_out_the_skipped_experts(family):
    import torch
    from transformers import AutoModelForCausalLM

    config = _moe_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    held = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)
    counts = parameter_counts(config)
    weights = mlp_weights(config)
    assert counts.total == held
    per_expert = weights.total // (config.num_hidden_layers * weights.num_experts)
    skipped = config.num_hidden_layers * (weights.num_experts - weights.top_k) * per_expert
    assert counts.active == held - skipped


def test_a_dense_models_active_parameters_are_all_of_them(tiny_model_path):
    from transformers import AutoConfig

    counts = parameter_counts(AutoConfig.from_pretrained(tiny_model_path))
    assert counts.active == counts.total > 0
