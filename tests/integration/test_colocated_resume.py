"""`grpo` (one process) ended twice mid-run and resumed each time: every step trains and logs exactly
once, policies continue, the final policy exists.

1. The whole process is SIGKILLed; `ckpt.resume_step -1` on both sides resumes it.
2. The resumed run's vLLM engine process dies: the run ends with a non-zero code and no process
   left, prints the command that resumes it, and that command trains the remaining steps.

One chain instead of two runs from scratch: each start of the engine costs tens of seconds here.
The orchestrator's checkpoints run up to max_async_level + 1 steps ahead of the trainer's, and the
batches in between died with the process: both sides must resume from one step both checkpointed
(`grpo.orchestrator.checkpoint.resolve_colocated_resume`). `wait_for_weights_timeout` turns a
resume that waits for a policy that never comes into a failure instead of a hang.
"""

from __future__ import annotations

import json
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

from grpo.utils.atomic import is_stable
from grpo.utils.jsonl import read_jsonl

ColocatedArgs = Callable[..., list[str]]  # the colocated_args fixture (tests/conftest.py)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent
# The first run is killed after step 2 (a step or so more may land), the second after the step
# following the first run's last: enough steps must remain after that for the third run to train.
MAX_STEPS = 7


def start_run(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log_path.open("w") as log:
        return subprocess.Popen([str(BIN / "grpo"), *args], stdout=subprocess.DEVNULL, stderr=log, env=env)


def wait_for_trainer_step(
    run: subprocess.Popen[bytes], trainer_metrics: Path, step: int, log_path: Path
) -> None:
    deadline = time.monotonic() + 600
    while step not in metric_steps(trainer_metrics):
        assert run.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"the run did not reach step {step}"
        time.sleep(0.2)


def test_a_sigkilled_run_and_an_engine_crash_resume_without_skipping_or_repeating_a_step(
    colocated_args: ColocatedArgs, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    trainer_metrics = run_dir / "trainer_metrics.jsonl"
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

    # 1. SIGKILL of the whole process.
    first_log = tmp_path / "first.log"
    first = start_run(args, first_log, env)
    try:
        wait_for_trainer_step(first, trainer_metrics, 2, first_log)
        first.send_signal(signal.SIGKILL)  # the engine subprocess ends with its parent
    finally:
        first.kill()
        first.wait(timeout=60)
    last_step_of_first = max(metric_steps(trainer_metrics))

    # 2. The resumed run's engine dies after a step the first run never logged (so after its resume).
    second_log = tmp_path / "second.log"
    second = start_run(
        [*args, "--train.ckpt.resume_step", "-1", "--orch.ckpt.resume_step", "-1"], second_log, env
    )
    try:
        wait_for_trainer_step(second, trainer_metrics, last_step_of_first + 1, second_log)
        engine = next(
            p for p in psutil.Process(second.pid).children(recursive=True) if p.name() == "VLLM::EngineCore"
        )
        engine.send_signal(signal.SIGKILL)
        code = second.wait(timeout=180)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(timeout=60)
    stderr = second_log.read_text()
    assert "co-located resume from step" in stderr
    assert code == 1, stderr[-3000:]
    assert "the inference engine died" in stderr, stderr[-3000:]
    deadline = time.monotonic() + 30
    while (alive := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, f"processes survived the crash: {[(p.pid, p.name()) for p in alive]}"

    # 3. The printed command finishes the run.
    (command,) = [line.strip() for line in stderr.splitlines() if line.strip().startswith("cd ")]
    assert "--train.ckpt.resume_step -1" in command
    resumed = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=900, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "co-located resume from step" in resumed.stderr
    expected = list(range(MAX_STEPS))
    assert metric_steps(trainer_metrics) == expected
    assert metric_steps(run_dir / "metrics.jsonl") == expected
    versions = [row["policy/version"] for row in read_jsonl(run_dir / "metrics.jsonl")]
    assert versions == sorted(versions) and versions[-1] >= MAX_STEPS - 2  # max_async_level 1
    assert is_stable(run_dir / "broadcasts" / f"step_{MAX_STEPS}")
    state = json.loads(
        (run_dir / "checkpoints" / "trainer" / f"step_{MAX_STEPS}" / "trainer_state.json").read_text()
    )
    assert state["step"] == MAX_STEPS
