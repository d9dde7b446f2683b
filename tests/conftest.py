"""Fixtures shared by every test: offline settings and tiny models built once per session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from suite_scheduling import pytest_xdist_make_scheduler  # noqa: F401  (make test's worker split)

# Tests never reach a model hub, and a hub lookup that times out would cost minutes.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_available() -> bool:
    # Not torch.cuda.is_available(): it would break every vLLM engine a test forks later.
    from grpo.utils.device import cuda_present

    return cuda_present()


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
def tiny_moe_model_path(model_cache_dir: Path) -> Path:
    """A 2-layer random Qwen3-MoE (hidden 128, 8 experts top-2, bf16) with the real SmolLM2 tokenizer."""
    from grpo.models.tiny import build_tiny_moe_model

    return build_tiny_moe_model(model_cache_dir / "tiny-qwen3-moe")


@pytest.fixture(scope="session")
def tiny_vl_model_path(model_cache_dir: Path) -> Path:
    """A random Qwen2-VL: 2-layer vision tower, 2-layer text model (hidden 128), SmolLM2 tokenizer
    with Qwen2-VL's vision tokens, and its image processor."""
    from grpo.models.tiny_vl import build_tiny_vl_model

    return build_tiny_vl_model(model_cache_dir / "tiny-qwen2-vl")


@pytest.fixture(scope="session")
def tiny_qwen25_vl_model_path(model_cache_dir: Path) -> Path:
    """tiny_vl_model_path's Qwen2.5-VL sibling (windowed vision attention)."""
    from grpo.models.tiny_vl import build_tiny_vl_model

    return build_tiny_vl_model(model_cache_dir / "tiny-qwen2.5-vl", family="qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_idefics3_model_path(model_cache_dir: Path) -> Path:
    """A random Idefics3 (SmolVLM's family): 2-layer vision tower on 64x64 tiles (4 image tokens
    each), images split into up to 2x2 tiles plus a global view, 2-layer Llama text model."""
    from grpo.models.tiny_idefics3 import build_tiny_idefics3

    return build_tiny_idefics3(model_cache_dir / "tiny-idefics3")


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


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    """The real SmolLM2-135M-Instruct (Q4_1-dequantized), for tests where learning is the point."""
    from grpo.models import embedded

    return embedded.build()


ColocatedArgs = Callable[..., list[str]]


@pytest.fixture
def colocated_args(tmp_path: Path, tiny_model_path: Path) -> ColocatedArgs:
    """Writes a small co-located run's train/infer/orch.yaml into tmp_path and returns the `grpo`
    arguments: tiny model, batches of 8 (4 rollouts x 2 prompts), 16 completion tokens, port 0.
    Keywords: run_dir, max_steps, max_async_level, num_replicas (infer dp), ckpt (both sides),
    orch_ckpt (orchestrator only)."""

    def write(
        run_dir: Path,
        max_steps: int = 3,
        max_async_level: int = 0,
        num_replicas: int = 1,
        ckpt: dict[str, Any] | None = None,
        orch_ckpt: dict[str, Any] | None = None,
    ) -> list[str]:
        import yaml

        model = str(tiny_model_path)
        train = {
            "model": model, "output_dir": str(run_dir), "sequence_len": 256, "max_steps": max_steps,
            "learning_rate": 1e-3, "optimizer": "adamw", "lora_rank": 8, "lora_alpha": 16,
            "max_async_level": max_async_level, "ckpt": ckpt or {},
        }  # fmt: skip
        infer = {
            "model": model, "max_lora_rank": 8, "max_model_len": 256, "max_num_seqs": 16, "port": 0,
            "dp": num_replicas,
        }  # fmt: skip
        orch = {
            "model": {"lora_rank": 8, "lora_alpha": 16}, "output_dir": str(run_dir), "batch_size": 8,
            "rollouts_per_example": 4, "seq_len": 256, "max_steps": max_steps,
            "max_async_level": max_async_level, "sampling": {"max_tokens": 16},
            "ckpt": {**(ckpt or {}), **(orch_ckpt or {})},
        }  # fmt: skip
        args = []
        for name, cfg in (("train", train), ("infer", infer), ("orch", orch)):
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            args += [f"--{name}", str(path)]
        return args

    return write
