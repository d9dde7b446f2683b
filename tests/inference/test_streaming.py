"""InferenceClient.generate_interruptible against fake streaming servers (httpx.MockTransport): chunks
put together per choice, an interrupt that closes the stream and keeps what came, retries."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

import grpo.inference.retry as retry
from grpo.config.orchestrator import ClientConfig
from grpo.inference.client import InferenceClient, TransientServerError
from grpo.inference.types import ABORTED, GenerateRequest, SamplingParams

URL = "http://a/v1"


@pytest.fixture(autouse=True)
def no_backoff_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "RETRY_BASE_DELAY_S", 0.0)


def chunk(index: int, token_ids: list[int], finish_reason: str | None = None) -> bytes:
    choice = {
        "index": index,
        "text": "".join(f"<{t}>" for t in token_ids),
        "token_ids": token_ids,
        "logprobs": {"token_logprobs": [-t / 100 for t in token_ids]},
        "finish_reason": finish_reason,
    }
    return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()


def request(n: int = 2) -> GenerateRequest:
    return GenerateRequest([5, 6], SamplingParams(temperature=0.0, max_tokens=8), n=n, model="policy")


def make_client(handler: Callable[[httpx.Request], object]) -> InferenceClient:
    config = ClientConfig.model_validate({"base_url": [URL], "max_retries": 2})
    return InferenceClient(config, transport=httpx.MockTransport(handler))  # type: ignore[arg-type]


def test_streamed_chunks_make_each_choice_with_aligned_logprobs() -> None:
    bodies: list[dict[str, object]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(req.content))
        events = [
            chunk(0, [11]),
            chunk(1, [21, 22]),
            chunk(0, [12, 13], "stop"),
            chunk(1, [23], "length"),
            b"data: [DONE]\n\n",
        ]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(events))

    async def main() -> list:
        client = make_client(handler)
        try:
            return await client.generate_interruptible(request(), asyncio.Event())
        finally:
            await client.close()

    first, second = asyncio.run(main())
    assert (first.token_ids, first.logprobs, first.finish_reason) == (
        [11, 12, 13],
        [-0.11, -0.12, -0.13],
        "stop",
    )
    assert (second.token_ids, second.finish_reason, second.text) == ([21, 22, 23], "length", "<21><22><23>")
    (body,) = bodies
    assert body["stream"] is True and body["return_token_ids"] is True and body["logprobs"] == 0
    assert body["prompt"] == [5, 6] and body["n"] == 2


def test_an_interrupt_closes_the_stream_and_keeps_the_tokens_that_came() -> None:
    sent_two = asyncio.Event()
    closed = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield chunk(0, [11])
            yield chunk(1, [21], "stop")  # finished before the interrupt: not aborted
            yield chunk(0, [12])
            sent_two.set()
            await asyncio.Event().wait()  # the server goes on generating
            yield chunk(0, [13])
        finally:
            closed.set()

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    async def main() -> list:
        client = make_client(handler)
        interrupt = asyncio.Event()
        try:
            generation = asyncio.ensure_future(client.generate_interruptible(request(), interrupt))
            await asyncio.wait_for(sent_two.wait(), 5)
            interrupt.set()
            out = await asyncio.wait_for(generation, 5)
            await asyncio.wait_for(closed.wait(), 5)  # the connection is gone: vLLM aborts the request
            assert client.num_in_flight[URL] == 0
            return out
        finally:
            await client.close()

    first, second = asyncio.run(main())
    assert (first.token_ids, first.logprobs, first.finish_reason) == ([11, 12], [-0.11, -0.12], ABORTED)
    assert (second.token_ids, second.finish_reason) == ([21], "stop")


def test_an_interrupt_already_set_sends_nothing() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        raise AssertionError("no request expected")

    async def main() -> list:
        client = make_client(handler)
        interrupt = asyncio.Event()
        interrupt.set()
        try:
            return await client.generate_interruptible(request(), interrupt)
        finally:
            await client.close()

    assert [(c.token_ids, c.finish_reason) for c in asyncio.run(main())] == [([], ABORTED), ([], ABORTED)]


def test_a_server_error_is_retried_and_a_client_error_is_not() -> None:
    statuses = [503, 200]

    def handler(req: httpx.Request) -> httpx.Response:
        status = statuses.pop(0)
        if status != 200:
            return httpx.Response(status, text="busy")
        return httpx.Response(200, content=chunk(0, [7], "stop") + b"data: [DONE]\n\n")

    async def main(handler: Callable[[httpx.Request], httpx.Response]) -> list:
        client = make_client(handler)
        try:
            return await client.generate_interruptible(request(n=1), asyncio.Event())
        finally:
            await client.close()

    (only,) = asyncio.run(main(handler))
    assert only.token_ids == [7] and statuses == []
    with pytest.raises(RuntimeError, match="HTTP 400") as raised:
        asyncio.run(main(lambda req: httpx.Response(400, text="bad model")))
    assert not isinstance(raised.value, TransientServerError)
    with pytest.raises(TransientServerError, match="3 attempt"):
        asyncio.run(main(lambda req: httpx.Response(500, text="down")))


def test_a_stream_that_ends_without_finishing_a_choice_is_an_error_not_a_stop() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=chunk(0, [7]) + b"data: [DONE]\n\n")

    async def main() -> list:
        client = make_client(handler)
        try:
            return await client.generate_interruptible(request(n=1), asyncio.Event())
        finally:
            await client.close()

    with pytest.raises(RuntimeError, match="without a finish_reason"):
        asyncio.run(main())
