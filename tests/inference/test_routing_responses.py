"""The CPU server's completion responses gain each choice's recorded routing
(grpo.inference.routing_responses), checked on a fake app and a fake engine."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import numpy as np

from grpo.inference.completion_bodies import decode_routed_experts, encode_routed_experts
from grpo.inference.routing_responses import RoutingResponses
from grpo.inference.vllm_compat.routing_capture import engine_request_ids


class FakeEngine:
    """Two data-parallel workers; the second ran the requests in `known`."""

    def __init__(self, known: dict[str, np.ndarray]) -> None:
        self.known = known
        self.calls: list[tuple[list[str], list[int]]] = []

    async def collective_rpc(self, method: str, args: tuple[Any, ...]) -> list[list[str | None]]:
        assert method == "take_routed_experts"
        request_ids, num_positions = args
        self.calls.append((request_ids, num_positions))
        theirs = [encode_routed_experts(self.known[r]) if r in self.known else None for r in request_ids]
        return [[None] * len(request_ids), theirs]


def _serve(
    request: dict[str, Any], response: Any, engine: FakeEngine, path: str = "/v1/completions"
) -> tuple[int, Any]:
    """POST `request` through RoutingResponses to an app answering `response` (a dict: JSON, a str:
    an event stream) in two body chunks; the status and the body the client got."""
    is_json = isinstance(response, dict)
    body = json.dumps(response).encode() if is_json else response.encode()
    content_type = b"application/json" if is_json else b"text/event-stream"

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert json.loads((await receive())["body"]) == request
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body[:5], "more_body": True})
        await send({"type": "http.response.body", "body": body[5:]})

    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "method": "POST", "path": path}
    scope["app"] = SimpleNamespace(state=SimpleNamespace(engine_client=engine))

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": json.dumps(request).encode()}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(RoutingResponses(app)(scope, receive, send))
    got = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    length = dict(sent[0]["headers"])[b"content-length"]
    assert int(length) == len(got)
    return sent[0]["status"], json.loads(got) if is_json else got.decode()


def test_each_choice_of_a_sampled_prompt_gets_the_routing_its_engine_request_recorded() -> None:
    first, second = np.zeros((4, 2, 2), np.uint8), np.ones((5, 2, 2), np.uint8)
    engine = FakeEngine({"0_cmpl-abc-0": first, "1_cmpl-abc-0": second})
    choices = [{"index": 1, "token_ids": [7, 8, 9]}, {"index": 0, "token_ids": [5, 6]}]
    status, body = _serve({"prompt": [1, 2, 3], "n": 2}, {"id": "cmpl-abc", "choices": choices}, engine)
    assert status == 200
    assert engine.calls == [(["0_cmpl-abc-0", "1_cmpl-abc-0"], [4, 5])]  # prompt + completion - 1
    by_index = {c["index"]: decode_routed_experts(c["routed_experts"]) for c in body["choices"]}
    assert (by_index[0] == first).all() and (by_index[1] == second).all()


def test_a_single_sample_is_its_prompts_own_engine_request() -> None:
    assert engine_request_ids("cmpl-x", 1) == ["cmpl-x-0"]
    assert engine_request_ids("cmpl-x", 3) == ["0_cmpl-x-0", "1_cmpl-x-0", "2_cmpl-x-0"]


def test_a_choice_without_recorded_routing_a_text_prompt_and_a_stream_pass_untouched() -> None:
    engine = FakeEngine({})
    response = {"id": "cmpl-y", "choices": [{"index": 0, "token_ids": [4]}]}
    assert _serve({"prompt": [1, 2]}, response, engine)[1] == response
    assert _serve({"prompt": "hello"}, response, engine)[1] == response
    assert _serve({"prompt": [1], "stream": True}, "data: {}\n\n", engine)[1] == "data: {}\n\n"
    assert len(engine.calls) == 1  # only the token prompt with a JSON answer asked the engine


class FakeCountingEngine:
    """One worker that recorded kept counts for the requests in `known` (positions from 0)."""

    def __init__(self, known: dict[str, list[int]]) -> None:
        self.known = known
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def collective_rpc(self, method: str, args: tuple[Any, ...]) -> list[list[Any]]:
        self.calls.append((method, args))
        assert method == "take_kept_counts"
        request_ids, starts, num_tokens = args
        return [
            [
                self.known[r][s : s + n] if r in self.known else None
                for r, s, n in zip(request_ids, starts, num_tokens, strict=True)
            ]
        ]


def _serve_counts(request: dict[str, Any], response: dict[str, Any], engine: Any) -> dict[str, Any]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        body = json.dumps(response).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "method": "POST", "path": "/v1/completions"}
    scope["app"] = SimpleNamespace(state=SimpleNamespace(engine_client=engine))

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": json.dumps(request).encode()}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(RoutingResponses(app, routing=False, kept_counts=True)(scope, receive, send))
    result: dict[str, Any] = json.loads(
        b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    )
    return result


def test_a_truncating_request_gets_each_choices_kept_counts_of_its_completion_tokens() -> None:
    engine = FakeCountingEngine({"cmpl-k-0": [0, 0, 0, 20, 3, 1]})  # prompt of 3, 3 completion tokens
    response = {"id": "cmpl-k", "choices": [{"index": 0, "token_ids": [7, 8, 9]}]}
    body = _serve_counts({"prompt": [1, 2, 3], "n": 1, "top_p": 0.9, "top_k": 0}, response, engine)
    assert engine.calls == [("take_kept_counts", (["cmpl-k-0"], [3], [3]))]
    assert body["choices"][0]["kept_counts"] == [20, 3, 1]
    assert "routed_experts" not in body["choices"][0]


def test_a_request_that_truncates_nothing_asks_the_engine_for_no_counts() -> None:
    engine = FakeCountingEngine({"cmpl-k-0": [0, 0, 0, 20, 3, 1]})
    response = {"id": "cmpl-k", "choices": [{"index": 0, "token_ids": [7, 8, 9]}]}
    request = {"prompt": [1, 2, 3], "n": 1, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    body = _serve_counts(request, response, engine)
    assert engine.calls == [] and "kept_counts" not in body["choices"][0]


def test_a_streamed_response_reaches_the_client_chunk_by_chunk() -> None:
    """A client that stops reading a stream midway (an interrupted rollout) needs each chunk as the
    engine sends it, not the whole stream at its end."""
    seen_by_client_before_last_chunk: list[bytes] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        seen_by_client_before_last_chunk.extend(m.get("body", b"") for m in sent)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": json.dumps({"prompt": [1], "stream": True}).encode()}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions"}
    scope["app"] = SimpleNamespace(state=SimpleNamespace(engine_client=FakeEngine({})))
    asyncio.run(RoutingResponses(app, kept_counts=True)(scope, receive, send))
    assert b"data: 1\n\n" in seen_by_client_before_last_chunk
    assert b"".join(m.get("body", b"") for m in sent) == b"data: 1\n\ndata: [DONE]\n\n"
