"""Where vLLM-CPU's compiled engine (torch.compile, inductor: the default unless `enforce_eager`)
rounds bf16 differently from its eager mode, op by op, bit for bit.

In compiled mode vLLM turns its custom ops off ("none"), so RoPE, SiLU-and-mul and the RMSNorms run
vLLM's torch-native formulas, which inductor fuses into one kernel each: a fused kernel computes
in float32 and rounds only where the graph casts explicitly or stores. This script compiles vLLM's
own native functions with inductor as vLLM-CPU configures it and compares each output with
candidate trainer formulas (grpo.trainer.hf.vllm_numerics), counting elements that differ.

    python benchmarks/inductor_rounding_probe.py

Shapes of the embedded model (SmolLM2-135M: hidden 576, 9 heads x 64, intermediate 1536).
"""

from __future__ import annotations

import torch


def _count(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    differ = (got.view(torch.int16) != want.view(torch.int16)).sum().item()
    print(f"  {name:<58} {differ:>7} of {want.numel()} elements differ")


def _rope(num_tokens: int) -> None:
    from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb

    from grpo.trainer.hf.vllm_numerics import round_as_vllm_kernel

    torch.manual_seed(0)
    heads, dim = 9, 64
    x = torch.randn(num_tokens, heads, dim).bfloat16()
    angles = torch.rand(num_tokens, dim // 2) * 100
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()

    def native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return ApplyRotaryEmb.forward_static(x, cos, sin, True)

    compiled = torch.compile(native, backend="inductor")(x, cos, sin)
    # the trainer's float32 rotation (transformers' duplicated tables), then each rounding
    full_cos, full_sin = (
        torch.cat((cos, cos), -1)[:, None].float(),
        torch.cat((sin, sin), -1)[:, None].float(),
    )
    xf = x.float()
    x1, x2 = xf.chunk(2, -1)
    rotated = xf * full_cos + torch.cat((-x2, x1), -1) * full_sin
    print("RoPE (vLLM native, neox):")
    _count("eager native vs compiled", native(x, cos, sin), compiled)
    _count("float32, rounded to nearest vs compiled", rotated.bfloat16(), compiled)
    _count(
        "float32, rounded toward zero vs compiled", round_as_vllm_kernel(rotated, torch.bfloat16), compiled
    )


def _silu_and_mul(num_tokens: int) -> None:
    from vllm.model_executor.layers.activation import SiluAndMul

    torch.manual_seed(1)
    x = torch.randn(num_tokens, 2 * 1536).bfloat16() * 3
    compiled = torch.compile(SiluAndMul.forward_native, backend="inductor")(x)
    gate, up = x.float().chunk(2, -1)
    print("SiLU-and-mul (vLLM native):")
    _count("eager native (silu rounded, product rounded) vs compiled", SiluAndMul.forward_native(x), compiled)
    _count(
        "float32 silu(gate) * up, rounded once vs compiled",
        (torch.nn.functional.silu(gate) * up).bfloat16(),
        compiled,
    )


def _fused_add_rms_norm(num_tokens: int) -> None:
    from vllm.ir.ops.layernorm import fused_add_rms_norm

    torch.manual_seed(2)
    x, residual = torch.randn(num_tokens, 576).bfloat16(), torch.randn(num_tokens, 576).bfloat16()
    weight = (torch.rand(576) + 0.5).bfloat16()
    fn = fused_add_rms_norm.impls["native"].impl_fn
    compiled_out, compiled_res = torch.compile(fn, backend="inductor")(
        x.clone(), residual.clone(), weight, 1e-5
    )
    summed = x.float() + residual.float()
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
    print("fused add + RMSNorm (vLLM IR native):")
    _count("residual: float32 sum rounded to nearest vs compiled", summed.bfloat16(), compiled_res)
    _count("norm: rounded, then * weight rounded vs compiled", weight * normed.bfloat16(), compiled_out)
    _count(
        "norm: float32 * weight rounded once vs compiled", (normed * weight.float()).bfloat16(), compiled_out
    )


def _residual_stream(num_tokens: int) -> None:
    """Two layers' fused add + RMSNorm in one graph, as vLLM's compiled decoder chains them: the
    residual the first returns (rounded to bf16 by vLLM's formula) is the second's input."""
    from vllm.ir.ops.layernorm import fused_add_rms_norm

    torch.manual_seed(3)
    embed, attn_out, mlp_out = (torch.randn(num_tokens, 576).bfloat16() for _ in range(3))
    weight = (torch.rand(576) + 0.5).bfloat16()
    fn = fused_add_rms_norm.impls["native"].impl_fn

    def two_layers(embed: torch.Tensor, attn_out: torch.Tensor, mlp_out: torch.Tensor, weight: torch.Tensor):
        _, residual = fn(attn_out, embed, weight, 1e-5)
        return fn(mlp_out, residual, weight, 1e-5)

    compiled_out, compiled_res = torch.compile(two_layers, backend="inductor")(
        embed.clone(), attn_out.clone(), mlp_out.clone(), weight
    )
    print("residual stream, two fused add + RMSNorm in one graph (vLLM IR native):")
    first = embed.float() + attn_out.float()
    for name, carried in (("rounded to bf16", first.bfloat16().float()), ("kept in float32", first)):
        summed = carried + mlp_out.float()
        normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
        _count(
            f"residual carried {name}: norm output vs compiled",
            (normed * weight.float()).bfloat16(),
            compiled_out,
        )
        _count(f"residual carried {name}: next residual vs compiled", summed.bfloat16(), compiled_res)


def main() -> None:
    import torch._inductor.config as inductor_config

    # as vllm.platforms.cpu sets it for its compiled CPU engine
    inductor_config.epilogue_fusion = True
    torch.set_num_threads(1)
    num_tokens = 257
    _rope(num_tokens)
    _silu_and_mul(num_tokens)
    _fused_add_rms_norm(num_tokens)
    _residual_stream(num_tokens)


if __name__ == "__main__":
    main()
