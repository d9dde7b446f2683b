"""Judges and group rewards train end to end: a co-located 2-step run on the tiny model whose env has a
@group_reward function (a rank over the group) and an LLM judge served by the run's own vLLM server
(`base_url: self`). The tiny model's verdicts are noise: the judge's parse is lenient (a digit anywhere
scores 1) and only that it was called and produced values is checked, not their quality.

`judge_block(tmp_path)` and `check_judge_metrics(records)` let one shared run carry this env beside
others: write the block into its env list, then check its orchestrator metrics."""

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

ENV_NAME = "judged"

TASK = '''
from grpo.envs import SingleTurnEnv, group_reward


@group_reward
def rank(completions, completion_ids):
    """Each completion's rank by length within its group, scaled to [0, 1]."""
    order = sorted(range(len(completions)), key=lambda i: len(completion_ids[i]))
    ranks = [0.0] * len(completions)
    for position, i in enumerate(order):
        ranks[i] = position / max(1, len(completions) - 1)
    return ranks


def load_environment():
    examples = [{"prompt": "Count to three.", "answer": "1 2 3"}, {"prompt": "Say hello.", "answer": "hello"}]
    return SingleTurnEnv(examples, [rank])
'''


def judge_block(tmp_path: Path) -> dict[str, Any]:
    """The env block (its loader module written into tmp_path, which must be on PYTHONPATH)."""
    (tmp_path / "judged_task.py").write_text(TASK)
    return {
        "id": "judged_task:load_environment",
        "name": ENV_NAME,
        "judge": {
            "prompt": "Question: {prompt}\nReply: {completion}\nScore the reply from 0 to 9.",
            "max_tokens": 8,
            "parse": r"match:\d",
            "weight": 0.5,
        },
    }


def check_judge_metrics(orch_records: list[dict[str, Any]]) -> None:
    """Every step scored this env's rollouts with both the group reward and the judge."""
    for record in orch_records:
        assert record["failed/num_rollouts"] == 0, record
        rank = record[f"reward/{ENV_NAME}/rank/mean"]
        judge = record[f"reward/{ENV_NAME}/judge/mean"]
        assert 0.0 <= rank <= 1.0 and 0.0 <= judge <= 1.0, record


def test_a_group_reward_and_a_judge_on_the_runs_own_server_train_two_steps(
    tmp_path: Path, colocated_args: Callable[..., list[str]]
) -> None:
    block = judge_block(tmp_path)
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
    check_judge_metrics(orch)
