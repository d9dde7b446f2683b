"""`OpenEnvEnv`: a running OpenEnv environment server (`id: "openenv:http://HOST:PORT"` in orch.yaml);
grpo.envs.openenv_load builds it.

OpenEnv (openenv-core 0.3) serves one environment instance per WebSocket on `/ws`: the client sends
`{"type": "reset", "data": {...}}` or `{"type": "step", "data": <action>}` and gets back
`{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}` or
`{"type": "error", "data": {"message", "code"}}`. Its HTTP `/reset` and `/step` build a fresh
environment per request, so a multi-step episode needs the WebSocket: each rollout opens its own
(one server session per rollout) and closes it once scored. `GET /schema` gives the action's JSON
schema, which load checks the configured action field against.

Text mapping: the model's reply becomes `{action_field: reply, **action_args}`; the observation's
`observation_field` (by default its only string field) is the prompt after reset and the next user
message after a step. One example is one reset (`reset(seed=seed + i)`); a rollout resets with its
example's seed and fails if the server then shows another first observation (the environment must
honour reset's seed for its examples to be reproducible). The reply of the last model turn is
stepped when the rollout is scored, so every turn's action reaches the server. The reward is the sum
of the episode's step rewards (its return; a step's None counts 0), or the last one with
`reward: last` for servers whose reward is already cumulative.

Per-turn rewards (`reward: sum`): each step's reward is the reward of the model turn it reacts to, so
`step` returns it in EnvReply.reward and the score carries only the steps the rollout loop did not
see (the last reply, stepped when scored); the rollout's reward (score plus turn rewards) is the
same return, and orch advantage.turn_credit per_turn credits each turn with its own. With
`reward: last` a step's value is a running total, not its turn's reward: the score carries it all.

A server that is down, slow (request_timeout_s per message) or answers too much (max_reply_mib)
fails the rollout it was serving, never the run. Sessions are capped at `max_sessions` at once (the
server's `max_concurrent_envs`, 1 by default in OpenEnv): more would be refused by the server. A
rollout holds its session from its reset until it is scored (the rollout loop scores each rollout on
its own), so a group with more rollouts than sessions plays them one after another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from grpo.config.orchestrator import OPENENV_PREFIX
from grpo.config.sections.openenv import OpenEnvArgs
from grpo.envs.base import EnvReply, Example, Message, Score
from grpo.envs.rewards import FailureLog
from grpo.utils.auth import is_loopback_host, secret_from_env, warn_if_plaintext_token
from grpo.utils.errors import UserError

CLOSE_WAIT_S = 5.0
"""How long closing a session waits for the server to close the socket after the `close` message."""

MIB = 1024 * 1024

_background: set[asyncio.Task[None]] = set()
"""Closes of abandoned sessions, kept referenced until they finish."""


@dataclass(frozen=True)
class Server:
    """Where an OpenEnv server is and how to reach it."""

    url: str
    """The id's URL, as the user wrote it (for messages)."""
    http_url: str
    ws_url: str
    headers: dict[str, str]
    loopback: bool


def server(url: str, api_key_var: str) -> Server:
    """The server at `url`; one on another machine is refused unless $api_key_var holds a token (sent
    as a bearer token, as to a reverse proxy or a private Space in front of the server)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    token = secret_from_env(api_key_var)
    if token is None and not is_loopback_host(host):
        raise UserError(
            f"env {OPENENV_PREFIX}{url}: {host} is not this machine and ${api_key_var} is unset; export "
            f"{api_key_var}=<the token the server or its proxy expects> (env[].args.api_key_var names the "
            "variable), or run the server on 127.0.0.1"
        )
    if token is not None:
        warn_if_plaintext_token(url, f"env {OPENENV_PREFIX}{url}")
    secure = parts.scheme in ("https", "wss")
    base = f"{host if ':' not in host else f'[{host}]'}:{parts.port}"
    return Server(
        url=url,
        http_url=f"{'https' if secure else 'http'}://{base}",
        ws_url=f"{'wss' if secure else 'ws'}://{base}/ws",
        headers={} if token is None else {"Authorization": f"Bearer {token.decode()}"},
        loopback=is_loopback_host(host),
    )


class ServerError(Exception):
    """The server answered a message with an error (its `code` and `message`)."""


def observation(reply: Any, what: str) -> tuple[dict[str, Any], float | None, bool]:
    """(observation fields, reward, done) of an `observation` message; ValueError when it is not one."""
    if not isinstance(reply, dict):
        raise ValueError(f"{what}: the reply is {type(reply).__name__}, not a JSON object")
    data = reply.get("data")
    if reply.get("type") == "error":
        data = data if isinstance(data, dict) else {}
        raise ServerError(f"{data.get('code', 'UNKNOWN')}: {str(data.get('message', ''))[:300]}")
    if reply.get("type") != "observation" or not isinstance(data, dict):
        raise ValueError(f"{what}: expected an 'observation' message, got type {reply.get('type')!r}")
    obs, reward, done = data.get("observation"), data.get("reward"), data.get("done", False)
    if not isinstance(obs, dict) or not isinstance(done, bool):
        raise ValueError(f"{what}: 'observation' must be an object and 'done' a boolean")
    if reward is not None and not isinstance(reward, int | float):  # OpenEnv allows bool rewards too
        raise ValueError(f"{what}: 'reward' is {type(reward).__name__}, expected a number or null")
    return obs, None if reward is None else float(reward), done


def observation_text(obs: dict[str, Any], field: str, what: str) -> str:
    text = obs.get(field)
    if not isinstance(text, str):
        raise ValueError(f"{what}: the observation's {field!r} is {type(text).__name__}, not a string")
    return text


class _Session:
    """One rollout's WebSocket; holds one of the env's session slots until closed. A rollout that is
    dropped unscored (buffer.skip_verification, a crashed group) gives both back when collected."""

    def __init__(self, ws: Any, slots: asyncio.Semaphore) -> None:
        self.ws = ws
        self._slots = slots
        self._finalizer = weakref.finalize(self, _abandon, ws, slots, asyncio.get_running_loop())

    async def close(self) -> None:
        if self._finalizer.detach() is not None:  # not closed (nor abandoned) before
            self._slots.release()
            await _close(self.ws)


async def _close(ws: Any) -> None:
    """End the server's session as OpenEnv's client does (a `close` message lets the server close the
    socket itself, instead of finding it gone), then the socket."""
    from websockets.exceptions import ConnectionClosed

    try:
        await ws.send(json.dumps({"type": "close"}))
        # the server closes the socket once it has ended the session; closing it from here first
        # would make the server's own close fail (a traceback in its log per rollout)
        async with asyncio.timeout(CLOSE_WAIT_S):
            await ws.wait_closed()
    except (ConnectionClosed, TimeoutError):
        pass  # already ended by the server or the network, or it does not close: close from here
    await ws.close()


def _abandon(ws: Any, slots: asyncio.Semaphore, loop: asyncio.AbstractEventLoop) -> None:
    slots.release()
    if not loop.is_closed():

        def spawn() -> None:
            task = loop.create_task(_close(ws))
            _background.add(task)
            task.add_done_callback(_background.discard)

        loop.call_soon_threadsafe(spawn)


class OpenEnvEnv:
    """The `Environment` protocol over an OpenEnv server's WebSocket; build it with
    grpo.envs.openenv_load.load_environment."""

    def __init__(
        self,
        srv: Server,
        examples: list[Example],
        args: OpenEnvArgs,
        observation_field: str,
        timeout_s: float,
        max_reply_bytes: int,
        name: str = "openenv",
    ) -> None:
        self.server = srv
        self.name = name
        self.examples = examples
        self.max_turns = args.max_turns
        self.args = args
        self.observation_field = observation_field
        """args.observation_field, or the field load found (the observation's only string)."""
        self.timeout_s = timeout_s
        self.max_reply_bytes = max_reply_bytes
        self.failures = FailureLog()
        # an asyncio.Semaphore belongs to the loop it first waits on; each new loop gets its own
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def prompt_messages(self, example: Example) -> list[Message]:
        prompt = self.args.system_prompt
        system = [] if prompt is None else [{"role": "system", "content": prompt}]
        return [*system, {"role": "user", "content": example["prompt"]}]

    async def reset(self, example: Example) -> dict[str, Any]:
        state: dict[str, Any] = {
            "session": None,
            "failure": None,
            "rewards": [],
            "num_actions": 0,
            "num_rewards_stepped": 0,
            "done": False,
        }
        slots = self._session_slots()
        await slots.acquire()
        try:
            ws = await self._open()
        except BaseException as exc:
            slots.release()
            if not isinstance(exc, Exception):
                raise
            state["failure"] = self._failure("connect", exc)
            return state
        state["session"] = _Session(ws, slots)
        reply = await self._send(state, "reset", {"type": "reset", "data": example["info"]["reset"]})
        if reply is None:
            return state
        obs, _, done = reply
        try:
            text = observation_text(obs, self.observation_field, "reset")
        except ValueError as exc:
            state["failure"] = self._failure("reset", exc)
            return state
        if text != example["prompt"] or done:
            reason = (
                f"OpenEnv server {self.server.url}: reset({kwargs_text(example['info']['reset'])}) showed another "
                "first observation than when the examples were loaded; the environment must honour reset's seed"
            )
            self.failures.record(self.name, reason, reason)
            state["failure"] = reason
        return state

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        if state["failure"] is not None or state["done"]:
            return EnvReply(messages=[], done=True)
        text = await self._act(state, str(messages[-1].get("content", "")))
        reward = None
        if self.args.reward == "sum" and state["failure"] is None:
            # this step's reward is its model turn's; the score leaves it out (score docstring)
            reward = state["rewards"][-1]
            state["num_rewards_stepped"] = len(state["rewards"])
        if text is None:
            return EnvReply(messages=[], done=True, reward=reward)
        return EnvReply(messages=[{"role": "user", "content": text}], done=False, reward=reward)

    async def score(self, example: Example, completion: list[Message], state: dict[str, Any]) -> Score:
        """The episode's reward less the step rewards `step` already returned as turn rewards (the
        rollout loop adds those up with this score), and its metrics: env_reward is the whole return."""
        replies = [m for m in completion if m.get("role") == "assistant"]
        if state["failure"] is None and not state["done"] and state["num_actions"] < len(replies):
            await self._act(state, str(replies[-1].get("content", "")))
        if state["session"] is not None:
            await state["session"].close()
        if state["failure"] is not None:
            return Score(reward=0.0, failure=state["failure"])
        rewards = [0.0 if r is None else r for r in state["rewards"]]
        if self.args.reward == "last":
            total = unreported = rewards[-1] if rewards else 0.0
        else:
            total, unreported = sum(rewards), sum(rewards[state["num_rewards_stepped"] :])
        metrics = {
            "env_reward": total,
            "num_steps": float(len(rewards)),
            "episode_done": float(state["done"]),
        }
        return Score(reward=unreported, metrics=metrics)

    async def _act(self, state: dict[str, Any], reply: str) -> str | None:
        """Step the model's `reply`: the next observation's text, or None when the episode ended or failed."""
        state["num_actions"] += 1
        action = {**self.args.action_args, self.args.action_field: reply}
        result = await self._send(state, "step", {"type": "step", "data": action})
        if result is None:
            return None
        obs, reward, done = result
        state["rewards"].append(reward)
        if done:
            state["done"] = True
            return None
        try:
            return observation_text(obs, self.observation_field, "step")
        except ValueError as exc:
            state["failure"] = self._failure("step", exc)
            return None

    async def _open(self) -> Any:
        from websockets.asyncio.client import connect

        async with asyncio.timeout(self.timeout_s):
            return await connect(
                self.server.ws_url,
                additional_headers=self.server.headers,
                max_size=self.max_reply_bytes,
                open_timeout=None,  # bounded by request_timeout_s above
                proxy=None if self.server.loopback else True,
            )

    async def _send(
        self, state: dict[str, Any], what: str, message: dict[str, Any]
    ) -> tuple[dict[str, Any], float | None, bool] | None:
        """The observation answering `message`, or None with state["failure"] set."""
        from websockets.exceptions import ConnectionClosed

        ws = state["session"].ws
        try:
            async with asyncio.timeout(self.timeout_s):
                with contextlib.suppress(ConnectionClosed):
                    # a server that refuses the session (CAPACITY_REACHED) sends why and closes at once:
                    # the reason is still read below
                    await ws.send(json.dumps(message))
                raw = await ws.recv()
            return observation(json.loads(raw), what)
        except Exception as exc:  # whatever the server (or the network) does, only this rollout fails
            state["failure"] = self._failure(what, exc)
            return None

    def _session_slots(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.args.max_sessions))
        return self._slots[1]

    def _failure(self, what: str, exc: Exception) -> str:
        """The rollout's failure reason (deduplicated in the log): what went wrong, not which rollout."""
        from websockets.exceptions import ConnectionClosed

        where = f"OpenEnv server {self.server.url}"
        if isinstance(exc, ServerError):
            reason = f"{where} answered an error on {what}"
            if "CAPACITY_REACHED" in str(exc):
                reason += (
                    " (CAPACITY_REACHED: raise its max_concurrent_envs or lower env[].args.max_sessions)"
                )
        elif isinstance(exc, TimeoutError):
            reason = f"{where} sent no reply within {self.timeout_s:g} s on {what} (env[].request_timeout_s)"
        elif isinstance(exc, ConnectionClosed) and exc.sent is not None and exc.sent.code == 1009:
            reason = (
                f"{where} sent a reply above {self.max_reply_bytes / MIB:g} MiB on {what}; raise "
                "env[].max_reply_mib if its observations are meant to be that large"
            )
        elif isinstance(exc, ValueError):  # JSONDecodeError included
            reason = f"{where} sent a malformed reply on {what}"
        else:
            reason = f"{where} unreachable on {what} ({type(exc).__name__})"
        self.failures.record(self.name, reason, f"{reason}: {str(exc)[:300]}")
        return reason


def kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
