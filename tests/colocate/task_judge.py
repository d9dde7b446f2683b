"""Judges and group rewards train end to end: a co-located 2-step run on the tiny model whose env has a
@group_reward function (a rank over the group) and an LLM judge served by the run's own vLLM server
(`base_url: self`). The tiny model's verdicts are noise: the judge's parse is lenient (a digit anywhere
scores 1) and only that it was called and produced values is checked, not their quality.

`judge_block(tmp_path)` and `check_judge_metrics(records)` let one shared run carry this env beside
others: write the block into its env list, then check its orchestrator metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    """Every step that sampled this env scored its rollouts with both the group reward and the judge."""
    steps = [r for r in orch_records if f"reward/{ENV_NAME}/mean" in r]
    assert steps, f"no reward/{ENV_NAME} metrics"
    for record in steps:
        rank = record[f"reward/{ENV_NAME}/rank/mean"]
        judge = record[f"reward/{ENV_NAME}/judge/mean"]
        assert 0.0 <= rank <= 1.0 and 0.0 <= judge <= 1.0, record
