"""The decoder's float32 pointwise formulas compiled into one CPU kernel each: the eager formulas'
values (bit for bit forward), one compilation for every batch and length, and eager where inductor
cannot build."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from grpo.trainer.hf import cpu_fused_ops
from grpo.trainer.hf.cpu_fused_ops import (
    rms_norm_float32,
    rotary_float32,
    rotary_rounded,
    silu_and_mul_float32,
)


def _eager_silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def _eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(weight.dtype)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 3).to(torch.bfloat16).requires_grad_()


def _grads(out: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.dtype)
    return torch.autograd.grad(out, inputs, upstream)


@pytest.mark.skipif(not cpu_fused_ops.cpu_compiler_available(), reason="inductor finds no C++ compiler")
def test_compiled_silu_and_mul_is_the_eager_formula_for_every_shape_with_one_compilation():
    torch._dynamo.reset()
    counters.clear()
    for batch, length in [(3, 17), (2, 40), (4, 9)]:
        gate, up = _bf16(batch, length, 64, seed=length), _bf16(batch, length, 64, seed=length + 1)
        out = silu_and_mul_float32(gate, up)
        expected = _eager_silu_and_mul(gate, up)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, expected)
        got_gate, got_up = _grads(out, gate, up)
        want_gate, want_up = _grads(expected, gate, up)
        assert torch.equal(got_up, want_up)
        # silu's derivative written by inductor in another float32 order: within a bf16 rounding
        torch.testing.assert_close(got_gate, want_gate, rtol=2**-7, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.skipif(not cpu_fused_ops.cpu_compiler_available(), reason="inductor finds no C++ compiler")
def test_compiled_rms_norm_and_rope_are_the_eager_formulas_bit_for_bit():
    x32 = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(0)) * 4  # the float32 stream
    weight = _bf16(64, seed=1).detach()
    assert torch.equal(rms_norm_float32(x32, weight, 1e-5), _eager_rms_norm(x32, weight, 1e-5))
    q = _bf16(2, 3, 11, 32, seed=2)
    cos, sin = _bf16(2, 11, 32, seed=3).detach(), _bf16(2, 11, 32, seed=4).detach()
    out = rotary_rounded(q, cos, sin, torch.bfloat16)
    assert torch.equal(out, rotary_float32(q, cos, sin).to(torch.bfloat16))


def test_without_a_cpp_compiler_the_formulas_run_eagerly(monkeypatch):
    monkeypatch.setattr(cpu_fused_ops, "cpu_compiler_available", lambda: False)
    torch._dynamo.reset()
    counters.clear()
    gate, up = _bf16(2, 5, 16, seed=0), _bf16(2, 5, 16, seed=1)
    assert torch.equal(silu_and_mul_float32(gate, up), _eager_silu_and_mul(gate, up))
    assert counters["stats"]["unique_graphs"] == 0


@pytest.mark.skipif(not cpu_fused_ops.cpu_compiler_available(), reason="inductor finds no C++ compiler")
def test_past_dynamos_recompile_limit_a_formula_runs_eagerly_instead_of_failing():
    torch._dynamo.reset()
    gate, up = _bf16(2, 5, 16, seed=0), _bf16(2, 5, 16, seed=1)
    silu_and_mul_float32(gate, up)  # compiled: the first variant
    counters.clear()
    # torch's own patch: pytest's monkeypatch deletes a config key on undo instead of restoring it
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        out = silu_and_mul_float32(gate, up)  # grad mode is guarded: a second variant, past the limit
    assert torch.equal(out, _eager_silu_and_mul(gate, up))
    assert counters["stats"]["unique_graphs"] == 0
