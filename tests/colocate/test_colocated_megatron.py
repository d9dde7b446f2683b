"""`grpo --train --infer --orch` with a Megatron trainer: full weights, no borrowing.

The tiny random model: what is checked (steps, versions, published folders, logs) does not depend on
the model's size, and the embedded 135M model made this one of the suite's slowest runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

BIN = Path(sys.executable).parent


def test_a_colocated_megatron_run_serves_each_full_weight_policy(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    model, run_dir = str(tiny_model_path), tmp_path / "run"
    configs = {
        "train": {
            "model": model, "output_dir": str(run_dir), "backend": "megatron", "lora": False,
            "sequence_len": 256, "max_steps": 3, "learning_rate": 1e-5, "optimizer": "adamw",
            "per_device_train_batch_size": 1, "max_async_level": 0,
        },
        # Eager: on CPU vLLM would compile a full-weight engine (~25 s here); tests/integration/
        # test_multi_process.py covers full-weight policies reaching a compiled engine.
        "infer": {
            "model": model, "max_model_len": 256, "max_num_seqs": 16, "port": 0, "enable_lora": False,
            "enforce_eager": True,
        },
        "orch": {
            "model": {"lora_adapter": None}, "output_dir": str(run_dir), "batch_size": 8,
            "rollouts_per_example": 4, "seq_len": 256, "max_steps": 3, "max_async_level": 0,
            "sampling": {"max_tokens": 16},
        },
    }  # fmt: skip
    args = []
    for name, cfg in configs.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        args += [f"--{name}", str(path)]
    result = subprocess.run(
        [str(BIN / "grpo"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]

    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in trainer] == [0, 1, 2]
    assert all(r["loss"] == r["loss"] and abs(r["loss"]) < 1e3 for r in trainer)  # finite
    # vLLM's bf16 weights and the trainer's own copy of them score the same tokens alike at step 0.
    assert trainer[0]["mismatch_kl"] < 1e-2 and trainer[0]["masked"] == 0.0
    orch = read_jsonl(run_dir / "metrics.jsonl")
    # max_async_level 0: batch n is sampled from policy n, so each published full-weight policy reached vLLM.
    assert [r["policy/version"] for r in orch] == [0, 1, 2]
    # One file, or size-bounded shards where a larger model is published.
    final = run_dir / "broadcasts" / "step_3"
    assert (final / "config.json").exists() and list(final.glob("model*.safetensors"))
    assert "megatron parameters" in result.stderr  # the memory plan counts the trainer's own copy
    assert "borrowed" not in result.stderr
    # The engine core and its worker closed their shared-memory queues before they ended: none was
    # left for multiprocessing's resource tracker to remove (it warns "leaked shared_memory objects").
    assert "resource_tracker" not in result.stderr and "leaked" not in result.stderr
