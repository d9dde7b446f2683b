"""`grpo` (one process) whose vLLM engine process dies mid-run: the run ends with a non-zero code
and no process left, prints the command that resumes it, and that command trains the remaining
steps, each step once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from mp_harness import TAG_VAR, metric_steps, tagged_processes

ColocatedArgs = Callable[..., list[str]]  # the colocated_args fixture (tests/conftest.py)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent
MAX_STEPS = 5


def test_an_engine_crash_ends_the_run_cleanly_with_a_resume_command_that_finishes_it(
    colocated_args: ColocatedArgs, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = colocated_args(
        run_dir,
        max_steps=MAX_STEPS,
        max_async_level=1,
        ckpt={"interval": 1},
        orch_ckpt={"wait_for_weights_timeout": 120},
    )
    tag = uuid.uuid4().hex
    # The printed command names `grpo` as a user types it: from PATH.
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, TAG_VAR: tag, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "PATH": path}
    log_path = tmp_path / "first.log"
    with log_path.open("w") as log:
        first = subprocess.Popen([str(BIN / "grpo"), *args], stdout=subprocess.DEVNULL, stderr=log, env=env)
    try:
        deadline = time.monotonic() + 600
        while 1 not in metric_steps(run_dir / "trainer_metrics.jsonl"):
            assert first.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run did not reach step 1"
            time.sleep(0.2)
        engine = next(
            p for p in psutil.Process(first.pid).children(recursive=True) if p.name() == "VLLM::EngineCore"
        )
        engine.send_signal(signal.SIGKILL)
        code = first.wait(timeout=180)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=60)
    stderr = log_path.read_text()
    assert code == 1, stderr[-3000:]
    assert "the inference engine died" in stderr, stderr[-3000:]
    deadline = time.monotonic() + 30
    while (alive := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, f"processes survived the crash: {[(p.pid, p.name()) for p in alive]}"

    (command,) = [line.strip() for line in stderr.splitlines() if line.strip().startswith("cd ")]
    assert "--train.ckpt.resume_step -1" in command
    resumed = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=900, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "co-located resume from step" in resumed.stderr
    expected = list(range(MAX_STEPS))
    assert metric_steps(run_dir / "trainer_metrics.jsonl") == expected
    assert metric_steps(run_dir / "metrics.jsonl") == expected
