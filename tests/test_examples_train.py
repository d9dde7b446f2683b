"""The examples that run on a CPU train two steps with the command their README shows (from the
repository root, with any environment variables it sets), at smaller sizes: two groups of four replies a step, 24
tokens each. The openenv example's server runs on a free port instead of its README's 8001."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from documented_commands import REPO, Command, documented_commands

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent
CPU_EXAMPLES = ["minimal", "gsm8k", "tool_calculator", "multi_turn", "verifiers", "openenv", "llm_judge"]
SMALL = [
    *("--orch.max_steps", "2", "--orch.batch_size", "8", "--orch.rollouts_per_example", "4"),
    *("--orch.sampling.max_tokens", "24", "--infer.port", "0"),
]


def _readme_command(example: str) -> Command:
    commands = documented_commands(REPO / "examples" / example / "README.md")
    return next(c for c in commands if f"examples/{example}/rl.yaml" in c.argv)


@pytest.mark.parametrize("example", CPU_EXAMPLES)
def test_example_trains_two_steps_as_its_readme_runs_it(example: str, tmp_path: Path) -> None:
    command = _readme_command(example)
    run_dir = tmp_path / "run"
    args = [*command.argv[1:], *SMALL, "--orch.output_dir", str(run_dir)]
    server = None
    if example == "openenv":
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, "examples/openenv/word_server.py", "--port", str(port)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for_port(port)
        args += ["--orch.env.0.id", f"openenv:http://127.0.0.1:{port}"]
    try:
        result = subprocess.run(
            [str(BIN / command.argv[0]), *args],
            cwd=REPO,
            env={**os.environ, **command.env},
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    assert result.returncode == 0, result.stderr[-3000:]
    orch = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]  # not eval rows
    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in orch] == [0, 1]
    assert [r["step"] for r in trainer] == [0, 1]
    assert all(math.isfinite(r["reward/mean"]) for r in orch), orch
    assert all(r["failed/num_rollouts"] == 0 for r in orch), orch
    assert all(math.isfinite(r["loss"]) for r in trainer), trainer


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"the example's server did not listen on port {port} within {timeout_s:.0f} s")
