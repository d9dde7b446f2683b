"""Make a 16-bit HF Llama-family decoder round where vLLM rounds, so the trainer's logprobs track
the engine's (the step-0 mismatch KL).

vLLM fuses each residual add into the following RMSNorm (`fused_add_rms_norm`): the add runs in
float32, the *unrounded* sum is normalised, and only the residual carried on is rounded to the
model dtype. HF adds in the model dtype and normalises the rounded sum, so every one of the
2 x layers + 1 norms of a bf16 model sees a different input, each differing by up to half a
bf16 ulp. Here each decoder layer returns the float32 sum (residual stream rounded the way vLLM
rounds it) and each RMSNorm normalises it in float32 and rounds once after the weight multiply,
as vLLM's CPU and native paths do. The hidden states a decoder returns keep their [.., H] shape
(float32 rather than bf16 between layers; the final norm's output is in the model dtype).

Applies to decoders whose layers are the plain pre-norm pattern (input_layernorm, self_attn,
post_attention_layernorm, mlp: Llama, Mistral, Qwen2, Qwen3); other layer shapes are left as
HF computes them. A no-op in float32 (the rounding it moves does not happen).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

_PRE_NORM_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
_RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


def _rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """float32 statistics on the (possibly float32) input; one rounding to the weight's dtype
    before the weight multiply, as vLLM's rms_norm does."""
    import torch

    x = hidden_states.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * x.to(self.weight.dtype)


def _decoder_layer_forward(
    self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """hidden_states: the float32 sum from the previous layer (or the embeddings) -> this layer's
    float32 sum. The residual is the sum rounded to the model dtype, as vLLM carries it."""
    import torch

    dtype = self.input_layernorm.weight.dtype
    residual = hidden_states.to(dtype)
    normed = self.input_layernorm(hidden_states)
    attn_out, _ = self.self_attn(normed, *args, **kwargs)
    summed = residual.to(torch.float32) + attn_out.to(torch.float32)
    residual = summed.to(dtype)
    mlp_out = self.mlp(self.post_attention_layernorm(summed))
    return residual.to(torch.float32) + mlp_out.to(torch.float32)


def follow_vllm_rounding(causal_lm: nn.Module) -> int:
    """Patch, in place, the decoder layers and RMSNorms of a 16-bit pre-norm decoder; returns the
    number of layers patched (0: the model's layers are not of the plain pre-norm kind, or its
    weights are float32, and nothing changed)."""
    import torch

    decoder = causal_lm.get_decoder()
    layers = list(getattr(decoder, "layers", []))
    if not layers or any(type(layer).__name__ not in _PRE_NORM_LAYERS for layer in layers):
        return 0
    if layers[0].input_layernorm.weight.dtype not in (torch.bfloat16, torch.float16):
        return 0
    for module in decoder.modules():
        if type(module).__name__ in _RMS_NORMS:
            module.forward = types.MethodType(_rms_norm_forward, module)
    for layer in layers:
        layer.forward = types.MethodType(_decoder_layer_forward, layer)
    return len(layers)
