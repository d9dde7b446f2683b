"""`RemoteEnv`: an environment served by `grpo-env` on another process or machine, over HTTP.

The examples, max_turns and every example's prompt messages are fetched once at load. Per-rollout
state lives on the server; the local state dict only carries its session id. A server that stops
answering mid-run fails the rollouts it was serving (their scores carry the reason) instead of
stopping training, exactly like a raising reward function. So does a request that takes longer
than its deadline (`timeout_s`, from sending it to the reply's last byte, however the server paces
its bytes) or a reply above `max_reply_bytes` (counted as it arrives, decompressed; never held
whole beyond the limit).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from grpo.envs.base import EnvReply, Example, Message, Score
from grpo.envs.rewards import FailureLog
from grpo.utils.auth import secret_from_env, warn_if_plaintext_token
from grpo.utils.errors import UserError

CONNECT_RETRY_S = 10.0
"""How long loading waits for a server that does not answer yet (it may still be starting)."""

REQUEST_TIMEOUT_S = 600.0
"""Default deadline of one request (EnvConfig.request_timeout_s); scoring runs user reward
functions, which may be slow."""

MAX_REPLY_BYTES = 64 * 1024 * 1024
"""Default largest reply (EnvConfig.max_reply_mib)."""

MIB = 1024 * 1024

_RETRY_INTERVAL_S = 0.2

TOKEN_ENV = "GRPO_ENV_TOKEN"
"""Environment variable holding the bearer token shared by `grpo-env` and the orchestrator."""


class BadReply(ValueError):
    """The server's JSON is not what the protocol says (another server, or another version)."""


class ReplyTooLarge(ValueError):
    """The server's reply is larger than the client accepts."""


class ErrorStatus(Exception):
    """The server answered an HTTP error status; `text` is the start of its body."""

    def __init__(self, status_code: int, text: str) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code
        self.text = text


def too_large(max_reply_bytes: int) -> ReplyTooLarge:
    return ReplyTooLarge(
        f"reply above {max_reply_bytes / MIB:g} MiB; raise env[].max_reply_mib if the server's replies are "
        "meant to be that large"
    )


def _token_from_env() -> str | None:
    token = secret_from_env(TOKEN_ENV)
    return None if token is None else token.decode()


def auth_headers(token: str | None) -> dict[str, str]:
    return {} if not token else {"Authorization": f"Bearer {token}"}


def _need(reply: dict[str, Any], key: str, kinds: type | tuple[type, ...], path: str) -> Any:
    value = reply.get(key)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise BadReply(f"{path}: '{key}' is {type(value).__name__}, expected {kinds}")
    return value


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _messages(value: Any, path: str) -> list[Message]:
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        raise BadReply(f"{path}: 'messages' must be a list of {{role: str, content: str}}")
    return value


def check_reply(path: str, reply: Any) -> dict[str, Any]:
    """The reply of `path`, checked field by field, so that a wrong one fails its rollout here and
    not as a KeyError deep in the orchestrator."""
    if not isinstance(reply, dict):
        raise BadReply(f"{path}: the reply is {type(reply).__name__}, not a JSON object")
    if path == "/reset":
        _need(reply, "session_id", str, path)
    elif path == "/step":
        _messages(reply.get("messages"), path)
        _need(reply, "done", bool, path)
    elif path == "/score":
        _need(reply, "reward", (int, float), path)
        metrics = _need(reply, "metrics", dict, path)
        if not all(isinstance(k, str) and isinstance(v, int | float) for k, v in metrics.items()):
            raise BadReply(f"{path}: 'metrics' must map names to numbers")
        failure = reply.get("failure")
        if failure is not None and not isinstance(failure, str):
            raise BadReply(f"{path}: 'failure' must be a string or null")
        reply = {**reply, "reward": float(reply["reward"]), "failure": failure}
    return reply


def base_url(address: str) -> str:
    """'host:port' (or a full http(s):// URL) -> the server's base URL."""
    if address.startswith(("http://", "https://")):
        return address.rstrip("/")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"env address {address!r} is not host:port; write it like 127.0.0.1:8100")
    return f"http://{address}"


def example_key(example: Example) -> str:
    """Examples arrive as JSON, so their canonical JSON identifies them."""
    return json.dumps(example, sort_keys=True)


def fetch_info(
    address: str,
    env_id: str,
    retry_s: float,
    token: str | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
    max_reply_bytes: int = MAX_REPLY_BYTES,
) -> dict[str, Any]:
    """GET /info, retrying connection errors for `retry_s` seconds (tenacity); the reply must arrive within
    `timeout_s` (checked as each piece arrives) and hold at most `max_reply_bytes`."""
    url = f"{base_url(address)}/info"
    retrying = Retrying(
        retry=retry_if_exception_type(httpx.TransportError),
        stop=stop_after_delay(retry_s),
        wait=wait_fixed(_RETRY_INTERVAL_S),
        reraise=True,
    )
    try:
        response = retrying(_get_bounded, url, token, timeout_s, max_reply_bytes)
    except (ReplyTooLarge, TimeoutError) as exc:
        raise UserError(f"env {env_id}: {url}: {exc}") from exc
    except httpx.TransportError as exc:
        raise UserError(
            f"env {env_id}: no environment server answers at {address} ({type(exc).__name__} "
            f"after {retry_s:g} s); start it with `grpo-env {env_id} --port {address.rsplit(':', 1)[-1]}` "
            "(add --args JSON for the loader's arguments), or remove env[].address to run it in-process"
        ) from exc
    if response.status_code == 401:
        raise UserError(
            f"env {env_id}: the server at {address} refused the token; export {TOKEN_ENV} with the token "
            "the grpo-env server was started with"
        )
    info = _info_or_none(response)
    if info is None:
        raise UserError(
            f"env {env_id}: {url} answered HTTP {response.status_code} but not like a grpo-env server; "
            f"is env[].address ({address}) the port `grpo-env {env_id}` listens on?"
        )
    if info["id"] != env_id:
        raise UserError(
            f"env {env_id}: the server at {address} serves {info['id']!r}; set env[].id to "
            f"{info['id']!r} or start `grpo-env {env_id}` there"
        )
    return info


def _get_bounded(url: str, token: str | None, timeout_s: float, max_reply_bytes: int) -> httpx.Response:
    return get_bounded(url, auth_headers(token), timeout_s, max_reply_bytes)


def get_bounded(url: str, headers: dict[str, str], timeout_s: float, max_reply_bytes: int) -> httpx.Response:
    """GET `url`, its body read in pieces: ReplyTooLarge past `max_reply_bytes`, TimeoutError once
    `timeout_s` have passed since the request went out (httpx's own timeout bounds each read, so a
    server trickling its reply would otherwise hold the caller for as long as it likes)."""
    deadline = time.monotonic() + timeout_s
    with httpx.stream("GET", url, timeout=timeout_s, headers=headers) as response:
        body = bytearray()
        for piece in response.iter_bytes():
            body += piece
            if len(body) > max_reply_bytes:
                raise too_large(max_reply_bytes)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reply within {timeout_s:g} s (env[].request_timeout_s)")
    return httpx.Response(response.status_code, headers=response.headers, content=bytes(body))


def _info_or_none(response: httpx.Response) -> dict[str, Any] | None:
    """The /info body, or None when another kind of server answered."""
    if response.status_code != 200:
        return None
    try:
        info = response.json()
    except json.JSONDecodeError:
        return None
    fields = ("id", "name", "max_turns", "examples", "prompts")
    return info if isinstance(info, dict) and all(f in info for f in fields) else None


class RemoteEnv:
    """The `Environment` protocol over HTTP; build it with `RemoteEnv.connect`."""

    def __init__(
        self,
        address: str,
        name: str,
        info: dict[str, Any],
        token: str | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        """Deadline of one request, from sending it to the reply's last byte."""
        self.max_reply_bytes = max_reply_bytes
        self.token = token if token is not None else _token_from_env()
        self.base_url = base_url(address)
        if self.token is not None:
            warn_if_plaintext_token(self.base_url, f"env {name}")
        self.name = name
        self.max_turns: int = int(info["max_turns"])
        self.examples: list[Example] = info["examples"]
        self._prompts = {
            example_key(example): prompt
            for example, prompt in zip(self.examples, info["prompts"], strict=True)
        }
        self.failures = FailureLog()
        # httpx.AsyncClient belongs to the event loop it first ran on; each new loop gets its own.
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def connect(
        cls,
        address: str,
        env_id: str,
        name: str,
        retry_s: float | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> RemoteEnv:
        """Fetch the server's info (waiting up to `retry_s`, default CONNECT_RETRY_S, for it to come up)."""
        token = _token_from_env()
        retry = CONNECT_RETRY_S if retry_s is None else retry_s
        info = fetch_info(address, env_id, retry, token, timeout_s, max_reply_bytes)
        return cls(address, name, info, token, timeout_s, max_reply_bytes)

    def prompt_messages(self, example: Example) -> list[Message]:
        prompt = self._prompts.get(example_key(example))
        if prompt is None:
            raise ValueError(
                f"env {self.name}: the example is not one the server at {self.address} listed; "
                "remote environments roll out their own examples only"
            )
        return [dict(m) for m in prompt]

    async def reset(self, example: Example) -> dict[str, Any]:
        reply, failure = await self._call("/reset", {"example": example})
        if reply is None:
            return {"session_id": None, "failure": failure}
        return {"session_id": reply["session_id"]}

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        if state.get("failure") is not None:
            return EnvReply(messages=[], done=True)
        reply, failure = await self._call("/step", {"session_id": state["session_id"], "messages": messages})
        if reply is None:
            state["failure"] = failure
            return EnvReply(messages=[], done=True)
        return EnvReply(messages=reply["messages"], done=reply["done"], reward=reply.get("reward"))

    async def score(self, example: Example, completion: list[Message], state: dict[str, Any]) -> Score:
        failure = state.get("failure")
        if failure is not None:
            return Score(reward=0.0, failure=failure)
        body = {"session_id": state["session_id"], "example": example, "completion": completion}
        reply, failure = await self._call("/score", body)
        if reply is None:
            return Score(reward=0.0, failure=failure)
        return Score(reward=reply["reward"], metrics=reply["metrics"], failure=reply["failure"])

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _call(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        """(checked reply, None), or (None, failure reason): whatever the server (or a proxy in
        front of it) sends, the rollout fails and training goes on."""
        try:
            async with asyncio.timeout(self.timeout_s):
                status_code, data = await self._post_bounded(path, body)
            if status_code >= 400:
                raise ErrorStatus(status_code, data[:300].decode(errors="replace"))
            return check_reply(path, json.loads(data)), None
        # JSONDecodeError, BadReply and ReplyTooLarge are ValueErrors
        except (httpx.HTTPError, ValueError, TimeoutError, ErrorStatus) as exc:
            return None, self._failure(path, exc)

    async def _post_bounded(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """(status, reply body) of POST `path`; ReplyTooLarge as soon as the body passes
        max_reply_bytes (a declared length says so before anything is read)."""
        async with self._http().stream("POST", path, json=body) as response:
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_reply_bytes:
                raise too_large(self.max_reply_bytes)
            data = bytearray()
            async for piece in response.aiter_bytes():
                data += piece
                if len(data) > self.max_reply_bytes:
                    raise too_large(self.max_reply_bytes)
            return response.status_code, bytes(data)

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # httpx's timeout bounds each read; _call's deadline bounds the whole request.
            self._client = httpx.AsyncClient(
                base_url=self.base_url, timeout=self.timeout_s, headers=auth_headers(self.token)
            )
            self._client_loop = loop
        return self._client

    def _failure(self, path: str, exc: Exception) -> str:
        """The rollout's failure reason (deduplicated in the log): what went wrong, not which rollout."""
        if isinstance(exc, ErrorStatus):
            reason = f"env server {self.address} answered HTTP {exc.status_code} on {path}"
            detail = f"{reason}: {exc.text}"
        elif isinstance(exc, TimeoutError):
            reason = (
                f"env server {self.address} sent no reply within {self.timeout_s:g} s on {path} "
                "(env[].request_timeout_s)"
            )
            detail = reason
        elif isinstance(exc, ReplyTooLarge):
            reason = f"env server {self.address} sent a {exc} on {path}"
            detail = reason
        elif isinstance(exc, httpx.HTTPError):
            reason = f"env server {self.address} unreachable on {path} ({type(exc).__name__})"
            detail = f"{reason}: {exc}"
        else:
            reason = f"env server {self.address} sent a malformed reply on {path}"
            detail = f"{reason}: {str(exc)[:300]}; is env[].address a grpo-env server of the same version?"
        self.failures.record(self.name, reason, detail)
        return reason
