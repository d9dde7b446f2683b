"""Attempts of a request that may fail transiently (an inference server, an LLM judge's endpoint),
with tenacity: at most max_retries + 1 in all, exponential backoff between them (base_s doubled
after each failed attempt, at most max_s)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential


def attempts(
    max_retries: int,
    retry_on: Callable[[BaseException], bool],
    base_s: float,
    max_s: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> AsyncRetrying:
    """Calls an attempt (`await attempts(...)(attempt)`) until it returns, raises what `retry_on`
    refuses (as it is), or failed max_retries + 1 times (then tenacity.RetryError, holding the last
    failure); `sleep` waits out each backoff."""
    return AsyncRetrying(
        stop=stop_after_attempt(max_retries + 1),
        wait=wait_exponential(multiplier=base_s, max=max_s),
        retry=retry_if_exception(retry_on),
        sleep=sleep,
    )
