"""Tiny random models of each family the HF trainer is checked against (imported by the tests here).

Two layers of hidden size 64, a 512-token vocabulary, float32 weights. Sliding windows are 4 tokens
(shorter than the test sequences, so a window that is ignored changes the result), and where a family
mixes layer kinds one layer of each kind. Weights are initialised at std 0.2 rather than HF's
0.02 so that attention is far from uniform: masks, windows and soft-caps then all move the logprobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 512
WINDOW = 4

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}

FAMILIES = [
    "llama", "smollm", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "gpt_oss",
    "qwen3_moe", "qwen2_moe", "mixtral",
]  # fmt: skip
"""smollm is Llama with tied input and output embeddings (SmolLM2's layout)."""

MOE_FAMILIES = ["gpt_oss", "qwen3_moe", "qwen2_moe", "mixtral"]
"""Families with mixture-of-experts layers (4 experts, top-2)."""

_MOE: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _config(family: str) -> Any:
    import transformers as tf

    sliding_pair = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
    if family == "llama":
        return tf.LlamaConfig(**_COMMON)
    if family == "smollm":
        return tf.LlamaConfig(**{**_COMMON, "tie_word_embeddings": True})
    if family == "qwen2":  # layer 0 full, layer 1 sliding (max_window_layers)
        return tf.Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if family == "qwen3":  # q/k norms
        return tf.Qwen3Config(**_COMMON)
    if family == "mistral":  # every layer slides
        return tf.MistralConfig(**_COMMON, sliding_window=WINDOW)
    if family == "gemma2":  # soft-capped attention and logits, scaled embeddings, tied embeddings
        return tf.Gemma2Config(
            **{**_COMMON, "tie_word_embeddings": True},
            **sliding_pair,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=16,
        )
    if family == "gemma3":  # per-kind RoPE, q/k norms, scaled embeddings
        return tf.Gemma3TextConfig(**{**_COMMON, "tie_word_embeddings": True}, **sliding_pair)
    if family == "phi3":  # fused qkv_proj and gate_up_proj, every layer slides
        return tf.Phi3Config(**_COMMON, sliding_window=WINDOW, pad_token_id=0)
    if family == "gpt_oss":  # attention sinks, mixture of experts
        return tf.GptOssConfig(**_COMMON, **sliding_pair, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen3_moe":  # q/k norms, 4 experts top-2 (softmax, then top-k, renormalised)
        return tf.Qwen3MoeConfig(**_COMMON, **_MOE, num_experts=4, norm_topk_prob=True)
    if family == "qwen2_moe":  # layer 0 dense, layer 1 4 experts top-2 + a gated shared expert
        return tf.Qwen2MoeConfig(
            **_COMMON, **_MOE, num_experts=4, shared_expert_intermediate_size=64, mlp_only_layers=[0]
        )
    if family == "mixtral":  # 8 experts top-2, every layer slides
        return tf.MixtralConfig(**_COMMON, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW)
    raise ValueError(family)


def build_family_model(family: str, path: Path) -> Path:
    """Save a random float32 model of `family` to `path` (once)."""
    import torch
    from transformers import AutoModelForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    if family == "gpt_oss":  # sinks start at zero; give them weight so that a dropped sink shows
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path
