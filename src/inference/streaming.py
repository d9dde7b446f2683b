"""Streamed completions that can be stopped part-way with what was generated so far.

A partial rollout (orch `partial_rollouts`) must stop at a policy update without losing its tokens.
A plain request returns nothing until it finishes, so these requests stream (`stream: true`): every
chunk vLLM sends carries the new token ids and their logprobs, and closing the connection makes
vLLM abort the request (its server aborts a request whose client disconnected). Chunks are applied
whole, so the tokens and logprobs kept are aligned and each token was sampled before the stream
was closed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from grpo.inference.types import ABORTED, Completion

SSE_DATA = "data: "
SSE_DONE = "[DONE]"


class StreamStatusError(RuntimeError):
    """The server refused the stream; `retryable` for 429 and 5xx."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass
class _Choice:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, choice: dict[str, Any]) -> None:
        token_ids = choice.get("token_ids") or []
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(logprobs) != len(token_ids):
            raise RuntimeError(
                f"server streamed {len(token_ids)} token ids but {len(logprobs)} logprobs in one chunk"
            )
        self.token_ids += token_ids
        self.logprobs += [float(lp) for lp in logprobs]
        self.text.append(choice.get("text") or "")
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")

    def completion(self) -> Completion:
        return Completion(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            text="".join(self.text),
            finish_reason=self.finish_reason or ABORTED,
            stop_reason=self.stop_reason,
        )


async def stream_completions(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], n: int, interrupt: asyncio.Event
) -> list[Completion]:
    """POST `body` (a /completions request) to `url` as a stream; the `n` choices once they finish, or
    as they stand when `interrupt` is set (unfinished ones with finish_reason ABORTED, the stream
    closed so the server aborts them)."""
    choices = [_Choice() for _ in range(n)]

    async def read() -> None:
        async with http.stream("POST", url, json={**body, "stream": True}) as response:
            if response.status_code >= 400:
                text = (await response.aread()).decode(errors="replace")
                retryable = response.status_code == 429 or response.status_code >= 500
                raise StreamStatusError(f"{url}: HTTP {response.status_code}: {text[:2000]}", retryable)
            async for line in response.aiter_lines():
                if not line.startswith(SSE_DATA):
                    continue
                data = line[len(SSE_DATA) :]
                if data == SSE_DONE:
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"{url}: the stream failed: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    choices[choice["index"]].add(choice)

    if interrupt.is_set():
        return [choice.completion() for choice in choices]
    reader = asyncio.ensure_future(read())
    stopper = asyncio.ensure_future(interrupt.wait())
    try:
        await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        reader.cancel()  # a no-op once it finished; else it closes the connection and vLLM aborts
        await asyncio.gather(reader, stopper, return_exceptions=True)
    if not reader.cancelled():
        reader.result()  # its error, if it failed before the interrupt
        unfinished = [i for i, choice in enumerate(choices) if choice.finish_reason is None]
        if unfinished:  # only an interrupt may leave a choice unfinished (it is then resumed)
            raise RuntimeError(f"{url}: the stream ended without a finish_reason for choice(s) {unfinished}")
    return [choice.completion() for choice in choices]
