"""A supervised grpo-infer server killed (SIGKILL) and frozen (SIGSTOP) in the middle of a
multi-process run: the supervisor restarts it, the orchestrator moves the requests in flight and
reloads the current policy into the restarted server, and the run trains every step exactly once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import mp_harness
import psutil
import pytest
from mp_harness import (
    Launcher,
    free_port,
    infer_config,
    orch_config,
    train_config,
    trainer_steps,
    wait_for_server,
    wait_for_trainer_step,
    write_yaml,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_STEPS = 6
STEP_TIMEOUT_S = 600.0
SUPERVISOR = {"enabled": True, "health_interval_s": 1.0, "health_timeout_s": 5.0}
RECOVERY = {"health_interval_s": 1.0, "health_timeout_s": 5.0, "deadline_s": 900.0}


def served_by(launcher: Launcher) -> psutil.Process:
    """The vLLM API server process the supervisor runs now."""
    (child,) = psutil.Process(launcher.processes["infer"].pid).children()
    return child


def test_a_killed_and_a_frozen_server_are_restarted_and_the_run_trains_every_step_once(
    launcher: Launcher, tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three restarts of vLLM in one test: on a shared 2-core machine one start can take minutes.
    monkeypatch.setattr(mp_harness, "SERVER_START_TIMEOUT_S", STEP_TIMEOUT_S * 2)
    run_dir = tmp_path / "run"
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    infer = infer_config(tiny_model_path, port, lora=True, weight_dir=tmp_path)
    launcher.start(
        "infer", "grpo-infer", write_yaml(tmp_path / "infer.yaml", {**infer, "supervisor": SUPERVISOR})
    )
    wait_for_server(url, launcher.processes["infer"], tmp_path / "infer.log")
    orch = orch_config(
        tiny_model_path,
        run_dir,
        url,
        lora=True,
        max_steps=MAX_STEPS,
        client={"base_url": [url], "timeout": 240, "recovery": RECOVERY},
    )
    launcher.start("orch", "grpo-orch", write_yaml(tmp_path / "orch.yaml", orch))
    launcher.start(
        "train",
        "grpo-train",
        write_yaml(
            tmp_path / "train.yaml", train_config(tiny_model_path, run_dir, lora=True, max_steps=MAX_STEPS)
        ),
    )

    wait_for_trainer_step(run_dir, 1, STEP_TIMEOUT_S, launcher)
    killed = served_by(launcher)
    killed.send_signal(signal.SIGKILL)  # like the OOM killer
    wait_for_trainer_step(run_dir, 3, STEP_TIMEOUT_S, launcher)
    frozen = served_by(launcher)
    assert frozen.pid != killed.pid
    os.kill(frozen.pid, signal.SIGSTOP)  # a hung server: the connection stays, nothing answers

    launcher.wait_all(["orch", "train"], STEP_TIMEOUT_S * 2)
    expected = list(range(MAX_STEPS))
    assert trainer_steps(run_dir) == expected
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == expected
    assert rows[-1]["pool/num_recoveries"] == 2
    assert rows[-1]["pool/num_servers"] == 1
    infer_log = launcher.log("infer")
    assert "exited with code -9; restart 1 of at most" in infer_log
    assert "hung: /health unanswered" in infer_log and "restart 2 of at most" in infer_log
    assert not psutil.pid_exists(frozen.pid) or frozen.status() == psutil.STATUS_ZOMBIE
    orch_log = launcher.log("orch")
    assert orch_log.count("takes requests again with the current policy") == 2
