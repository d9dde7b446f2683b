"""A generation stopped mid-stream and resumed token in on the real vLLM server (tiny model, CPU) is the
generation that was never stopped, and vLLM aborts the stopped request."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from grpo.config.orchestrator import ClientConfig
from grpo.inference.client import InferenceClient
from grpo.inference.server import ServerThread
from grpo.inference.types import ABORTED, Completion, GenerateRequest, SamplingParams

pytestmark = pytest.mark.vllm

MODEL = "tiny"
PROMPT = [1, 504, 3458, 282, 4195, 314, 260, 3436, 28, 1159]
NUM_TOKENS = 48
STOP_AFTER_CHUNKS = 12
RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", re.MULTILINE)


class InterruptAfter(httpx.AsyncBaseTransport):
    """Sets `interrupt` once a streamed response has delivered `num_chunks` server-sent events."""

    def __init__(self, interrupt: asyncio.Event, num_chunks: int) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.interrupt = interrupt
        self.num_chunks = num_chunks

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        inner_stream = response.stream
        assert isinstance(inner_stream, httpx.AsyncByteStream)
        interrupt, num_chunks = self.interrupt, self.num_chunks

        class Counting(httpx.AsyncByteStream):
            async def __aiter__(self):  # type: ignore[no-untyped-def]
                seen = 0
                async for part in inner_stream:
                    seen += part.count(b"data: ")
                    yield part
                    if seen >= num_chunks:
                        interrupt.set()

            async def aclose(self) -> None:
                await inner_stream.aclose()

        return httpx.Response(response.status_code, headers=response.headers, stream=Counting())

    async def aclose(self) -> None:
        await self.inner.aclose()


def _request(prompt: list[int], max_tokens: int, salt: str) -> GenerateRequest:
    # ignore_eos: the random tiny model may end early, and the seam should fall mid-generation
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return GenerateRequest(prompt, params, model=MODEL, cache_salt=salt, extra={"ignore_eos": True})


async def _num_running(http: httpx.AsyncClient, server: ServerThread) -> float:
    text = (await http.get(server.base_url.removesuffix("/v1") + "/metrics")).text
    values = RUNNING.findall(text)
    assert values, "vLLM's /metrics lists no vllm:num_requests_running"
    return sum(float(value) for value in values)


def test_a_generation_stopped_and_resumed_at_temperature_0_equals_an_uninterrupted_one(
    vllm_server: ServerThread,
) -> None:
    async def main() -> tuple[Completion, Completion, Completion, float]:
        cfg = ClientConfig(base_url=[vllm_server.base_url], max_retries=0, timeout=120)
        whole_client = InferenceClient(cfg)
        interrupt = asyncio.Event()
        stopping_client = InferenceClient(cfg, transport=InterruptAfter(interrupt, STOP_AFTER_CHUNKS))
        try:
            (whole,) = await whole_client.generate_interruptible(
                _request(PROMPT, NUM_TOKENS, "whole"), asyncio.Event()
            )
            # stopped far from its end (400 tokens): still running on the server unless it was aborted
            (kept,) = await stopping_client.generate_interruptible(_request(PROMPT, 400, "first"), interrupt)
            deadline = time.monotonic() + 10
            async with httpx.AsyncClient() as http:
                while (running := await _num_running(http, vllm_server)) > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            request = _request(PROMPT + kept.token_ids, NUM_TOKENS - len(kept.token_ids), "resumed")
            (rest,) = await whole_client.generate_interruptible(request, asyncio.Event())
            return whole, kept, rest, running
        finally:
            await whole_client.close()
            await stopping_client.close()

    whole, kept, rest, running = asyncio.run(main())
    assert whole.finish_reason == "length" and len(whole.token_ids) == NUM_TOKENS
    assert kept.finish_reason == ABORTED and 0 < len(kept.token_ids) < NUM_TOKENS
    assert running == 0  # the closed stream's request was aborted, not left generating
    assert rest.finish_reason == "length"
    assert kept.token_ids + rest.token_ids == whole.token_ids
    resumed_logprobs = kept.logprobs + rest.logprobs
    assert max(abs(a - b) for a, b in zip(resumed_logprobs, whole.logprobs, strict=True)) < 1e-3
