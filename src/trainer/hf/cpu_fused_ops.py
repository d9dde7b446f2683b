"""The decoder's float32 pointwise steps (grpo.trainer.hf.vllm_numerics) as one compiled CPU kernel
each, forward and backward.

Following vLLM's compiled engine, a 16-bit decoder computes SiLU-and-mul, each RMSNorm and RoPE in
float32 from 16-bit operands and rounds once. In eager torch every step of those formulas is its own
pass over memory: `silu(gate.float()) * up.float()` reads and writes [tokens, intermediate] float32
tensors five times forward and more in backward. On 2 CPU cores (AVX512-BF16, a short-answer step:
8 prefix trees of 237 tokens, SmolLM2-135M) the MLP's pointwise ops alone took ~0.3 s of a 3.4 s
trainer step; one inductor kernel for SiLU-and-mul is 2.5 ms a layer forward and backward against
8.5 ms eager, with the same forward output bit for bit (the gate's gradient within a bf16 ulp).
Inductor is also what fuses these formulas in vLLM's compiled engine, so the kernels compute as
the engine's do.

CPU only: on CUDA these stay eager (inductor there needs Triton, and nothing was measured there).
Each function is compiled on first use with dynamic shapes (one kernel for every batch and length,
~6 s the first time on 2 cores, then read from inductor's on-disk cache), and runs eagerly where
inductor has no C++ compiler to build with. TORCHDYNAMO_DISABLE=1 (torch's own switch) turns the
compilation off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from grpo.trainer.hf.vllm_numerics import rotary_float32

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def cpu_compiler_available() -> bool:
    """Whether inductor finds the C++ compiler its CPU kernels are built with (g++, or $CXX)."""
    from torch._inductor import exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return False
    return True


def compiled_on_cpu(fn: F) -> F:
    """`fn` (tensors in, one tensor out, pure torch) compiled into one kernel where its first
    argument is a CPU tensor, as it is elsewhere."""
    compiled: Any = None

    @functools.wraps(fn)
    def run(first: torch.Tensor, *rest: Any) -> Any:
        nonlocal compiled
        if first.device.type != "cpu" or not cpu_compiler_available():
            return fn(first, *rest)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        return compiled(first, *rest)

    return run  # type: ignore[return-value]


@compiled_on_cpu
def silu_and_mul_float32(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] 16-bit -> silu(gate) * up [..., I] in their dtype, computed in float32 and
    rounded once, as inductor's fused kernel of vLLM's SiLU-and-mul (torch's bf16 ops round twice)."""
    with torch.autocast(gate.device.type, enabled=False):
        return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


@compiled_on_cpu
def rms_norm_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] (16-bit or float32), weight [H] 16-bit -> [..., H] in the weight's dtype: float32
    statistics, the weight multiply in float32 and one rounding, as inductor's fused kernel of
    vLLM's RMSNorm."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(weight.dtype)


@compiled_on_cpu
def rotary_rounded(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [B, heads, T, D] 16-bit, cos/sin [B, T, D] (transformers' half-duplicated tables) -> the
    rotation computed in float32 and rounded to nearest in `dtype` once, as inductor's fused kernel
    of vLLM's RoPE."""
    return rotary_float32(x, cos, sin).to(dtype)
