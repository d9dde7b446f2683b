"""Make a 16-bit HF Llama-family decoder round where vLLM rounds, so the trainer's logprobs track
the engine's (the step-0 mismatch KL).

vLLM fuses each residual add into the following RMSNorm (`fused_add_rms_norm`): the add runs in
float32, the *unrounded* sum is normalised, and only the residual carried on is rounded to the
model dtype. HF adds in the model dtype and normalises the rounded sum, so every one of the
2 x layers + 1 norms of a bf16 model sees a different input, each differing by up to half a
bf16 ulp. Here each decoder layer returns the float32 sum (residual stream rounded the way vLLM
rounds it: to the model dtype in the eager engine, not at all in the compiled one) and each
RMSNorm normalises it in float32 (rounding where each engine mode does, below). The hidden states a decoder returns keep their [.., H] shape
(float32 rather than bf16 between layers; the final norm's output is in the model dtype).

The attention block follows vLLM's CPU kernels (benchmarks/vllm_layer_probe.py compares the two op
by op): RoPE is computed in float32 from the 16-bit q/k and the 16-bit cos/sin table and rounded
once (vLLM's `rotary_embedding` kernel; transformers rounds each product and the sum), and
attention runs in float32 on the 16-bit q/k/v with one rounding of its output (vLLM's
`cpu_attention_with_kv_cache`; torch's bf16 SDPA rounds the probabilities before multiplying V).
vLLM's AVX2 kernels (x86 without AVX-512, vllm._C_AVX2) convert float32 to bf16 by dropping the
low 16 bits, i.e. rounding toward zero, not to nearest: on such a CPU these two roundings truncate
too (`vllm_cpu_truncates_bf16`).

vLLM-CPU runs the model either eagerly (`enforce_eager`, or an engine serving LoRA adapters) or,
its default, compiled by torch.compile/inductor with its custom ops off; the two round differently
(benchmarks/inductor_rounding_probe.py compares them bit for bit), and `engine_compiled` picks:
  eager:    RoPE is the `rotary_embedding` kernel (above); SiLU-and-mul is torch's bf16 ops (the
            SiLU rounded, then the product); each RMSNorm rounds the normalised float32 input
            before the weight multiply, which rounds again.
  compiled: RoPE, SiLU-and-mul and each RMSNorm are vLLM's torch formulas fused by inductor into
            one kernel each, which computes in float32 and rounds once, to nearest, at its store
            (inductor drops the casts between fused ops, even the explicit one before the norm's
            weight multiply): RoPE's rotation, silu(gate) * up, and normalised x * weight are each
            rounded once. Inductor also drops the residual's round trip through the model dtype
            (`residual = x.to(dtype)`, read back as float32 by the next layer's add): the residual
            stream stays float32, unrounded, from the embeddings to the final norm (measured on
            CPU, whose compiled graph is one piece; CUDA keeps the rounded residual). Attention
            stays vLLM's kernel (an opaque op to inductor).
The projections and residual adds round as vLLM's do in both modes (to nearest).

Applies to decoders whose layers are the plain pre-norm pattern (input_layernorm, self_attn,
post_attention_layernorm, mlp: Llama, Mistral, Qwen2, Qwen3); other layer shapes are left as
HF computes them. A no-op in float32 (the rounding it moves does not happen).
"""

from __future__ import annotations

import functools
import platform
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

_PRE_NORM_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
_RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
_ATTENTIONS = {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"}
_MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}


@functools.cache
def vllm_cpu_truncates_bf16() -> bool:
    """Whether vLLM's CPU kernels on this machine round float32 to bf16 toward zero: x86 without
    AVX-512 loads vllm._C_AVX2, whose vector conversion keeps the high 16 bits."""
    import torch

    return platform.machine().lower() in ("x86_64", "amd64") and not torch.cpu._is_avx512_supported()


def _toward_zero_function() -> Any:
    import torch

    class TowardZero(torch.autograd.Function):
        """float32 [...] -> bf16 [...] rounded toward zero (the low 16 bits of each float32
        dropped). The gradient is a cast's: passed through, in float32."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad.to(torch.float32)

    return TowardZero


_TOWARD_ZERO: Any = None


def round_as_vllm_kernel(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 x -> dtype as vLLM's own kernels (RoPE, attention) write their output: toward zero
    for bf16 on CPUs where those kernels truncate, to nearest otherwise."""
    import torch

    global _TOWARD_ZERO
    if dtype == torch.bfloat16 and x.device.type == "cpu" and vllm_cpu_truncates_bf16():
        if _TOWARD_ZERO is None:
            _TOWARD_ZERO = _toward_zero_function()
        return _TOWARD_ZERO.apply(x.float())
    return x.to(dtype)


def _attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: Any = None,
    past_key_values: Any = None,
    *,
    engine_compiled: bool,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' Llama-family attention (q/k norms where the model has them, GQA, the layer's
    sliding window), with vLLM-CPU's RoPE and attention precision.
    hidden_states [B, T, H] -> ([B, T, H], attention weights or None)."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from grpo.trainer.hf.cpu_fused_ops import rotary_float32, rotary_rounded

    if hidden_states.device.type != "cpu":
        # vLLM's GPU attention backends round as their own kernels do; these CPU-kernel roundings
        # were measured against vLLM-CPU only, so CUDA keeps transformers' attention.
        return type(self).forward(
            self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs
        )
    dtype = hidden_states.dtype  # the 16-bit normed input (a quantized base's weights are not)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape)
    key = self.k_proj(hidden_states).view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE, as vLLM
        query, key = self.q_norm(query), self.k_norm(key)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    if engine_compiled:  # inductor's fused kernel of vLLM's RoPE formula rounds to nearest
        query, key = rotary_rounded(query, cos, sin, dtype), rotary_rounded(key, cos, sin, dtype)
    else:
        query = round_as_vllm_kernel(rotary_float32(query, cos, sin), dtype)
        key = round_as_vllm_kernel(rotary_float32(key, cos, sin), dtype)
    if past_key_values is not None:  # the cache holds the 16-bit k/v, as vLLM's KV cache
        key, value = past_key_values.update(key, value, self.layer_idx)
    query, key, value = query.float(), key.float(), value.float()
    if isinstance(attention_mask, torch.Tensor) and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # an additive mask in the scores' dtype
    eager = sys.modules[type(self).__module__].eager_attention_forward  # the family's own
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    sliding_window = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
    with torch.autocast(hidden_states.device.type, enabled=False):
        out, weights = interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    out = round_as_vllm_kernel(out, dtype).reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor, *, engine_compiled: bool) -> torch.Tensor:
    """float32 statistics on the (possibly float32) input. Eager: rounded to the weight's dtype
    before the weight multiply, as vLLM's rms_norm; compiled: the weight multiply in float32 and
    one rounding, as inductor's fused kernel of the same formula."""
    import torch

    from grpo.trainer.hf.cpu_fused_ops import rms_norm_float32

    if engine_compiled:
        return rms_norm_float32(hidden_states, self.weight, self.variance_epsilon)
    x = hidden_states.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(self.weight.dtype)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' gated MLP with vLLM's compiled SiLU-and-mul rounding. x [.., H] -> [.., H]."""
    from grpo.trainer.hf.cpu_fused_ops import silu_and_mul_float32

    return self.down_proj(silu_and_mul_float32(self.gate_proj(x), self.up_proj(x)))


def _decoder_layer_forward(
    self: nn.Module, hidden_states: torch.Tensor, *args: Any, engine_compiled: bool, **kwargs: Any
) -> torch.Tensor:
    """hidden_states: the float32 sum from the previous layer (or the embeddings) -> this layer's
    float32 sum. Eager: the residual carried on is the sum rounded to the model dtype, as vLLM's
    fused_add_rms_norm kernel stores it; compiled on CPU: the unrounded float32 sum, as inductor
    keeps it (it drops the residual's round trip through the model dtype and passes float32 between
    layers in its one graph). On CUDA vLLM splits the compiled graph at every attention call, where
    a residual crossing the split is stored in the model dtype; not measured, so CUDA keeps the
    eager rounding."""
    import torch

    float32_stream = engine_compiled and hidden_states.device.type == "cpu"
    keep = (lambda x: x) if float32_stream else (lambda x: x.to(self.input_layernorm.weight.dtype))
    residual = keep(hidden_states)
    normed = self.input_layernorm(hidden_states)
    attn_out, _ = self.self_attn(normed, *args, **kwargs)
    # float32 + 16-bit promotes: the add runs in float32 with no float32 copy of the 16-bit operand
    summed = residual.to(torch.float32) + attn_out
    residual = keep(summed)
    mlp_out = self.mlp(self.post_attention_layernorm(summed))
    return residual.to(torch.float32) + mlp_out


def follow_vllm_rounding(causal_lm: nn.Module, engine_compiled: bool = True) -> int:
    """Patch, in place, the decoder layers and RMSNorms of a 16-bit pre-norm decoder; returns the
    number of layers patched (0: the model's layers are not of the plain pre-norm kind, or its
    weights are float32, and nothing changed). `engine_compiled`: follow vLLM's compiled engine
    (its default, and grpo's on CPU) rather than its eager one."""
    import torch

    decoder = causal_lm.get_decoder()
    layers = list(getattr(decoder, "layers", []))
    if not layers or any(type(layer).__name__ not in _PRE_NORM_LAYERS for layer in layers):
        return 0
    if layers[0].input_layernorm.weight.dtype not in (torch.bfloat16, torch.float16):
        return 0
    silu_mlp = getattr(decoder.config, "hidden_act", None) == "silu"
    for module in decoder.modules():
        name = type(module).__name__
        if name in _RMS_NORMS:
            module.forward = types.MethodType(
                functools.partial(_rms_norm_forward, engine_compiled=engine_compiled), module
            )
        elif name in _ATTENTIONS:
            attention = functools.partial(_attention_forward, engine_compiled=engine_compiled)
            module.forward = types.MethodType(attention, module)
        elif name in _MLPS and engine_compiled and silu_mlp:
            module.forward = types.MethodType(_mlp_forward, module)
    decoder_layer = functools.partial(_decoder_layer_forward, engine_compiled=engine_compiled)
    for layer in layers:
        layer.forward = types.MethodType(decoder_layer, layer)
    return len(layers)
