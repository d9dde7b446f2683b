"""Exponential backoff between attempts of a request that may fail transiently (an inference server,
an LLM judge's endpoint)."""

from __future__ import annotations


def backoff_delay_s(attempt: int, base_s: float, max_s: float) -> float:
    """Seconds to wait after failed attempt `attempt` (counted from 0): base_s doubled per attempt,
    at most max_s."""
    return min(base_s * 2**attempt, max_s)
