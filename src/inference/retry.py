"""Which failures of a request to an inference server are worth another attempt, and how long to
wait before it: exponential backoff from RETRY_BASE_DELAY_S, at most RETRY_MAX_DELAY_S."""

from __future__ import annotations

import httpx

from grpo.inference.recovery import ServerDownError
from grpo.utils.backoff import backoff_delay_s

RETRY_BASE_DELAY_S = 0.5
RETRY_MAX_DELAY_S = 8.0


class TransientServerError(RuntimeError):
    """A failure worth retrying (the server was unreachable, overloaded or crashed mid-request)."""


class ServerLeftError(TransientServerError):
    """A request addressed to one server failed after that server left the elastic pool."""


def backoff_s(attempt: int) -> float:
    """Seconds to wait after failed attempt `attempt` (counted from 0) before the next one."""
    return backoff_delay_s(attempt, RETRY_BASE_DELAY_S, RETRY_MAX_DELAY_S)


def server_gone(error: Exception) -> bool:
    """Whether a failed request says its server is gone (connection refused or dropped, or taken out
    by the health checks), not merely slow (a timeout) or failing (an HTTP error)."""
    if isinstance(error, ServerDownError):
        return True
    return isinstance(error, httpx.TransportError) and not isinstance(error, httpx.TimeoutException)
