"""A verifiers environment (`- id: <taskset id>`) trains end to end: a co-located 2-step run on the tiny
model whose rollouts are driven by the Env's own multi-turn `run` and scored by its task's weighted
rewards, each logged as its own metric.

`verifiers_block` and `check_verifiers_metrics` are separate so one shared run can carry this block
beside others."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

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
    steps = [r for r in orch_records if f"reward/{ENV_ID}/mean" in r]
    assert steps, f"no reward/{ENV_ID} metrics"
    for record in steps:
        assert 0.0 < record[f"reward/{ENV_ID}/length/mean"] <= 1.0
        # the tiny model's replies mostly run to the token limit, which ends a rollout after its first
        # turn (the env's second turn then comes back terminated): both values are possible here
        assert 0.0 <= record[f"reward/{ENV_ID}/two_turns/mean"] <= 1.0
        # the reward is the weighted sum of the task's rewards (means of a sum: the sum of the means)
        expected = record[f"reward/{ENV_ID}/length/mean"] + 0.5 * record[f"reward/{ENV_ID}/two_turns/mean"]
        assert record[f"reward/{ENV_ID}/mean"] == pytest.approx(expected)
