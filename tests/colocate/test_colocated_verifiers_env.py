"""A verifiers environment (`- id: <taskset id>`) trains end to end: a co-located 2-step run on the tiny
model whose rollouts are driven by the Env's own multi-turn `run` and scored by its task's weighted
rewards, each logged as its own metric.

`verifiers_block` and `check_verifiers_metrics` are separate so one shared run can carry this block
beside others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent

ENV_ID = "vf-colocated-echo"

TASKSET = '''
import asyncio

import verifiers.v1 as vf


class EchoConfig(vf.TasksetConfig):
    num_rows: int = 2


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def length(self, trace) -> float:
        """The share of the 16 allowed tokens' worth of characters the last reply used."""
        return min(len(trace.last_reply) / 64, 1.0)

    @vf.reward(weight=0.5)
    async def two_turns(self, trace) -> float:
        await asyncio.sleep(0)
        return float(trace.num_turns == 2)


class EchoEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class EchoEnv(vf.Env[EchoEnvConfig]):
    """The model answers, the env asks once more, the model answers again."""

    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated:
                await interaction.turn("Say it again.")


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        words = ["apple", "river", "stone"]
        for i in range(self.config.num_rows):
            yield EchoTask(EchoData(prompt=f"Say {words[i]}.", answer=words[i]), self.config.task)


__all__ = ["EchoEnv", "EchoTaskset"]
'''


def verifiers_block(tmp_path: Path) -> dict[str, Any]:
    """Writes the taskset package into tmp_path (which must be on the run's PYTHONPATH) and returns
    its env block."""
    (tmp_path / f"{ENV_ID.replace('-', '_')}.py").write_text(TASKSET)
    return {"id": ENV_ID, "args": {"num_rows": 2}}


def check_verifiers_metrics(orch_records: list[dict[str, Any]]) -> None:
    for record in orch_records:
        assert 0.0 < record[f"reward/{ENV_ID}/length/mean"] <= 1.0
        # the tiny model's replies mostly run to the token limit, which ends a rollout after its first
        # turn (the env's second turn then comes back terminated): both values are possible here
        assert 0.0 <= record[f"reward/{ENV_ID}/two_turns/mean"] <= 1.0
        # the reward is the weighted sum of the task's rewards (means of a sum: the sum of the means)
        expected = record[f"reward/{ENV_ID}/length/mean"] + 0.5 * record[f"reward/{ENV_ID}/two_turns/mean"]
        assert record[f"reward/{ENV_ID}/mean"] == pytest.approx(expected)


def test_a_verifiers_environment_trains_two_steps(
    tmp_path: Path, colocated_args: Callable[..., list[str]]
) -> None:
    block = verifiers_block(tmp_path)
    run_dir = tmp_path / "run"
    args = [*colocated_args(run_dir, max_steps=2), "--orch.env", json.dumps([block])]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [str(BIN / "grpo"), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]

    orch = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in orch] == [0, 1]
    assert [r["step"] for r in read_jsonl(run_dir / "trainer_metrics.jsonl")] == [0, 1]
    for record in orch:
        assert record["failed/num_rollouts"] == 0
    check_verifiers_metrics(orch)
