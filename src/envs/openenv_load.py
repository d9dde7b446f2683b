"""Loading an `openenv:` env block: check the server's action schema (`GET /schema`) against
env[].args, and reset one episode per example (seeds seed, seed+1, ...; each on its own WebSocket
session, closed again) whose first observation is the example's prompt. Every mistake is a UserError
naming the block and the fix; the server must be running (load waits CONNECT_RETRY_S for it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import time
from typing import Any

from grpo.config.orchestrator import OPENENV_PREFIX
from grpo.config.sections.openenv import OpenEnvArgs
from grpo.envs.base import Example
from grpo.envs.openenv_env import (
    CLOSE_WAIT_S,
    OpenEnvEnv,
    Server,
    ServerError,
    kwargs_text,
    observation,
    observation_text,
    server,
)
from grpo.envs.remote import ReplyTooLarge, get_bounded
from grpo.utils.errors import UserError

CONNECT_RETRY_S = 10.0
"""How long loading waits for a server that does not answer yet (it may still be starting)."""


def load_environment(
    url: str, args: OpenEnvArgs, request_timeout_s: float, max_reply_bytes: int, name: str = "openenv"
) -> OpenEnvEnv:
    """Check the server's action schema, reset `args.num_examples` episodes (seeds seed, seed+1, ...)
    for the examples, and return the environment. `url` is the id's URL; the deadline, reply bound
    and name come from the env block."""
    where = f"env {OPENENV_PREFIX}{url}"
    if importlib.util.find_spec("websockets") is None:
        raise UserError(
            f"{where}: talking to an OpenEnv server needs websockets: pip install 'grpo-rl[openenv]'"
        )
    srv = server(url, args.api_key_var)
    schema = _action_schema(srv, where, request_timeout_s, max_reply_bytes)
    if schema is not None:
        _check_action(schema, args.action_field, args.action_args, where)
    examples: list[Example] = []
    observation_field = args.observation_field
    for i in range(args.num_examples):
        kwargs = {**args.reset_args, "seed": args.seed + i}
        obs, done = _reset_once(srv, kwargs, where, request_timeout_s, max_reply_bytes)
        if observation_field is None:
            observation_field = _only_text_field(obs, where)
        try:
            text = observation_text(obs, observation_field, f"{where}: reset")
        except ValueError as exc:
            raise UserError(
                f"{exc}; set env[].args.observation_field to the observation's text field"
            ) from None
        if done:
            raise UserError(f"{where}: reset({kwargs_text(kwargs)}) returned an episode that is already done")
        examples.append({"prompt": text, "info": {"reset": kwargs}})
    assert observation_field is not None  # num_examples >= 1
    return OpenEnvEnv(srv, examples, args, observation_field, request_timeout_s, max_reply_bytes, name)


def _action_schema(srv: Server, where: str, timeout_s: float, max_reply_bytes: int) -> dict[str, Any] | None:
    """The action's JSON schema from GET /schema (waiting up to CONNECT_RETRY_S for the server to come
    up); None when the server has no /schema (its action is then not checked before the first step)."""
    import httpx

    deadline = time.monotonic() + CONNECT_RETRY_S
    while True:
        try:
            response = get_bounded(f"{srv.http_url}/schema", srv.headers, timeout_s, max_reply_bytes)
            break
        except ReplyTooLarge:
            return None
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise UserError(
                f"{where}: GET /schema did not complete within {timeout_s:g} s; check the server, or raise "
                "env[].request_timeout_s if it is only slow"
            ) from exc
        except httpx.TransportError as exc:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"{where}: no OpenEnv server answers ({type(exc).__name__} after {CONNECT_RETRY_S:g} s); start "
                    "it first (e.g. `uvicorn my_env.server.app:app --port PORT`) or fix the id's URL"
                ) from exc
            time.sleep(0.2)
    if response.status_code in (401, 403):
        raise UserError(
            f"{where}: the server refused the request (HTTP {response.status_code}); check the token"
        )
    if response.status_code == 404:
        return None
    try:
        schema = response.json()
    except ValueError:
        schema = None
    if (
        response.status_code != 200
        or not isinstance(schema, dict)
        or not isinstance(schema.get("action"), dict)
    ):
        raise UserError(
            f"{where}: GET /schema answered HTTP {response.status_code} but not like an OpenEnv server; is the "
            "URL an OpenEnv environment server?"
        )
    action: dict[str, Any] = schema["action"]
    return action


def _check_action(schema: dict[str, Any], field: str, action_args: dict[str, Any], where: str) -> None:
    properties = schema.get("properties", {})
    if field not in properties:
        fields = ", ".join(sorted(k for k in properties if k != "metadata")) or "none"
        raise UserError(
            f"{where}: the server's action has no field {field!r} (its fields: {fields}); set "
            "env[].args.action_field to the one the model's reply goes into"
        )
    unknown = sorted(set(action_args) - set(properties))
    if unknown:
        raise UserError(
            f"{where}: env[].args.action_args names {unknown[0]!r}, which the server's action lacks"
        )
    missing = sorted(set(schema.get("required", [])) - {field, *action_args})
    if missing:
        raise UserError(
            f"{where}: the server's action also requires {missing[0]!r}; give its value in env[].args.action_args"
        )


def _reset_once(
    srv: Server, kwargs: dict[str, Any], where: str, timeout_s: float, max_reply_bytes: int
) -> tuple[dict[str, Any], bool]:
    """(observation, done) of one reset on a fresh session, closed again."""
    from websockets.exceptions import ConnectionClosed, WebSocketException
    from websockets.sync.client import connect

    try:
        with connect(
            srv.ws_url,
            additional_headers=srv.headers,
            max_size=max_reply_bytes,
            open_timeout=timeout_s,
            proxy=None if srv.loopback else True,
        ) as ws:
            ws.send(json.dumps({"type": "reset", "data": kwargs}))
            obs, _, done = observation(json.loads(ws.recv(timeout=timeout_s)), f"{where}: reset")
            ws.send(json.dumps({"type": "close"}))
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                ws.recv(timeout=CLOSE_WAIT_S)  # until the server closes the socket (see _close)
    except ServerError as exc:
        raise UserError(f"{where}: reset({kwargs_text(kwargs)}) answered an error: {exc}") from None
    except (OSError, TimeoutError, WebSocketException, ValueError) as exc:
        raise UserError(
            f"{where}: reset({kwargs_text(kwargs)}) over {srv.ws_url} failed: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    return obs, done


def _only_text_field(obs: dict[str, Any], where: str) -> str:
    texts = sorted(k for k, v in obs.items() if isinstance(v, str))
    if len(texts) != 1:
        raise UserError(
            f"{where}: the observation has {len(texts)} text fields ({', '.join(texts) or 'none'}); set "
            "env[].args.observation_field to the one the model reads"
        )
    return texts[0]
