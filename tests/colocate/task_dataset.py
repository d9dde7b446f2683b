"""A `- dataset:` env block for the shared co-located run (test_colocated_byo_tasks.py): rollouts scored
by two TRL-style reward functions, one sync and one async that passes (None) on some rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ENV_NAME = "task"

REWARDS = '''
import asyncio


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


def dataset_block(tmp_path: Path) -> dict[str, Any]:
    """Writes the dataset and its reward module into tmp_path (the run's working directory, on its
    PYTHONPATH) and returns the env block."""
    rows = [
        {"prompt": "Count to three.", "answer": "1 2 3", "kind": "scored"},
        {"prompt": "Say hello.", "answer": "hello", "kind": "skipped"},
    ]
    (tmp_path / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "task_rewards.py").write_text(REWARDS)
    return {
        "dataset": "task.jsonl",
        "name": ENV_NAME,
        "reward_funcs": ["task_rewards:length", "task_rewards:bonus"],
        "reward_weights": [1.0, 0.5],
    }


def check_dataset_metrics(orch_records: list[dict[str, Any]]) -> None:
    steps = [r for r in orch_records if f"reward/{ENV_NAME}/length/mean" in r]
    assert steps, f"no reward/{ENV_NAME} metrics"
    for record in steps:
        assert 0.0 < record[f"reward/{ENV_NAME}/length/mean"] <= 1.0
        # bonus scored only the 'scored' rows: its mean is over them, and is 1.0
        if f"reward/{ENV_NAME}/bonus/mean" in record:
            assert record[f"reward/{ENV_NAME}/bonus/mean"] == 1.0
