"""GSM8K reward functions written for TRL's GRPOTrainer; grpo calls them the same way.

Each gets the whole group: `completions` (one reply string per rollout, the prompts being plain
text), `answer` (GSM8K's solution column, one per rollout) and the rest as keyword arguments, and
returns one float per completion.
"""

from __future__ import annotations

import re
from typing import Any

from math_verify import parse, verify

BOXED = re.compile(r"\\boxed\{[^{}]+\}")


def _gold(solution: str) -> str:
    """GSM8K's final answer: the number after '####', thousands separators removed."""
    return solution.split("####")[-1].strip().replace(",", "")


def correctness(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the reply's final answer equals the solution's (math-verify), else 0.0."""
    rewards = []
    for completion, solution in zip(completions, answer, strict=True):
        # math-verify's own timeouts use signals, which work only in the main thread
        gold = parse(f"${_gold(solution)}$", parsing_timeout=None)
        pred = parse(completion, parsing_timeout=None)
        rewards.append(1.0 if verify(gold, pred, timeout_seconds=None) else 0.0)
    return rewards


def boxed_format(completions: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the reply puts exactly one final answer in \\boxed{...}."""
    return [1.0 if len(BOXED.findall(c)) == 1 else 0.0 for c in completions]
