"""Megatron backend fixtures (the tiny Llama whose heads split two ways is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from grpo.config.trainer import TrainerConfig


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
