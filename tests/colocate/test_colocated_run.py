"""The one-shot command end to end on a tiny model: 3 steps, on-policy, clean exit, no orphans."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent


def _write_configs(folder: Path, model: Path, run_dir: Path, max_async_level: int) -> list[str]:
    train = {
        "model": str(model), "output_dir": str(run_dir), "sequence_len": 256, "max_steps": 3,
        "learning_rate": 1e-3, "optimizer": "adamw", "lora_rank": 8, "lora_alpha": 16,
        "per_device_train_batch_size": 1, "max_async_level": max_async_level,
    }  # fmt: skip
    infer = {"model": str(model), "max_lora_rank": 8, "max_model_len": 256, "max_num_seqs": 16, "port": 0}
    orch = {
        "model": {"lora_rank": 8, "lora_alpha": 16}, "output_dir": str(run_dir), "batch_size": 8,
        "rollouts_per_example": 4, "seq_len": 256, "max_steps": 3, "max_async_level": max_async_level,
        "sampling": {"max_tokens": 16},
    }  # fmt: skip
    args = []
    for name, cfg in (("train", train), ("infer", infer), ("orch", orch)):
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        args += [f"--{name}", str(path)]
    return args


def _processes_with_marker(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("GRPO_TEST_MARKER") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _shm_files() -> set[str]:
    """Shared-memory files (RAM) of torch and vLLM; a run must remove the ones it creates."""
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(("torch_", "psm_"))}


def _shm_files_left(before: set[str], wait_s: float = 30.0) -> set[str]:
    """New shared-memory files still there after `wait_s`: multiprocessing's resource tracker
    unlinks vLLM's message-queue buffers just after the run's last process exits."""
    import time

    deadline = time.monotonic() + wait_s
    while (left := _shm_files() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_one_shot_run_trains_on_policy_and_leaves_nothing_behind(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = _write_configs(tmp_path, tiny_model_path, run_dir, max_async_level=0)
    marker = uuid.uuid4().hex
    env = {**os.environ, "GRPO_TEST_MARKER": marker}
    shm_before = _shm_files()
    result = subprocess.run(
        [str(BIN / "grpo"), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not _processes_with_marker(marker), "a child process outlived the run"
    assert not _shm_files_left(shm_before), "the run left shared-memory files in /dev/shm"

    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in trainer] == [0, 1, 2]
    # Same weights, same temperature: the trainer reproduces vLLM's logprobs at step 0.
    assert trainer[0]["kl"] < 1e-3 and trainer[0]["masked"] == 0.0
    orch = read_jsonl(run_dir / "metrics.jsonl")
    # max_async_level 0: batch n is sampled from policy n, so each step's adapter reached vLLM.
    assert [r["policy/version"] for r in orch] == [0, 1, 2]
    assert all(r["off_policy/max_lag"] == 0 for r in orch)
    assert (run_dir / "broadcasts" / "step_3" / "STABLE").exists()
    assert "borrowed 14 base weights" in result.stderr
    for name in ("train", "infer", "orch"):
        assert (run_dir / "configs" / f"{name}.yaml").exists()


def test_one_shot_dry_run_prints_the_memory_plan(tmp_path: Path, tiny_model_path: Path) -> None:
    args = _write_configs(tmp_path, tiny_model_path, tmp_path / "run", max_async_level=1)
    result = subprocess.run(
        [str(BIN / "grpo"), *args, "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "memory plan (cpu" in result.stdout and "kv_cache_space_gb" in result.stdout
    assert not (tmp_path / "run").exists(), "a dry run must not create the run directory"


def test_sigterm_mid_run_ends_every_process(tmp_path: Path, tiny_model_path: Path) -> None:
    import signal
    import time

    run_dir = tmp_path / "run"
    args = _write_configs(tmp_path, tiny_model_path, run_dir, max_async_level=1)
    args += ["--orch.max_steps", "1000", "--train.max_steps", "1000"]
    marker = uuid.uuid4().hex
    env = {**os.environ, "GRPO_TEST_MARKER": marker}
    shm_before = _shm_files()
    proc = subprocess.Popen(
        [str(BIN / "grpo"), *args], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 480
        metrics = run_dir / "trainer_metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, "grpo exited before training started"
            assert time.monotonic() < deadline, "no training step within the time limit"
            time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    time.sleep(1)
    assert not _processes_with_marker(marker), "SIGTERM left a process behind"
    assert not _shm_files_left(shm_before), "SIGTERM left shared-memory files in /dev/shm"
