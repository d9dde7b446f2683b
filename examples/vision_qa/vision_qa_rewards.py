"""Reward functions for the visual questions in vision_qa.jsonl, written as for TRL's GRPOTrainer.

With an image column the prompts are chat messages (the image before the question), so each
completion is `[{"role": "assistant", "content": reply}]`, as TRL gives them for a vision-language
model; `answer` is the row's answer column, one entry per completion.
"""

from __future__ import annotations

import re
from typing import Any

ONE_WORD = re.compile(r"^\s*[A-Za-z]+\.?\s*$")


def _reply(completion: list[dict[str, str]]) -> str:
    return completion[0]["content"]


def _word(reply: str) -> str:
    return reply.strip().rstrip(".").lower()


def exact_match(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the reply is the answer (case and a final full stop aside), else 0.0."""
    return [float(_word(_reply(c)) == a) for c, a in zip(completions, answer, strict=True)]


def one_word(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 for a reply of one word, as the question asks, else 0.0."""
    return [float(bool(ONE_WORD.match(_reply(c)))) for c in completions]
