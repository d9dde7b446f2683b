"""Serving one environment over HTTP (JSON bodies only) for `RemoteEnv` clients (`grpo-env`).

Endpoints:
  GET  /info   {id, name, max_turns, examples, prompts}: prompts[i] is examples[i]'s prompt messages
  POST /reset  {example} -> {session_id}
  POST /step   {session_id, messages} -> {messages, done, reward}  (reward: the turn's, or null)
  POST /score  {session_id, example, completion} -> {reward, metrics, failure}; ends the session

Per-rollout state stays here behind an opaque session id, because an environment's state dict may
hold objects that have no JSON form. Abandoned sessions (a client that died mid-rollout) would pile
up, so the store keeps at most `max_sessions_per_client` per client (its own oldest go first) and
`max_sessions` in all (the oldest of the biggest holder goes first): a client flooding `/reset`
evicts its own sessions, never another client's live ones. A client is its token when the server
has one (every request proves it; addresses are no identity behind NAT or a proxy, and one host
may hold many), else its source address (loopback only).

With a token every request needs `Authorization: Bearer TOKEN` (401 otherwise); request bodies
above `max_body_bytes` get 413 before they are parsed, and are read into one buffer (never
re-copied per piece). An example a client sends that is not one of the environment's own and
whose JSON is above `max_example_bytes` gets 413 before the environment sees it, so no session
stores it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from starlette.requests import Request  # module level: FastAPI resolves route annotations here

from grpo.envs.base import Environment, Example, Message, non_text_parts
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    from fastapi import FastAPI

log = get_logger("envs")

DEFAULT_MAX_SESSIONS = 10_000
DEFAULT_MAX_SESSIONS_PER_CLIENT = 4_096
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_EXAMPLE_BYTES = 64 * 1024


# Request bodies live at module level: FastAPI resolves the routes' (string) annotations here.
class ResetBody(BaseModel):
    example: Example


class StepBody(BaseModel):
    session_id: str
    messages: list[Message]


class ScoreBody(BaseModel):
    session_id: str
    example: Example
    completion: list[Message]


class SessionStore:
    """Session id -> per-rollout state, bounded per client and in all (see the module docstring)."""

    def __init__(
        self,
        env_name: str,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_sessions_per_client: int | None = None,
    ) -> None:
        per_client = max_sessions if max_sessions_per_client is None else max_sessions_per_client
        if max_sessions < 1 or per_client < 1:
            raise UserError(
                f"--max-sessions {max_sessions} / --max-sessions-per-client {per_client}: both must be >= 1"
            )
        self.env_name = env_name
        self.max_sessions = max_sessions
        self.max_sessions_per_client = per_client
        self.num_evicted = 0
        self._states: dict[str, dict[str, Any]] = {}
        self._by_client: dict[str, OrderedDict[str, None]] = {}
        self._client_of: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._states)

    def add(self, state: dict[str, Any], client: str = "") -> str:
        session_id = uuid.uuid4().hex
        self._states[session_id] = state
        self._client_of[session_id] = client
        own = self._by_client.setdefault(client, OrderedDict())
        own[session_id] = None
        while len(own) > self.max_sessions_per_client:
            self._evict(client)
        while len(self._states) > self.max_sessions:
            self._evict(max(self._by_client, key=lambda c: len(self._by_client[c])))
        return session_id

    def _evict(self, client: str) -> None:
        session_id, _ = self._by_client[client].popitem(last=False)
        self._forget(session_id)
        if self.num_evicted == 0:
            log.warning(
                "env %s: too many open sessions (%d per client, %d in all); evicting the oldest of the "
                "client holding most (logged once). Clients that die mid-rollout leave sessions behind; "
                "a live rollout whose session is evicted fails.",
                self.env_name,
                self.max_sessions_per_client,
                self.max_sessions,
            )
        self.num_evicted += 1

    def _forget(self, session_id: str) -> dict[str, Any] | None:
        state = self._states.pop(session_id, None)
        client = self._client_of.pop(session_id, None)
        if client is not None:
            own = self._by_client[client]
            own.pop(session_id, None)
            if not own:
                del self._by_client[client]
        return state

    def get(self, session_id: str) -> dict[str, Any] | None:
        return self._states.get(session_id)

    def pop(self, session_id: str) -> dict[str, Any] | None:
        return self._forget(session_id)


class RequestGuard:
    """ASGI middleware: bearer-token check and request body limit, before any route parses JSON."""

    def __init__(self, app: Any, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and not hmac.compare_digest(
            headers.get(b"authorization", b""), self.expected
        ):
            await _plain(send, 401, "missing or wrong bearer token (GRPO_ENV_TOKEN)")
            return
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            await _plain(send, 413, f"request body above {self.max_body_bytes} bytes")
            return
        # Chunked bodies declare no length: read (bounded) before the app does, into one buffer
        # (appending to bytes would copy everything received so far for every piece).
        buffer, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            buffer += message.get("body", b"")
            more = message.get("more_body", False)
            if len(buffer) > self.max_body_bytes:
                await _plain(send, 413, f"request body above {self.max_body_bytes} bytes")
                return
        body = bytes(buffer)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return dict(await receive())
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _plain(send: Any, status: int, text: str) -> None:
    data = json.dumps({"detail": text}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def info_payload(env: Environment, env_id: str) -> dict[str, Any]:
    """What /info answers; refuses examples or prompts that have no JSON form."""
    prompts = [env.prompt_messages(example) for example in env.examples]
    payload = {
        "id": env_id,
        "name": env.name,
        "max_turns": env.max_turns,
        "examples": env.examples,
        "prompts": prompts,
    }
    for i, (example, prompt) in enumerate(zip(env.examples, prompts, strict=True)):
        try:
            json.dumps({"example": example, "prompt": prompt}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise UserError(
                f"env {env_id}: example {i} (or its prompt messages) has no JSON form ({exc}); an "
                "environment served by grpo-env needs JSON examples (str, numbers, lists, dicts)"
            ) from exc
    return payload


def build_app(
    env: Environment,
    env_id: str,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_sessions_per_client: int | None = DEFAULT_MAX_SESSIONS_PER_CLIENT,
    max_example_bytes: int = DEFAULT_MAX_EXAMPLE_BYTES,
) -> FastAPI:
    """The HTTP app serving `env`; `env_id` is what clients' env[].id must match."""
    from fastapi import FastAPI, HTTPException

    for example in env.examples:
        prompt = example.get("prompt")
        if isinstance(prompt, list) and (kinds := non_text_parts(prompt)):
            raise UserError(
                f"env {env_id}: its prompts have {', '.join(kinds)} parts, which do not travel over grpo-env's JSON; "
                "load the environment in the orchestrator itself (env[].id without an address)"
            )
    info = info_payload(env, env_id)
    own_examples = {_example_key(example) for example in env.examples}
    # Every request proves the token (RequestGuard), so its holders are one client.
    token_client = None if not token else "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    per_client = None if max_sessions_per_client is None else min(max_sessions, max_sessions_per_client)
    sessions = SessionStore(env.name, max_sessions, per_client)
    app = FastAPI(title=f"grpo environment {env_id}", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestGuard, token=token, max_body_bytes=max_body_bytes)
    app.state.sessions = sessions

    def unknown(session_id: str) -> HTTPException:
        return HTTPException(404, f"unknown session {session_id} (already scored, or evicted)")

    def check_example(example: Example) -> None:
        key = _example_key(example)
        if key not in own_examples and len(key.encode()) > max_example_bytes:
            raise HTTPException(
                413,
                f"example of {len(key.encode())} bytes (JSON) is not one of the environment's own and is above "
                f"{max_example_bytes} bytes; start grpo-env with a larger --max-example-kb to accept it",
            )

    @app.get("/info")
    async def get_info() -> dict[str, Any]:
        return info

    @app.post("/reset")
    async def reset(body: ResetBody, request: Request) -> dict[str, Any]:
        check_example(body.example)
        state = await env.reset(body.example)
        client = token_client or (request.client.host if request.client is not None else "")
        return {"session_id": sessions.add(state, client)}

    @app.post("/step")
    async def step(body: StepBody) -> dict[str, Any]:
        state = sessions.get(body.session_id)
        if state is None:
            raise unknown(body.session_id)
        reply = await env.step(body.messages, state)
        return {"messages": reply.messages, "done": reply.done, "reward": reply.reward}

    @app.post("/score")
    async def score(body: ScoreBody) -> dict[str, Any]:
        check_example(body.example)
        state = sessions.pop(body.session_id)
        if state is None:
            raise unknown(body.session_id)
        result = await env.score(body.example, body.completion, state)
        return {"reward": result.reward, "metrics": result.metrics, "failure": result.failure}

    return app


def _example_key(example: Example) -> str:
    """An example's canonical JSON (what identifies it, and what its size is measured on)."""
    return json.dumps(example, sort_keys=True)


class BackgroundServer:
    """Serves an app on a daemon thread (for embedding an env server in another process, and tests).

    `BackgroundServer(app).start()` returns the "host:port" address once the server accepts
    connections; port 0 picks a free port. `stop()` finishes in-flight requests and joins the thread.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self._socket = socket.create_server((host, port))
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, args=([self._socket],), daemon=True)
        bound_host, bound_port = self._socket.getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"

    def start(self, timeout: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"env server on {self.address} did not start")
            time.sleep(0.01)
        return self.address

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
