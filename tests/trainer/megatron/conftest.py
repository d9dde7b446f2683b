"""Megatron backend fixtures: skip without megatron-core; a tiny Llama whose heads split two ways."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from grpo.config.trainer import TrainerConfig


@pytest.fixture(scope="session")
def tiny_llama_tp2_path(model_cache_dir: Path) -> Path:
    """A 2-layer random Llama, 4 heads and 2 KV heads (tensor parallel 2 divides both), untied
    output layer (the tiny fixture's is tied): both embedding layouts are covered."""
    from grpo.models.tiny import build_tiny_model

    return build_tiny_model(
        model_cache_dir / "tiny-llama-tp2",
        num_heads=4,
        num_kv_heads=2,
        hidden_size=256,
        tie_word_embeddings=False,
    )


@pytest.fixture
def float32_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both backends compute in float32 (this CPU would pick bf16), so they can agree to float32 tolerance."""
    import torch

    monkeypatch.setattr("grpo.trainer.model.choose_dtype", lambda device: torch.float32)


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
