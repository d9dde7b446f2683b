"""`run_server` as a whole process (what `grpo-infer` runs): how it ends, and that nothing survives it.

A SIGTERM to `grpo-infer` (exit 0, "inference server stopped (exit code 0)", no process left) is
checked at the end of tests/integration/test_multi_process.py's full-weight run, which has two
servers to stop anyway: one engine start fewer than a server of its own here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from free_ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SERVE = "import sys; from grpo.config.inference import InferenceConfig; from grpo.inference.server import run_server; sys.exit(run_server(InferenceConfig.model_validate_json(sys.argv[1])))"


def start_server(model_path: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    from grpo.config.inference import InferenceConfig

    cfg = InferenceConfig(
        model=str(model_path), port=port, kv_cache_space_gb=1, max_model_len=256, max_num_seqs=8
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE, cfg.model_dump_json()], stdout=log, stderr=log, env=env
        )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert process.poll() is None, f"server exited during start-up: {log_path.read_text()[-3000:]}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise TimeoutError("server not up in 300 s")


def descendants(pid: int) -> list[psutil.Process]:
    return list(psutil.Process(pid).children(recursive=True))


def assert_all_gone(processes: list[psutil.Process], within_s: float = 15.0) -> None:
    _gone, alive = psutil.wait_procs(processes, timeout=within_s)
    assert not alive, f"processes survived the server: {[(p.pid, p.name()) for p in alive]}"


def test_engine_death_makes_the_server_exit_nonzero_leaving_no_process(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    process = start_server(tiny_model_path, free_port(), tmp_path / "server.log")
    try:
        children = descendants(process.pid)
        engine = next(p for p in children if p.name() == "VLLM::EngineCore")
        engine.send_signal(signal.SIGKILL)
        exit_code = process.wait(timeout=60)
        assert exit_code != 0
        assert_all_gone(children)
        assert "engine process died" in (tmp_path / "server.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()
