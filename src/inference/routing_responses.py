"""grpo-infer on a CPU engine with return_routed_experts: every /v1/completions choice carries the
`routed_experts` the engine recorded for it, as vLLM's own option adds them on a GPU.

The engine's workers record each request's routing (grpo.inference.vllm_compat.routing_capture);
this ASGI wrapper holds back a completed, non-streamed /v1/completions response, takes the routing
of each of its choices from the workers (WorkerExtension.take_routed_experts) and adds it to the
choice: [prompt + completion tokens - 1, num_hidden_layers, top_k], base64 `.npy`, the layout
vLLM returns. It finds a choice's engine request by vLLM 0.32's naming (engine_request_ids).
A request with several prompts, a streamed one, or one that failed passes untouched (no routing).
"""

from __future__ import annotations

import json
from typing import Any

from grpo.inference.vllm_compat.routing_capture import engine_request_ids

COMPLETIONS_PATH = "/v1/completions"


class RoutingResponses:
    """ASGI middleware adding each choice's recorded routing to /v1/completions responses."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != COMPLETIONS_PATH:
            await self.app(scope, receive, send)
            return
        request_body = bytearray()

        async def receive_and_keep() -> dict[str, Any]:
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                request_body.extend(message.get("body", b""))
            return message

        start: dict[str, Any] | None = None
        response_body = bytearray()

        async def hold(message: dict[str, Any]) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            response_body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = bytes(response_body)
            if start["status"] == 200 and _content_type(start).startswith("application/json"):
                body = await _with_routing(scope["app"].state.engine_client, bytes(request_body), body)
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive_and_keep, hold)


def _content_type(start: dict[str, Any]) -> str:
    for key, value in start["headers"]:
        if key.lower() == b"content-type":
            return str(value.decode("latin-1"))
    return ""


async def _with_routing(engine: Any, request_body: bytes, response_body: bytes) -> bytes:
    """`response_body` with each choice's routing added, when the request was one prompt of token ids."""
    request = json.loads(request_body or b"{}")
    prompt = request.get("prompt")
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return response_body
    response = json.loads(response_body)
    choices = sorted(response.get("choices", []), key=lambda c: c["index"])
    if not choices or "token_ids" not in choices[0]:
        return response_body
    request_ids = engine_request_ids(response["id"], len(choices))
    num_positions = [len(prompt) + len(c["token_ids"]) - 1 for c in choices]
    per_worker = await engine.collective_rpc("take_routed_experts", args=(request_ids, num_positions))
    for i, choice in enumerate(choices):
        # Each data-parallel engine's worker knows only its own requests.
        found = [taken[i] for taken in per_worker if taken[i] is not None]
        if found:
            choice["routed_experts"] = found[0]
    return json.dumps(response).encode()
