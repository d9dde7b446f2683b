"""An `openenv:` env block trains end to end: a co-located 2-step run on the tiny model whose multi-turn
rollouts play a real OpenEnv server (openenv-core's own app, tests/openenv_fixtures.py) on loopback.

`openenv_block` and `check_openenv_metrics` are the pieces a shared run with other env blocks reuses."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from openenv_fixtures import MAX_GUESSES, WRONG, guess_server

from grpo.envs.server import BackgroundServer
from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent


def openenv_block(tmp_path: Path) -> tuple[dict[str, Any], BackgroundServer]:
    """Start the guess-the-number OpenEnv server on a free loopback port and return the env block that
    plays it (name `openenv`, 2 examples, up to 2 model turns) with the server (stop() it when done)."""
    del tmp_path  # the server keeps its state in memory
    server = guess_server(max_concurrent_envs=8)
    address = server.start()
    block = {
        "id": f"openenv:http://{address}",
        "args": {
            "num_examples": 2,
            "max_turns": 2,
            "max_sessions": 8,
            "system_prompt": "Answer with a number.",
        },
    }
    return block, server


def check_openenv_metrics(orch_records: list[dict[str, Any]]) -> None:
    """Every rollout reached the server and came back scored by it. `failed/num_rollouts` counts the
    rollouts of every block, so a shared run must fail none; steps without an openenv group (a shared
    run samples blocks) are skipped, but one step at least must have one."""
    played = [r for r in orch_records if "reward/openenv/num_steps" in r]
    assert played, [sorted(r) for r in orch_records]
    for record in orch_records:
        assert record["failed/num_rollouts"] == 0, record
    for record in played:
        assert 1.0 <= record["reward/openenv/num_steps"] <= 2.0  # 1 when the first guess ended the game
        assert MAX_GUESSES * WRONG <= record["reward/openenv/env_reward"] <= 1.0


def test_an_openenv_block_trains_two_steps(tmp_path: Path, colocated_args: Callable[..., list[str]]) -> None:
    block, server = openenv_block(tmp_path)
    try:
        run_dir = tmp_path / "run"
        args = [*colocated_args(run_dir, max_steps=2), "--orch.env", json.dumps([block])]
        result = subprocess.run(
            [str(BIN / "grpo"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=900
        )
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    orch = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in orch] == [0, 1]
    assert [r["step"] for r in read_jsonl(run_dir / "trainer_metrics.jsonl")] == [0, 1]
    check_openenv_metrics(orch)
