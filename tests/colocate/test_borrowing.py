"""On CPU the trainer's base weights ARE the engine's memory: shared-memory pages, no copy."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from grpo.config.inference import InferenceConfig
from grpo.inference.weight_handles import release_shared_names

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def dense_server(tiny_model_path: Path) -> Iterator[object]:
    from grpo.inference.server import ServerThread

    os.environ["GRPO_KEEP_DENSE_WEIGHTS"] = "1"
    cfg = InferenceConfig(
        model="tiny", port=0, kv_cache_space_gb=0.5, max_model_len=256, max_lora_rank=8, max_num_seqs=8
    )
    server = ServerThread(cfg, str(tiny_model_path)).start()
    try:
        server.wait_ready(timeout=300)
        yield server
        # Every test has rebuilt what it needs; the names would otherwise outlive the engine.
        (records,) = server.collective_rpc("export_weight_handles")
        release_shared_names(records)
    finally:
        server.stop()
        os.environ.pop("GRPO_KEEP_DENSE_WEIGHTS", None)


def _mapping_of(address: int) -> str | None:
    """Path of the file mapping of this process that contains `address` (None: anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= address < end:
            return parts[5] if len(parts) == 6 else None
    return None


def test_trainer_base_weights_are_the_engines_shared_memory(
    dense_server: object, tiny_model_path: Path
) -> None:
    from grpo.colocate.borrow import borrow_from_records
    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.hf.model import build_policy
    from grpo.trainer.weights import BorrowedWeights

    (records,) = dense_server.collective_rpc("export_weight_handles")  # type: ignore[attr-defined]
    borrowed = borrow_from_records(records, tiny_model_path)
    assert len(borrowed.tensors) == 2 * 7 and borrowed.checked

    cfg = TrainerConfig(model=str(tiny_model_path), optimizer="adamw", gradient_checkpointing=False)
    policy = build_policy(cfg, BorrowedWeights(tiny_model_path, borrowed.tensors))
    params = dict(policy.causal_lm.named_parameters())
    engine_files = {os.path.basename(r["filename"]) for r in records if r["kind"] == "cpu_shm"}
    for name, view in borrowed.tensors.items():
        peft_name = name.replace(".weight", ".base_layer.weight")
        param = params.get(peft_name, params.get(name))
        assert param is not None, name
        assert param.data_ptr() == view.data_ptr(), f"{name} was copied"
        # The parameter's bytes live in a mapping of the very shared-memory file the engine exported.
        mapping = _mapping_of(param.data_ptr())
        assert mapping is not None and os.path.basename(mapping.split(" (deleted)")[0]) in engine_files, (
            name,
            mapping,
        )


def test_fused_views_keep_the_engines_row_order(dense_server: object, tiny_model_path: Path) -> None:
    from safetensors.torch import load_file

    from grpo.colocate.borrow import borrow_from_records

    (records,) = dense_server.collective_rpc("export_weight_handles")  # type: ignore[attr-defined]
    borrowed = borrow_from_records(records, tiny_model_path)
    on_disk = load_file(str(tiny_model_path / "model.safetensors"))
    for part in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.1.self_attn.{part}.weight"
        assert torch.equal(borrowed.tensors[name], on_disk[name])
    for part in ("gate_proj", "up_proj"):
        name = f"model.layers.0.mlp.{part}.weight"
        assert torch.equal(borrowed.tensors[name], on_disk[name])
