"""An LLM judge: a reward that asks an OpenAI-compatible chat endpoint about each reply.

The judge prompt (JudgeConfig.prompt) is filled with the example's prompt, the reply and the answer,
sent to <base_url>/chat/completions, and the verdict parsed into a score ("yes/no", or a regular
expression). `base_url: self` is the run's own inference server, which the orchestrator names once it
knows it (`use_own_server`): in co-located mode that server's address is only known after it started.
A failed request (after retries) or an unparsable verdict raises RewardFailure: that rollout fails
with the reason, never the run.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import RetryError

from grpo.config.sections.judges import MATCH_PREFIX, OWN_SERVER, JudgeConfig
from grpo.envs.base import Message
from grpo.envs.rewards import RewardFailure
from grpo.utils.auth import secret_from_env, warn_if_plaintext_token
from grpo.utils.backoff import attempts

RETRY_BASE_DELAY_S = 0.5
RETRY_MAX_DELAY_S = 8.0
VERDICT_CHARS = 120
"""How much of an unparsable verdict a failure reason quotes."""


@dataclass(frozen=True)
class Endpoint:
    """Where judge requests go."""

    base_url: str
    """Up to /v1."""
    model: str
    api_key: str | None = field(default=None, repr=False)
    """Kept out of repr: an endpoint shows up in logs and error messages."""


_own_server: Endpoint | None = None


def use_own_server(endpoint: Endpoint | None) -> None:
    """Name the run's own inference server (the orchestrator does, before it scores anything):
    what `base_url: self` judges call."""
    global _own_server
    _own_server = endpoint


def render(template: str, prompt: Any, completion: str, answer: Any) -> str:
    """The judge prompt with {prompt}, {completion}, {answer} filled in (a chat prompt as its last
    user message)."""
    return template.format(
        prompt=prompt_text(prompt), completion=completion, answer="" if answer is None else answer
    )


def prompt_text(prompt: str | list[Message]) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [str(m.get("content", "")) for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


def parse_verdict(parse: str, verdict: str) -> float:
    """The score in `verdict`; RewardFailure when it holds none."""
    text = verdict.strip()
    if parse == "yes/no":
        first = re.match(r"\W*(\w+)", text)
        word = first.group(1).lower() if first else ""
        if word in ("yes", "no"):
            return 1.0 if word == "yes" else 0.0
    elif parse.startswith(MATCH_PREFIX):
        return 1.0 if re.search(parse.removeprefix(MATCH_PREFIX), text) else 0.0
    else:
        match = re.search(parse, text)
        if match is not None:
            found = match.group(1) if match.groups() else match.group(0)
            try:
                return float(found)
            except (TypeError, ValueError):
                pass
    raise RewardFailure(f"unparsable verdict {text[:VERDICT_CHARS]!r} (parse: {parse})")


class Judge:
    """One env block's judge: `await judge(prompt, completion, answer)` -> score."""

    def __init__(self, cfg: JudgeConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = cfg
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._limit: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_requests = 0
        """Requests sent (attempts included)."""

    def endpoint(self) -> Endpoint:
        cfg = self.cfg
        own = cfg.base_url == OWN_SERVER
        if own and _own_server is None:
            raise RewardFailure(
                "judge base_url: self, but no run server is known here (outside a grpo run); set judge.base_url"
            )
        base = _own_server if own else None
        model = cfg.model or (base.model if base else None)
        if not model:
            raise RewardFailure("judge has no model: set judge.model (or model.name for base_url: self)")
        key = secret_from_env(cfg.api_key_env)
        api_key = key.decode() if key is not None else (base.api_key if base else None)
        url = base.base_url if base else cfg.base_url
        if api_key is not None:
            warn_if_plaintext_token(url, "judge")
        return Endpoint(url, model, api_key)

    async def __call__(self, prompt: Any, completion: str, answer: Any = None) -> float:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # made on the event loop that scores (the loader runs in a thread; a client is bound to
            # the loop it first ran on)
            self._client = httpx.AsyncClient(transport=self._transport, timeout=self.cfg.timeout_s)
            self._limit = asyncio.Semaphore(self.cfg.max_concurrency)
            self._loop = loop
        assert self._limit is not None
        endpoint = self.endpoint()
        messages = [{"role": "user", "content": render(self.cfg.prompt, prompt, completion, answer)}]
        if self.cfg.system_prompt:
            messages.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        async with self._limit:
            verdict = await self._ask(endpoint, messages)
        return parse_verdict(self.cfg.parse, verdict)

    async def _ask(self, endpoint: Endpoint, messages: list[dict[str, str]]) -> str:
        assert self._client is not None
        body = {
            "model": endpoint.model,
            "messages": messages,
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
        }
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        url = endpoint.base_url.rstrip("/") + "/chat/completions"

        async def ask() -> str:
            assert self._client is not None
            self.num_requests += 1
            response = await self._client.post(url, json=body, headers=headers)
            status = response.status_code
            if status < 400:
                return _content(response, url)
            failure = _Busy if status >= 500 or status == 429 else RewardFailure
            raise failure(f"judge {url} answered HTTP {status}: {response.text[:VERDICT_CHARS]}")

        def retry_on(error: BaseException) -> bool:
            return isinstance(error, httpx.TransportError | _Busy)

        try:
            verdict: str = await attempts(
                self.cfg.max_retries, retry_on, RETRY_BASE_DELAY_S, RETRY_MAX_DELAY_S
            )(ask)
        except RetryError as gave_up:
            error = gave_up.last_attempt.exception()
            if isinstance(error, _Busy):
                raise RewardFailure(str(error)) from error
            raise RewardFailure(f"judge request to {url} failed: {type(error).__name__}: {error}") from error
        return verdict

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class _Busy(RewardFailure):
    """The judge answered 429 or 5xx: worth another attempt."""


def _content(response: httpx.Response, url: str) -> str:
    try:
        content = response.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise RewardFailure(f"judge {url} sent no chat completion ({type(exc).__name__})") from exc
    return "" if content is None else str(content)


def judge_reward(judge: Judge) -> Any:
    """The judge as a per-rollout reward function of a SingleTurnEnv."""

    async def judge_fn(prompt: Any, completion: str, answer: Any = None) -> float:
        return await judge(prompt, completion, answer)

    judge_fn.__name__ = judge.cfg.name
    return judge_fn


def judge_group_reward(judge: Judge) -> Any:
    """The judge as a TRL-style function of a dataset block: one verdict per completion, concurrently;
    a failed one is that completion's RewardFailure (the others keep their scores)."""

    async def judge_fn(prompts: list[Any], completions: list[Any], **columns: Any) -> list[Any]:
        answers = columns.get("answer") or [None] * len(completions)
        calls = [
            judge(p, c if isinstance(c, str) else _reply(c), a)
            for p, c, a in zip(prompts, completions, answers, strict=True)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, RewardFailure):
                raise r
        return list(results)

    judge_fn.__name__ = judge.cfg.name
    return judge_fn


def _reply(completion: list[Message]) -> str:
    return "\n".join(str(m.get("content", "")) for m in completion if m.get("role") == "assistant")
