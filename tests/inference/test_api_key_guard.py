"""The API key guard on a plain app: every route but /health needs the key."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from grpo.inference.api_key_guard import ApiKeyGuard

KEY = "the-servers-api-key-0123456789"


async def _answer(_request: Request) -> PlainTextResponse:
    return PlainTextResponse("reached")


async def _socket(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text("reached")
    await websocket.close()


ROUTES = [
    ("GET", "/health"),
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
    ("POST", "/adapters"),
    ("DELETE", "/adapters/policy"),
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("OPTIONS", "/v1/completions"),
]


def _client() -> TestClient:
    app = Starlette(
        routes=[
            Route("/health", _answer),
            Route("/invocations", _answer, methods=["POST"]),
            Route("/tokenize", _answer, methods=["POST"]),
            Route("/adapters", _answer, methods=["POST"]),
            Route("/adapters/{name}", _answer, methods=["DELETE"]),
            Route("/v1/models", _answer),
            Route("/metrics", _answer),
            Route("/v1/completions", _answer, methods=["POST", "OPTIONS"]),
            WebSocketRoute("/v1/realtime", _socket),
        ]
    )
    app.add_middleware(ApiKeyGuard, keys=[KEY])
    return TestClient(app)


@pytest.mark.parametrize(("method", "path"), [r for r in ROUTES if r[1] != "/health"])
def test_every_route_but_health_refuses_a_request_without_the_key(method: str, path: str) -> None:
    response = _client().request(method, path)
    assert response.status_code == 401 and response.text != "reached"


@pytest.mark.parametrize(
    "authorization",
    ["Bearer wrong-key-of-the-same-length-x", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", KEY],
)
def test_a_wrong_key_or_scheme_is_refused(authorization: str) -> None:
    response = _client().post("/invocations", headers={"Authorization": authorization})
    assert response.status_code == 401


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_the_key_opens_every_route(method: str, path: str) -> None:
    response = _client().request(method, path, headers={"Authorization": f"Bearer {KEY}"})
    assert (response.status_code, response.text) == (200, "reached")


def test_health_answers_without_the_key() -> None:
    assert _client().get("/health").text == "reached"


def test_a_websocket_without_the_key_is_closed_before_it_opens() -> None:
    with pytest.raises(WebSocketDisconnect), _client().websocket_connect("/v1/realtime") as socket:
        socket.receive_text()
    with _client().websocket_connect("/v1/realtime", headers={"Authorization": f"Bearer {KEY}"}) as socket:
        assert socket.receive_text() == "reached"
