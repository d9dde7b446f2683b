"""A `- dataset:` env block trains end to end: a co-located 2-step run on the tiny model whose rollouts
are scored by two TRL-style reward functions (one sync, one async that passes on some rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent

REWARDS = '''
import asyncio

CALLS = []


def length(prompts, completions, completion_ids, **kwargs):
    """Sync: the share of the 16 allowed tokens the completion used."""
    assert len(prompts) == len(completions) == len(completion_ids) == len(kwargs["answer"])
    assert all(isinstance(c, str) for c in completions)
    return [len(ids) / 16 for ids in completion_ids]


async def bonus(completions, kind, **kwargs):
    """Async: 1.0 on 'scored' rows, not applicable (None) on 'skipped' ones."""
    await asyncio.sleep(0)
    return [1.0 if k == "scored" else None for k in kind]
'''


def test_a_dataset_block_with_two_reward_functions_trains_two_steps(
    tmp_path: Path, colocated_args: Callable[..., list[str]]
) -> None:
    rows = [
        {"prompt": "Count to three.", "answer": "1 2 3", "kind": "scored"},
        {"prompt": "Say hello.", "answer": "hello", "kind": "skipped"},
    ]
    (tmp_path / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "task_rewards.py").write_text(REWARDS)
    block = {
        "dataset": "task.jsonl",
        "reward_funcs": ["task_rewards:length", "task_rewards:bonus"],
        "reward_weights": [1.0, 0.5],
    }
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
        assert 0.0 < record["reward/task/length/mean"] <= 1.0
        # bonus scored only the 'scored' rows: its mean is over them, and is 1.0
        if "reward/task/bonus/mean" in record:
            assert record["reward/task/bonus/mean"] == 1.0
    # 2 examples x 2 steps, 2 groups a step: both kinds of rows were sampled at least once
    assert any("reward/task/bonus/mean" in r for r in orch)
