"""grpo-infer, grpo-orch and a Megatron grpo-train on two torchrun ranks (tensor parallel 2), full
weights published over the filesystem (docs/multi_node.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mp_harness import (
    BIN,
    Launcher,
    free_port,
    infer_config,
    metric_steps,
    orch_config,
    train_config,
    wait_for_server,
    write_yaml,
)

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

RUN_TIMEOUT_S = 400.0


def test_a_tensor_parallel_megatron_trainer_under_torchrun_publishes_each_full_weight_policy_to_vllm(
    launcher: Launcher, tiny_llama_tp2_path: Path, tmp_path: Path
) -> None:
    model, run_dir, port = tiny_llama_tp2_path, tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}/v1"
    infer = infer_config(model, port, lora=False, weight_dir=tmp_path)
    infer["weight_broadcast_type"] = "filesystem"
    # Eager: on CPU vLLM would compile a full-weight engine (~25 s here); test_multi_process.py covers
    # full-weight policies reaching a compiled engine.
    infer["enforce_eager"] = True
    launcher.start("infer", "grpo-infer", write_yaml(tmp_path / "infer.yaml", infer))
    # Strictly on-policy: batch n is sampled from policy n, so every version must reach vLLM.
    orch = orch_config(model, run_dir, url, lora=False, max_async_level=0)
    train = train_config(
        model,
        run_dir,
        lora=False,
        backend="megatron",
        gpus=2,
        megatron={"tensor_model_parallel_size": 2},
        max_async_level=0,
        per_device_train_batch_size=1,
        logprob_chunk_size=64,
        # QeRL: each policy's norms file is applied after its full weights (policy 2's with sigma 0.01).
        noise_scheduler={"enabled": True, "num_stages": 2, "sigma_start": 0.01, "sigma_end": 0.01},
    )
    launcher.start("orch", "grpo-orch", write_yaml(tmp_path / "orch.yaml", orch))
    torchrun = (str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2")
    launcher.start("train", "grpo-train", write_yaml(tmp_path / "train.yaml", train), prefix=torchrun)
    wait_for_server(url, launcher.processes["infer"], tmp_path / "infer.log")
    launcher.wait_all(["orch", "train"], RUN_TIMEOUT_S)

    # One row per step: rank 1 trains in step with rank 0 but writes no row of its own.
    assert metric_steps(run_dir / "trainer_metrics.jsonl") == [0, 1, 2]
    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert all(abs(row["loss"]) < 1e3 for row in trainer)  # finite
    # vLLM's bf16 weights and the trainer's merged copy of the two ranks' halves score alike.
    assert trainer[0]["mismatch_kl"] < 1e-2
    orch_rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["policy/version"] for row in orch_rows] == [0, 1, 2]
    assert (run_dir / "broadcasts" / "step_3" / "model.safetensors").exists()
    assert launcher.log("infer").count('"POST /v1/grpo/update_weights HTTP/1.1" 200') == 2
    assert launcher.log("infer").count('"POST /v1/grpo/apply_noisy_norms HTTP/1.1" 200') == 2
    assert launcher.stop("infer") == 0
