"""Serving one environment over HTTP (JSON bodies only) for `RemoteEnv` clients (`grpo-env`).

Endpoints:
  GET  /info   {id, name, max_turns, examples, prompts}: prompts[i] is examples[i]'s prompt messages
  POST /reset  {example} -> {session_id}
  POST /step   {session_id, messages} -> {messages, done}
  POST /score  {session_id, example, completion} -> {reward, metrics, failure}; ends the session

Per-rollout state stays here behind an opaque session id, because an environment's state dict may
hold objects that have no JSON form. Abandoned sessions (a client that died mid-rollout) would pile
up, so the store keeps at most `max_sessions` and evicts the oldest.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from grpo.envs.base import Environment, Example, Message
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    from fastapi import FastAPI

log = get_logger("envs")

DEFAULT_MAX_SESSIONS = 10_000


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
    """Session id -> per-rollout state, oldest evicted beyond `max_sessions`."""

    def __init__(self, env_name: str, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.env_name = env_name
        self.max_sessions = max_sessions
        self.num_evicted = 0
        self._states: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def add(self, state: dict[str, Any]) -> str:
        session_id = uuid.uuid4().hex
        self._states[session_id] = state
        while len(self._states) > self.max_sessions:
            self._states.popitem(last=False)
            if self.num_evicted == 0:
                log.warning(
                    "env %s: more than %d open sessions; evicting the oldest (logged once). Clients that "
                    "die mid-rollout leave sessions behind; a live rollout whose session is evicted fails.",
                    self.env_name,
                    self.max_sessions,
                )
            self.num_evicted += 1
        return session_id

    def get(self, session_id: str) -> dict[str, Any] | None:
        return self._states.get(session_id)

    def pop(self, session_id: str) -> dict[str, Any] | None:
        return self._states.pop(session_id, None)


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
            raise ValueError(
                f"env {env_id}: example {i} (or its prompt messages) has no JSON form ({exc}); an "
                "environment served by grpo-env needs JSON examples (str, numbers, lists, dicts)"
            ) from exc
    return payload


def build_app(env: Environment, env_id: str, max_sessions: int = DEFAULT_MAX_SESSIONS) -> FastAPI:
    """The HTTP app serving `env`; `env_id` is what clients' env[].id must match."""
    from fastapi import FastAPI, HTTPException

    info = info_payload(env, env_id)
    sessions = SessionStore(env.name, max_sessions)
    app = FastAPI(title=f"grpo environment {env_id}", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sessions = sessions

    def unknown(session_id: str) -> HTTPException:
        return HTTPException(404, f"unknown session {session_id} (already scored, or evicted)")

    @app.get("/info")
    async def get_info() -> dict[str, Any]:
        return info

    @app.post("/reset")
    async def reset(body: ResetBody) -> dict[str, Any]:
        state = await env.reset(body.example)
        return {"session_id": sessions.add(state)}

    @app.post("/step")
    async def step(body: StepBody) -> dict[str, Any]:
        state = sessions.get(body.session_id)
        if state is None:
            raise unknown(body.session_id)
        reply = await env.step(body.messages, state)
        return {"messages": reply.messages, "done": reply.done}

    @app.post("/score")
    async def score(body: ScoreBody) -> dict[str, Any]:
        state = sessions.pop(body.session_id)
        if state is None:
            raise unknown(body.session_id)
        result = await env.score(body.example, body.completion, state)
        return {"reward": result.reward, "metrics": result.metrics, "failure": result.failure}

    return app


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
