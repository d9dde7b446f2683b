"""The inference server's API key on every route but /health.

vLLM checks its key only under a few path prefixes (/v1, ...): /invocations, /tokenize and, with
runtime LoRA updating on, SageMaker's POST /adapters and DELETE /adapters/{name} (which load and
unload adapters) answer without it. This guard sits in front of the whole app instead, so a route
vLLM adds in a later version is covered without anyone listing it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

OPEN_PATHS = frozenset({"/health"})
"""Paths answered without the key: liveness only (supervisors and load balancers poll it)."""


class ApiKeyGuard:
    """ASGI middleware: a request (HTTP or WebSocket) to any path but OPEN_PATHS must carry
    `Authorization: Bearer <one of keys>`; 401 otherwise (a WebSocket is closed before it opens)."""

    def __init__(self, app: Any, keys: list[str]) -> None:
        assert keys, "a guard without keys would refuse every request"
        self.app = app
        # Compared as digests: equal lengths, so the comparison time says nothing about the key.
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: an HTTP 403
            return
        body = json.dumps(
            {"error": "Unauthorized: send Authorization: Bearer <the server's API key>"}
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: dict[str, Any]) -> bool:
        values = [v for k, v in scope.get("headers") or [] if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode("latin-1")).digest()
        return any(hmac.compare_digest(digest, expected) for expected in self._digests)
