"""Megatron backend fixtures (the tiny Llama whose heads split two ways is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from grpo.config.trainer import TrainerConfig


@pytest.fixture
def float32_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both backends compute in float32 (a GPU or a CPU with bf16 kernels would pick bf16), so they agree to
    float32 tolerance. The HF backend's module holds its own name for choose_dtype, bound at its first
    import: patching only grpo.trainer.device left the HF backend in bf16 on an H100 whenever an earlier
    test had imported it (its logprobs then 1e-2 from backend megatron's)."""
    import torch

    def float32(device: torch.device) -> torch.dtype:
        return torch.float32

    monkeypatch.setattr("grpo.trainer.device.choose_dtype", float32)
    monkeypatch.setattr("grpo.trainer.hf.model.choose_dtype", float32)


@pytest.fixture
def megatron_cfg(tiny_model_path: Path) -> Callable[..., TrainerConfig]:
    def make(**overrides: Any) -> TrainerConfig:
        fields: dict[str, Any] = {
            "model": str(tiny_model_path),
            "backend": "megatron",
            "lora": False,
            "optimizer": "adamw",
            "learning_rate": 1e-3,
            "per_device_train_batch_size": 1,
            "logprob_chunk_size": 16,
            "max_async_level": 1,
            "gradient_checkpointing": False,
            **overrides,
        }
        return TrainerConfig(**fields)

    return make


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Qwen2 (q/k/v biases, made non-zero), 4 heads and 2 KV heads, untied, with a
    vocabulary as large as the tiny Llama's (so the multi-rank batch's inference logprobs are plausible)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF starts biases at 0
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen3_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF MoE tests' tiny Qwen3-MoE (4 experts, top-2, in both layers), its norms moved off 1
    so that a dropped q/k norm shows."""
    import torch
    from model_families import build_family_model
    from transformers import AutoModelForCausalLM

    path = build_family_model("qwen3_moe", tmp_path_factory.mktemp("qwen3-moe-raw"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    out = tmp_path_factory.mktemp("qwen3-moe")
    model.save_pretrained(out)
    return out
