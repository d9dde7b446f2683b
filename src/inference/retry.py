"""Which failures of a request to an inference server are worth another attempt, and how attempts
follow each other (tenacity): at most max_retries + 1 in all, exponential backoff from
RETRY_BASE_DELAY_S between them, at most RETRY_MAX_DELAY_S."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
from tenacity import AsyncRetrying

from grpo.inference.recovery import ServerDownError
from grpo.utils import backoff

RETRY_BASE_DELAY_S = 0.5
RETRY_MAX_DELAY_S = 8.0


class TransientServerError(RuntimeError):
    """A failure worth retrying (the server was unreachable, overloaded or crashed mid-request)."""


class ServerLeftError(TransientServerError):
    """A request addressed to one server failed after that server left the elastic pool."""


def worth_retry(error: BaseException) -> bool:
    """A connection that failed or dropped, an overloaded or failing server (429, 5xx: raised as
    TransientServerError), a server taken out by the health checks; not one that left the pool
    (the request ends there: ServerLeftError)."""
    return isinstance(
        error, httpx.TransportError | TransientServerError | ServerDownError
    ) and not isinstance(error, ServerLeftError)


def attempts(
    max_retries: int,
    retry_on: Callable[[BaseException], bool] = worth_retry,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> AsyncRetrying:
    """grpo.utils.backoff.attempts with this module's backoff (read at each call: tests set the
    base to 0)."""
    return backoff.attempts(max_retries, retry_on, RETRY_BASE_DELAY_S, RETRY_MAX_DELAY_S, sleep)


def server_gone(error: Exception) -> bool:
    """Whether a failed request says its server is gone (connection refused or dropped, or taken out
    by the health checks), not merely slow (a timeout) or failing (an HTTP error)."""
    if isinstance(error, ServerDownError):
        return True
    return isinstance(error, httpx.TransportError) and not isinstance(error, httpx.TimeoutException)
