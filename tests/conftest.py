"""Fixtures shared by every test: offline settings and tiny models built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a model hub, and a hub lookup that times out would cost minutes.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model_path(model_cache_dir: Path) -> Path:
    """A 2-layer random Llama (hidden 128) with the real SmolLM2 tokenizer."""
    from grpo.models.tiny import build_tiny_model

    return build_tiny_model(model_cache_dir / "tiny-llama")


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    """The real SmolLM2-135M-Instruct (Q4_1-dequantized), for tests where learning is the point."""
    from grpo.models import embedded

    return embedded.build()
