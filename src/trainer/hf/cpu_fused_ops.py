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


# Dynamo compiles a function again for each new combination of what its guards check (grad mode,
# an input's dtype, a dimension of size 1, the tensors' rank): a trainer meets a few (a norm sees
# bf16 embeddings and the float32 stream, with and without gradients, batches of one piece), a
# process that builds several models more. Past torch's default of 8 a function runs eagerly.
RECOMPILE_LIMIT = 64


def compiled_on_cpu(fn: F) -> F:
    """`fn` (tensors in, one tensor out, pure torch, every step's dtype explicit) compiled into one
    kernel where its first argument is a CPU tensor, as it is elsewhere."""
    compiled: Any = None

    @functools.wraps(fn)
    def run(first: torch.Tensor, *rest: Any) -> Any:
        nonlocal compiled
        # The formulas cast every step themselves, so autocast is off for them on every device; on
        # CPU that also keeps one guard state (autocast's is one) for calls from inside and
        # outside a 16-bit policy's autocast.
        with torch.autocast(first.device.type, enabled=False):
            if first.device.type != "cpu" or not cpu_compiler_available():
                return fn(first, *rest)
            if compiled is None:
                torch._dynamo.config.recompile_limit = max(
                    torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT
                )
                compiled = torch.compile(fn, dynamic=True)
            return compiled(first, *rest)

    return run  # type: ignore[return-value]


@compiled_on_cpu
def silu_and_mul_float32(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] 16-bit -> silu(gate) * up [..., I] in their dtype, computed in float32 and
    rounded once, as inductor's fused kernel of vLLM's SiLU-and-mul (torch's bf16 ops round twice)."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


@compiled_on_cpu
def rms_norm_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] (16-bit or float32), weight [H] 16-bit -> [..., H] in the weight's dtype: float32
    statistics, the weight multiply in float32 and one rounding, as inductor's fused kernel of
    vLLM's RMSNorm."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(weight.dtype)


def rotary_float32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] 16-bit, cos/sin [B, T, D] (transformers' half-duplicated tables) ->
    float32 [B, heads, T, D]: the rotation in float32 from the 16-bit operands, unrounded."""
    xf = x.float()
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    x1, x2 = xf.chunk(2, dim=-1)
    return xf * cos + torch.cat((-x2, x1), dim=-1) * sin


@compiled_on_cpu
def rotary_rounded(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [B, heads, T, D] 16-bit, cos/sin [B, T, D] (transformers' half-duplicated tables) -> the
    rotation computed in float32 and rounded to nearest in `dtype` once, as inductor's fused kernel
    of vLLM's RoPE."""
    return rotary_float32(x, cos, sin).to(dtype)
