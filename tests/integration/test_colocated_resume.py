"""`grpo` (one process) killed with SIGKILL mid-run and resumed with ckpt.resume_step -1 on both
sides: every step trains and logs exactly once, policies continue, the final policy exists.

The orchestrator's checkpoints run up to max_async_level + 1 steps ahead of the trainer's, and the
batches in between died with the process: both sides must resume from one step both checkpointed
(`grpo.orchestrator.checkpoint.resolve_colocated_resume`). `wait_for_weights_timeout` turns a
resume that waits for a policy that never comes into a failure instead of a hang.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mp_harness import metric_steps

from grpo.utils.atomic import is_stable
from grpo.utils.jsonl import read_jsonl

ColocatedArgs = Callable[..., list[str]]  # the colocated_args fixture (tests/conftest.py)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent
MAX_STEPS = 5


def test_sigkilled_colocated_run_resumes_without_skipping_or_repeating_a_step(
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
    log_path = tmp_path / "first.log"
    with log_path.open("w") as log:
        first = subprocess.Popen([str(BIN / "grpo"), *args], stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 600
        while 2 not in metric_steps(run_dir / "trainer_metrics.jsonl"):
            assert first.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run did not reach step 2"
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)  # the engine subprocess ends with its parent
    finally:
        first.kill()
        first.wait(timeout=60)

    resumed = subprocess.run(
        [str(BIN / "grpo"), *args, "--train.ckpt.resume_step", "-1", "--orch.ckpt.resume_step", "-1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "co-located resume from step" in resumed.stderr
    expected = list(range(MAX_STEPS))
    assert metric_steps(run_dir / "trainer_metrics.jsonl") == expected
    assert metric_steps(run_dir / "metrics.jsonl") == expected
    versions = [row["policy/version"] for row in read_jsonl(run_dir / "metrics.jsonl")]
    assert versions == sorted(versions) and versions[-1] >= MAX_STEPS - 2  # max_async_level 1
    assert is_stable(run_dir / "broadcasts" / f"step_{MAX_STEPS}")
    state = json.loads(
        (run_dir / "checkpoints" / "trainer" / f"step_{MAX_STEPS}" / "trainer_state.json").read_text()
    )
    assert state["step"] == MAX_STEPS
