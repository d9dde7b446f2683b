"""How attempts of a request to an inference server follow each other (grpo.inference.retry)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from tenacity import RetryError

from grpo.inference.recovery import ServerDownError
from grpo.inference.retry import ServerLeftError, TransientServerError, attempts, worth_retry


def test_backoff_doubles_from_half_a_second_up_to_eight_and_attempts_are_max_retries_plus_one() -> None:
    waits: list[float] = []
    num_calls = 0

    async def record(seconds: float) -> None:
        waits.append(seconds)

    async def failing() -> None:
        nonlocal num_calls
        num_calls += 1
        raise TransientServerError("HTTP 503")

    with pytest.raises(RetryError) as gave_up:
        asyncio.run(attempts(7, sleep=record)(failing))
    assert num_calls == 8
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert isinstance(gave_up.value.last_attempt.exception(), TransientServerError)


def test_a_failure_not_worth_a_retry_is_raised_as_it_is_at_once() -> None:
    num_calls = 0

    async def refused() -> None:
        nonlocal num_calls
        num_calls += 1
        raise RuntimeError("HTTP 400")

    with pytest.raises(RuntimeError, match="HTTP 400"):
        asyncio.run(attempts(3, sleep=lambda s: asyncio.sleep(0))(refused))
    assert num_calls == 1


def test_worth_retry_takes_connection_server_and_health_check_failures_not_a_server_that_left() -> None:
    request = httpx.Request("POST", "http://a/v1/completions")
    assert worth_retry(httpx.ConnectError("refused", request=request))
    assert worth_retry(httpx.ReadTimeout("slow", request=request))
    assert worth_retry(TransientServerError("HTTP 429"))
    assert worth_retry(ServerDownError("taken out"))
    assert not worth_retry(ServerLeftError("left the pool"))
    assert not worth_retry(RuntimeError("HTTP 400"))
