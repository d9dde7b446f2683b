"""An `openenv:` env block for the shared co-located run (test_colocated_byo_tasks.py): multi-turn
rollouts that play a real OpenEnv server (openenv-core's own app, tests/openenv_fixtures.py) on
loopback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openenv_fixtures import MAX_GUESSES, WRONG, guess_server

from grpo.envs.server import BackgroundServer


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
    played = [r for r in orch_records if "reward/openenv/num_steps/mean" in r]
    assert played, [sorted(r) for r in orch_records]
    for record in orch_records:
        assert record["failed/num_rollouts"] == 0, record
    for record in played:
        assert 1.0 <= record["reward/openenv/num_steps/mean"] <= 2.0  # 1 when the first guess ended the game
        assert MAX_GUESSES * WRONG <= record["reward/openenv/env_reward/mean"] <= 1.0
