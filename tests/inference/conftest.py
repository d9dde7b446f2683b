"""One vLLM server (tiny model, CPU) shared by every vLLM test of the session, and adapter makers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from grpo.config.inference import InferenceConfig
from grpo.config.trainer import DEFAULT_LORA_TARGETS
from grpo.inference.server import ServerThread

TINY_MODEL_NAME = "tiny"


def tiny_inference_config(port: int = 0, **overrides: object) -> InferenceConfig:
    fields: dict[str, object] = dict(
        model=TINY_MODEL_NAME,
        port=port,
        kv_cache_space_gb=1,
        max_model_len=512,
        max_lora_rank=8,
        max_loras=2,
        max_num_seqs=32,
        # vLLM's LoRA path (auto would merge on CPU): the shared server tests adapters, and the merge
        # route works on it too, so one engine compares both (test_lora_merge.py).
        lora_serving="adapter",
    )
    fields.update(overrides)
    return InferenceConfig.model_validate(fields)


@pytest.fixture(scope="session")
def shm_records_to_release() -> Iterator[list[dict[str, Any]]]:
    """Weight records whose /dev/shm names go once the session's server has stopped.

    Once released, a name is gone for good: a later export of the same storage names a missing
    file. So a test that exports from the shared server leaves the release to this fixture (torn
    down after `vllm_server`, which depends on it), not to itself."""
    records: list[dict[str, Any]] = []
    yield records
    from grpo.inference.weight_handles import release_shared_names

    release_shared_names(records)


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model_path: Path,
    shm_records_to_release: list[dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerThread]:
    """ServerThread serving the tiny model under the name "tiny", LoRA enabled (adapter serving);
    its weight routes load from the session's temporary folders."""
    cfg = tiny_inference_config(weight_dirs=[str(tmp_path_factory.getbasetemp())])
    server = ServerThread(cfg, str(tiny_model_path)).start()
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()


def make_peft_adapter(model_path: Path, out_dir: Path, seed: int, rank: int = 8) -> Path:
    """A PEFT LoRA adapter for `model_path` with random non-zero A and B (so it changes outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (out_dir / "adapter_config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(DEFAULT_LORA_TARGETS),
        init_lora_weights=False,  # random B: the adapter is not a no-op
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(20.0)  # large enough to move a random tiny model's logprobs clearly
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def adapter_dirs(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return make_peft_adapter(tiny_model_path, root / "a", seed=1), make_peft_adapter(
        tiny_model_path, root / "b", seed=2
    )
