"""vLLM's fused/wrapped parameter names map onto HF names as views, in the right order."""

from __future__ import annotations

import pytest
import torch

from grpo.inference.name_map import borrowable_linear_weights, hf_name, split_to_hf
from grpo.models.shape import ModelShape

SHAPE = ModelShape(
    hidden_size=8, intermediate_size=12, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
    vocab_size=32, tied_embeddings=True,
)  # fmt: skip


def _shares_storage(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_qkv_splits_into_q_k_v_views_in_order() -> None:
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    fused = torch.cat([q, k, v])
    parts = dict(split_to_hf("model.layers.0.self_attn.qkv_proj.weight", fused, SHAPE))
    assert list(parts) == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    for got, expected in zip(parts.values(), (q, k, v), strict=True):
        assert torch.equal(got, expected) and _shares_storage(got, fused)


def test_gate_up_splits_gate_first() -> None:
    gate, up = torch.randn(12, 8), torch.randn(12, 8)
    fused = torch.cat([gate, up])
    parts = dict(split_to_hf("model.layers.0.mlp.gate_up_proj.base_layer.weight", fused, SHAPE))
    assert torch.equal(parts["model.layers.0.mlp.gate_proj.weight"], gate)
    assert torch.equal(parts["model.layers.0.mlp.up_proj.weight"], up)
    assert all(_shares_storage(p, fused) for p in parts.values())


def test_lora_wrapper_is_dropped_from_names() -> None:
    assert (
        hf_name("model.layers.3.self_attn.o_proj.base_layer.weight")
        == "model.layers.3.self_attn.o_proj.weight"
    )


def test_fused_weight_with_unexpected_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="rows"):
        split_to_hf("model.layers.0.self_attn.qkv_proj.weight", torch.randn(15, 8), SHAPE)


def test_only_decoder_linear_weights_are_borrowed() -> None:
    engine = {
        "model.embed_tokens.weight": torch.randn(32, 8),
        "model.layers.0.input_layernorm.weight": torch.randn(8),
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(16, 8),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8),
        "model.layers.0.mlp.gate_up_proj.weight": torch.randn(24, 8),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 12),
        "lm_head.weight": torch.randn(32, 8),
    }
    borrowed = borrowable_linear_weights(engine, SHAPE)
    assert sorted(n.split(".")[-2] for n in borrowed) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


def test_a_vision_towers_layers_are_not_borrowed_only_the_language_models() -> None:
    fused = torch.randn(16, 8)
    engine = {
        "model.text_model.layers.0.self_attn.qkv_proj.weight": fused,
        # vLLM's Idefics3 vision encoder: its own fused q/k/v (another width) under .layers.
        "model.vision_model.encoder.layers.0.self_attn.qkv_proj.weight": torch.randn(24, 6),
        "visual.blocks.0.attn.qkv.weight": torch.randn(24, 6),
    }
    assert sorted(borrowable_linear_weights(engine, SHAPE)) == [
        f"model.text_model.layers.0.self_attn.{p}_proj.weight" for p in "kqv"
    ]
