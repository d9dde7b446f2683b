"""cpu_float32_linear: the float32 product of an lm_head, whichever library computes it."""

from __future__ import annotations

import pytest
import torch

from grpo.utils.cpu_float32_gemm import cpu_float32_linear


def _reference(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = inputs.double() @ weight.double().t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "torch-blas"])
def test_the_product_is_float32_accurate_with_bias_and_a_transposed_input(
    onednn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not onednn:
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    torch.manual_seed(0)
    weight = torch.randn(4096, 576).bfloat16().float() * 0.05  # [V, H], as a bf16 head in float32
    bias = torch.randn(4096)
    rows = torch.randn(576, 37).bfloat16().float().t()  # [37, 576], not contiguous

    out = cpu_float32_linear(rows, weight, bias)
    no_bias = cpu_float32_linear(rows, weight)

    assert out.shape == (37, 4096) and out.dtype == torch.float32
    # float32 accumulation of 576 products of magnitude ~0.05: within 1e-5 of the float64 sum; a
    # bf16-rounded output would be off by up to ~1e-2 at these magnitudes
    torch.testing.assert_close(out.double(), _reference(rows, weight, bias), rtol=0, atol=1e-5)
    torch.testing.assert_close(no_bias.double(), _reference(rows, weight, None), rtol=0, atol=1e-5)


def test_a_non_float32_operand_is_refused() -> None:
    with pytest.raises(AssertionError):
        cpu_float32_linear(torch.randn(2, 8).bfloat16(), torch.randn(4, 8))
