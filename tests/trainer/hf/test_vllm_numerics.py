"""The trainer's bf16 decoder rounds where vLLM rounds: residual adds fused into the next RMSNorm in
float32, only the carried residual rounded to the model dtype."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo.trainer.hf.vllm_numerics import follow_vllm_rounding


def _model(dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


def _fused_add_rms_norm(x, residual, weight, eps):
    """vLLM's fused_add_rms_norm (native and CPU path), written out: the add in float32, the
    unrounded sum normalised, the sum rounded once for the residual, once after the weight."""
    summed = x.float() + residual.float()
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(weight.dtype) * weight).to(x.dtype), summed.to(x.dtype)


def _rms_norm(x, weight, eps):
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(weight.dtype) * weight).to(x.dtype)


def _vllm_order_hidden(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The decoder computed in vLLM's LlamaModel order from the HF modules' own attention and MLP."""
    decoder = model.model
    hidden = decoder.embed_tokens(input_ids)
    position_ids = torch.arange(input_ids.shape[1])[None]
    cos_sin = decoder.rotary_emb(hidden, position_ids)
    residual = None
    for layer in decoder.layers:
        eps = layer.input_layernorm.variance_epsilon
        if residual is None:
            residual = hidden
            hidden = _rms_norm(hidden, layer.input_layernorm.weight, eps)
        else:
            hidden, residual = _fused_add_rms_norm(hidden, residual, layer.input_layernorm.weight, eps)
        hidden, _ = layer.self_attn(hidden, position_embeddings=cos_sin, attention_mask=None)
        hidden, residual = _fused_add_rms_norm(hidden, residual, layer.post_attention_layernorm.weight, eps)
        hidden = layer.mlp(hidden)
    hidden, _ = _fused_add_rms_norm(hidden, residual, decoder.norm.weight, decoder.norm.variance_epsilon)
    return hidden


def test_patched_bf16_decoder_equals_vllm_order_bit_for_bit():
    model = _model(torch.bfloat16)
    input_ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        expected = _vllm_order_hidden(model, input_ids)
        before = model.model(input_ids=input_ids).last_hidden_state
        assert follow_vllm_rounding(model) == 3
        after = model.model(input_ids=input_ids).last_hidden_state
    assert after.dtype == torch.bfloat16
    assert not torch.equal(before, expected)  # HF's own order rounds elsewhere
    assert torch.equal(after, expected)


def test_float32_model_is_left_as_it_is():
    model = _model(torch.float32)
    assert follow_vllm_rounding(model) == 0
    assert "forward" not in vars(model.model.layers[0])


def test_patched_decoder_still_backpropagates():
    model = _model(torch.bfloat16)
    follow_vllm_rounding(model)
    hidden = model.model(input_ids=torch.randint(0, 256, (1, 8))).last_hidden_state
    hidden.float().sum().backward()
    assert model.model.layers[0].mlp.down_proj.weight.grad is not None
