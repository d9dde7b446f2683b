"""A tool-calling env block trains end to end: a co-located 2-step run on the tiny model in which a
calculator tool is really called.

What is real: the vLLM server, the sampling of every token the model trains on, the hermes tool-call
parser (vLLM's, through grpo.orchestrator.rollouts.tool_calls), the tool runner calling `calc_tools.calculate`
in the run's own process, the tool message tokenised into the rollout (masked from the loss), the
model's second turn after it, TRL-style scoring of the group and two training steps on the
shared-prefix trainer. What is scripted: the tool call itself. The tiny random model never writes one,
so each prompt ends in an assistant message holding the call (a prefill): the model continues that
turn, and the parser reads the prefill together with what the model sampled, as it reads any prefilled
turn. The calls the tool received are written to a file, so the test sees them happen.

`tool_block` and `check_tool_metrics` are module-level so one shared co-located run can carry this
block beside others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOOLS = '''
import os


def calculate(expression: str) -> str:
    """Evaluate a sum of whole numbers.

    Args:
        expression: Whole numbers joined by +, e.g. "2 + 40".
    """
    with open(os.environ["CALC_TOOL_LOG"], "a") as log:
        log.write(expression + "\\n")
    return str(sum(int(part) for part in expression.split("+")))


def length(prompts, completions, completion_ids, **kwargs):
    """The share of the 16 allowed tokens the model's last turn used (any signal will do here)."""
    return [min(len(ids), 16) / 16 for ids in completion_ids]
'''

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 40"}}\n</tool_call>'

ENV_NAME = "calc"


def tool_block(tmp_path: Path) -> dict[str, Any]:
    """Writes the calculator module and its dataset into tmp_path (which must be the run's working
    directory and on its PYTHONPATH, with CALC_TOOL_LOG naming a file in the run's environment) and
    returns the env block."""
    (tmp_path / "calc_tools.py").write_text(TOOLS)
    rows = [
        {"prompt": [{"role": "user", "content": q}, {"role": "assistant", "content": CALL}], "answer": "42"}
        for q in ("What is 2 + 40?", "Add 2 and 40.")
    ]
    (tmp_path / "calc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "dataset": "calc.jsonl",
        "name": ENV_NAME,
        "reward_funcs": ["calc_tools:length"],
        "tools": ["calc_tools:calculate"],
        "max_turns": 2,
    }


def check_tool_metrics(orch_records: list[dict[str, Any]]) -> None:
    """Every step's rollouts of the block ran its prefilled call (one a rollout: the second turn's calls,
    if any, are past max_turns) and no call failed."""
    steps = [r for r in orch_records if f"tools/{ENV_NAME}/calls_per_rollout" in r]
    assert steps, f"no tools/{ENV_NAME} metrics in {sorted(orch_records[0])}"
    for record in steps:
        assert record[f"tools/{ENV_NAME}/calls_per_rollout"] == 1.0
        assert record[f"tools/{ENV_NAME}/num_errors"] == 0
        assert 0.0 < record[f"reward/{ENV_NAME}/length/mean"] <= 1.0
