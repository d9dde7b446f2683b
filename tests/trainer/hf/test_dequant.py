"""NF4 and FP8 dequantization against bitsandbytes and a reference, and the dequantizing linear."""

from __future__ import annotations

import pytest
import torch

from grpo.trainer.hf.dequant import DequantBuffers, dequant_linear, dequantize_fp8_block, dequantize_nf4
from grpo.trainer.quantized_weights import FP8BlockWeight, NF4Weight

bnb_functional = pytest.importorskip("bitsandbytes.functional")


def _nf4(weight: torch.Tensor, double_quant: bool) -> tuple[NF4Weight, torch.Tensor]:
    packed, state = bnb_functional.quantize_4bit(
        weight, blocksize=64, quant_type="nf4", compress_statistics=double_quant
    )
    expected = bnb_functional.dequantize_4bit(packed, state)
    nested = state.state2 if double_quant else None
    ours = NF4Weight(
        packed=packed,
        absmax=state.absmax,
        code=state.code,
        blocksize=state.blocksize,
        shape=tuple(weight.shape),
        nested_absmax=nested.absmax if nested else None,
        nested_code=nested.code if nested else None,
        nested_blocksize=nested.blocksize if nested else 256,
        offset=float(state.offset) if double_quant else 0.0,
    )
    return ours, expected


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_dequantization_matches_bitsandbytes(double_quant: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(192, 256, dtype=torch.bfloat16)
    ours, expected = _nf4(weight, double_quant)
    torch.testing.assert_close(dequantize_nf4(ours), expected.to(torch.bfloat16), rtol=0, atol=1e-2)


def test_fp8_block_dequantization_matches_a_reference() -> None:
    torch.manual_seed(0)
    weight = torch.randn(256, 384)
    block = 128
    tiles = weight.reshape(2, block, 3, block)
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0
    quantized = (tiles / scale[:, None, :, None]).reshape(256, 384).to(torch.float8_e4m3fn)
    reference = (quantized.float().reshape(2, block, 3, block) * scale[:, None, :, None]).reshape(256, 384)
    got = dequantize_fp8_block(FP8BlockWeight(quantized, scale, block), dtype=torch.float32)
    torch.testing.assert_close(got, reference)
    assert (got - weight).abs().max() < 0.1 * weight.abs().max()


def test_dequant_linear_gives_the_dense_forward_and_input_gradient() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    ours, dense = _nf4(weight, double_quant=True)
    x = torch.randn(5, 128, dtype=torch.bfloat16, requires_grad=True)
    buffers = DequantBuffers()
    y = dequant_linear(x, ours, buffers)
    y.float().square().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    (x_ref @ dense.to(torch.bfloat16).t()).float().square().sum().backward()
    torch.testing.assert_close(y, x_ref.detach() @ dense.to(torch.bfloat16).t())
    assert x.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_layers_share_one_dequant_buffer() -> None:
    buffers = DequantBuffers()
    first = buffers.get((4, 8), torch.bfloat16, "cpu")
    assert buffers.get((4, 8), torch.bfloat16, "cpu").data_ptr() == first.data_ptr()
