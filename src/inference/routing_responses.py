"""grpo-infer on a CPU engine: every /v1/completions choice carries what the engine recorded for it
beyond vLLM's own response: with return_routed_experts the `routed_experts`, as vLLM's own option
adds them on a GPU; when the request truncates (top_k, top_p or min_p) the `kept_counts`, one
integer per completion token: how many tokens the sampler kept when it sampled it
(grpo.inference.vllm_compat.kept_counts).

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
    """ASGI middleware adding each choice's recorded routing (`routing`) and kept-set sizes
    (`kept_counts`) to /v1/completions responses."""

    def __init__(self, app: Any, routing: bool = True, kept_counts: bool = False) -> None:
        self.app = app
        self.routing = routing
        self.kept_counts = kept_counts

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
        passes_through = False
        response_body = bytearray()

        async def hold(message: dict[str, Any]) -> None:
            nonlocal start, passes_through
            if passes_through:
                await send(message)
                return
            if message["type"] == "http.response.start":
                if message["status"] != 200 or not _content_type(message).startswith("application/json"):
                    # A streamed (or failed) response gets nothing added: it goes on chunk by chunk,
                    # as a client that stops reading midway needs.
                    passes_through = True
                    await send(message)
                    return
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            response_body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = await _with_records(
                scope["app"].state.engine_client,
                bytes(request_body),
                bytes(response_body),
                self.routing,
                self.kept_counts,
            )
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive_and_keep, hold)


def _content_type(start: dict[str, Any]) -> str:
    for key, value in start["headers"]:
        if key.lower() == b"content-type":
            return str(value.decode("latin-1"))
    return ""


def truncates(request: dict[str, Any]) -> bool:
    """Whether a completion request's sampling drops tokens (top_k, top_p or min_p)."""
    top_k, top_p, min_p = request.get("top_k"), request.get("top_p"), request.get("min_p")
    return bool((top_k or 0) > 0 or (top_p is not None and top_p < 1.0) or (min_p or 0.0) > 0.0)


async def _with_records(
    engine: Any, request_body: bytes, response_body: bytes, routing: bool, kept_counts: bool
) -> bytes:
    """`response_body` with each choice's routing and kept counts added, when the request was one
    prompt of token ids."""
    request = json.loads(request_body or b"{}")
    prompt = request.get("prompt")
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return response_body
    kept_counts = kept_counts and truncates(request)
    if not (routing or kept_counts):
        return response_body
    response = json.loads(response_body)
    choices = sorted(response.get("choices", []), key=lambda c: c["index"])
    if not choices or "token_ids" not in choices[0]:
        return response_body
    request_ids = engine_request_ids(response["id"], len(choices))
    if routing:
        num_positions = [len(prompt) + len(c["token_ids"]) - 1 for c in choices]
        per_worker = await engine.collective_rpc("take_routed_experts", args=(request_ids, num_positions))
        for choice, found in zip(choices, _first_found(per_worker, len(choices)), strict=True):
            if found is not None:
                choice["routed_experts"] = found
    if kept_counts:
        starts = [len(prompt)] * len(choices)
        num_tokens = [len(c["token_ids"]) for c in choices]
        per_worker = await engine.collective_rpc("take_kept_counts", args=(request_ids, starts, num_tokens))
        for choice, found in zip(choices, _first_found(per_worker, len(choices)), strict=True):
            if found is not None:
                choice["kept_counts"] = found
    return json.dumps(response).encode()


def _first_found(per_worker: list[list[Any]], num_choices: int) -> list[Any]:
    """Each choice's record from the worker that has one (each data-parallel engine's worker knows
    only its own requests), None where none has."""
    return [
        next((taken[i] for taken in per_worker if taken[i] is not None), None) for i in range(num_choices)
    ]
