"""Failed rollouts in a co-located run (tiny model, 2 steps of 2 prompts x 4 rollouts): an environment
whose reset raises for 1 rollout in 4 trains with orch advantage.on_rollout_failure exclude (each
group's advantages, as the run's rollout log holds them, are grpo's computed by hand from its 3
finished rollouts, and the trainer trains on those only) and with drop_group (every group is dropped;
the trainer still takes both steps, with nothing to train)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from grpo.orchestrator.reporting.rollout_log import read_rollouts, rollouts_file
from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent
GROUP_SIZE = 4
ENV_MODULE = '''
from grpo.envs import SingleTurnEnv


class FlakyEnv(SingleTurnEnv):
    """reset raises for the second of every 4 rollouts it starts (a group's resets run one after
    another); the others are rewarded their start index mod 4, over 4."""

    def __init__(self):
        super().__init__(examples=[{"prompt": "Count to three."}, {"prompt": "Say hello."}],
                         rewards=[self.indexed], name="flaky")
        self.num_resets = 0

    async def reset(self, example):
        index, self.num_resets = self.num_resets, self.num_resets + 1
        if index % 4 == 1:
            raise RuntimeError("the sandbox did not start")
        return {"index": index}

    @staticmethod
    def indexed(state):
        return state["index"] % 4 / 4


def load_environment():
    return FlakyEnv()
'''


def _run(tmp_path: Path, colocated_args: Callable[..., list[str]], rule: str) -> Path:
    (tmp_path / "flaky_env.py").write_text(ENV_MODULE)
    run_dir = tmp_path / "run"
    args = [
        *colocated_args(run_dir, max_steps=2),
        "--orch.env",
        json.dumps([{"id": "flaky_env:load_environment"}]),
        "--orch.advantage.type",
        "grpo",
        "--orch.advantage.on_rollout_failure",
        rule,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [str(BIN / "grpo"), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run_dir / "trainer_metrics.jsonl")] == [0, 1]
    return run_dir


def _groups(run_dir: Path) -> list[list[dict[str, Any]]]:
    """Every logged group's rollout records (the log keeps the batch's order, a group's together)."""
    groups = []
    for step in range(2):
        records = read_rollouts(rollouts_file(run_dir, step))
        groups += [records[i : i + GROUP_SIZE] for i in range(0, len(records), GROUP_SIZE)]
    assert len(groups) == 4
    for group in groups:
        raised = [r for r in group if "reset raised RuntimeError" in str(r["failure"])]
        assert len(raised) == 1, group
    return groups


def test_exclude_trains_each_group_on_advantages_from_its_finished_rollouts(
    tmp_path: Path, colocated_args: Callable[..., list[str]]
) -> None:
    run_dir = _run(tmp_path, colocated_args, "exclude")
    for group in _groups(run_dir):
        finished = [r for r in group if r["failure"] is None]
        assert len(finished) == 3
        rewards = np.array([r["reward"] for r in finished])
        expected = (rewards - rewards.mean()) / rewards.std(ddof=1)
        assert [r["advantage"] for r in finished] == pytest.approx(expected.tolist(), abs=1e-9)
        assert [r["advantage"] for r in group if r["failure"] is not None] == [0.0]
    orch = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["rollouts/num_failed"] for r in orch] == [2, 2]
    assert [r["failed/num_groups"] for r in orch] == [0, 0]
    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert all(r["tokens"] > 0 and r["grad_norm"] > 0 for r in trainer), trainer


def test_drop_group_drops_every_group_with_a_failed_rollout(
    tmp_path: Path, colocated_args: Callable[..., list[str]]
) -> None:
    run_dir = _run(tmp_path, colocated_args, "drop_group")
    for group in _groups(run_dir):
        assert all(r["failure"] is not None and r["advantage"] == 0.0 for r in group), group
    orch = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["rollouts/num_failed"] for r in orch] == [2, 2]
    assert [r["failed/num_groups"] for r in orch] == [2, 2]
    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert all(r["tokens"] == 0 for r in trainer), trainer
