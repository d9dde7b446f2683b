"""Tiny random-initialised Llama models with the real SmolLM2 tokenizer, for tests and benchmarks.

Real tokenizer (so chat templates, special tokens and decoding behave as in production), tiny
transformer (so a forward pass takes milliseconds). Shapes are chosen to be valid for vLLM's CPU
attention (head_dim 64) and for LoRA (every projection present).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any


def build_tiny_model(
    path: str | Path,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> Path:
    """Write a random LlamaForCausalLM (bf16 safetensors) + the embedded tokenizer to `path`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from grpo.models import embedded

    path = Path(path)
    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(embedded.build())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=torch.bfloat16,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    return save_model_folder(path, model, tokenizer)


def build_tiny_moe_model(
    path: str | Path,
    family: str = "qwen3_moe",
    num_layers: int = 2,
    num_experts: int = 8,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """Write a random mixture-of-experts model (Qwen3-MoE or Mixtral: hidden 128, `num_experts`
    experts of intermediate size 128, top-2) + the embedded tokenizer to `path`. Expert sizes are
    multiples of 32 and head_dim 64, as vLLM-CPU's MoE and attention kernels need."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, Qwen3MoeConfig

    from grpo.models import embedded

    path = Path(path)
    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(embedded.build())
    common = {
        "vocab_size": len(tokenizer), "hidden_size": 128, "num_hidden_layers": num_layers,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "num_experts_per_tok": 2,
        "max_position_embeddings": 2048, "tie_word_embeddings": True, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
    }  # fmt: skip
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common,
            intermediate_size=256,
            moe_intermediate_size=128,
            num_experts=num_experts,
            norm_topk_prob=True,
        )
    elif family == "mixtral":
        config = MixtralConfig(
            **common, intermediate_size=128, num_local_experts=num_experts, sliding_window=None
        )
    else:
        raise ValueError(f"no tiny MoE model of family {family}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return save_model_folder(path, model, tokenizer)


def save_model_folder(path: Path, model: Any, *parts: Any) -> Path:
    """Write `model` (safetensors) and each of `parts` (tokenizer, processors: anything with
    save_pretrained, in that order) to `path` through a temporary sibling renamed last, so that a
    process killed midway never leaves a folder that looks built."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for part in parts:
        part.save_pretrained(tmp)
    tmp.rename(path)
    return path
