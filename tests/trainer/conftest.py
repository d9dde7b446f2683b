"""Trainer test fixtures: a small TrainerConfig on the tiny model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from grpo.config.trainer import TrainerConfig


@pytest.fixture
def make_cfg(tiny_model_path: Path) -> Callable[..., TrainerConfig]:
    def make(**overrides: Any) -> TrainerConfig:
        fields: dict[str, Any] = {
            "model": str(tiny_model_path),
            "optimizer": "adamw",
            "learning_rate": 1e-2,
            "lora_rank": 4,
            "lora_alpha": 8,
            "logprob_chunk_size": 16,
            "max_async_level": 1,
            **overrides,
        }
        return TrainerConfig(**fields)

    return make
