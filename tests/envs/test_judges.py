"""The LLM judge: its prompt, its request (model, API key), its verdict parsing, its failures."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from grpo.config.orchestrator import EnvConfig
from grpo.config.sections.dataset_env import DatasetEnvConfig
from grpo.config.sections.judges import JudgeConfig
from grpo.envs import load_environment
from grpo.envs.base import GroupScoring
from grpo.envs.judge import Endpoint, Judge, parse_verdict, render, use_own_server
from grpo.envs.rewards import RewardFailure
from grpo.utils.errors import UserError

KEY = "judge-key-0123456789abcdef"
PROMPT = "Q: {prompt}\nA: {completion}\nRef: {answer}\nCorrect?"


class FakeChat:
    """An OpenAI-compatible /v1/chat/completions as an httpx transport: answers `replies` in turn
    (a str is the verdict, an int an HTTP status), records each request."""

    def __init__(self, *replies: str | int) -> None:
        self.replies = list(replies)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if isinstance(reply, int):
            return httpx.Response(reply, text="overloaded")
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": reply}}]})

    def body(self, index: int = -1) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.requests[index].content)
        return body


def _judge(fake: FakeChat, **cfg: Any) -> Judge:
    config = JudgeConfig(prompt=PROMPT, base_url="http://judge.test/v1", model="judge-model", **cfg)
    return Judge(config, transport=httpx.MockTransport(fake))


def test_the_judge_fills_its_prompt_and_sends_model_key_and_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_KEY", KEY)
    fake = FakeChat("Yes, it is.")
    judge = _judge(fake, api_key_env="JUDGE_KEY", system_prompt="Be strict.", max_tokens=7)
    chat_prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "2+2?"}]
    assert asyncio.run(judge(chat_prompt, "4", "4")) == 1.0
    (request,) = fake.requests
    assert str(request.url) == "http://judge.test/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert fake.body() == {
        "model": "judge-model",
        "messages": [
            {"role": "system", "content": "Be strict."},
            {"role": "user", "content": "Q: 2+2?\nA: 4\nRef: 4\nCorrect?"},
        ],
        "max_tokens": 7,
        "temperature": 0.0,
    }


def test_no_key_configured_sends_no_authorization_header() -> None:
    fake = FakeChat("no")
    assert asyncio.run(_judge(fake)("p", "c")) == 0.0
    assert "authorization" not in fake.requests[0].headers


def test_render_leaves_a_missing_answer_empty() -> None:
    assert render("{prompt}|{completion}|{answer}", "p", "c", None) == "p|c|"


@pytest.mark.parametrize(
    ("parse", "verdict", "score"),
    [
        ("yes/no", "YES", 1.0),
        ("yes/no", "  **No**, because", 0.0),
        (r"(\d+(?:\.\d+)?)\s*/\s*10", "I give it 7.5/10", 7.5),
        (r"\d", "score: 3 of 5", 3.0),
        (r"match:\d", "three is 3", 1.0),
        (r"match:\d", "no digit here", 0.0),
    ],
)
def test_verdicts_parse_into_scores(parse: str, verdict: str, score: float) -> None:
    assert parse_verdict(parse, verdict) == score


@pytest.mark.parametrize(("parse", "verdict"), [("yes/no", "maybe yes"), (r"(\d+)/10", "great answer")])
def test_an_unparsable_verdict_is_a_reward_failure_quoting_it(parse: str, verdict: str) -> None:
    with pytest.raises(RewardFailure, match="unparsable verdict"):
        parse_verdict(parse, verdict)


def test_server_errors_are_retried_and_client_errors_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("grpo.envs.judge.RETRY_BASE_DELAY_S", 0.0)
    fake = FakeChat(503, 429, "yes")
    assert asyncio.run(_judge(fake, max_retries=2)("p", "c")) == 1.0
    assert len(fake.requests) == 3
    fake = FakeChat(401)
    with pytest.raises(RewardFailure, match="HTTP 401"):
        asyncio.run(_judge(fake, max_retries=2)("p", "c"))
    assert len(fake.requests) == 1
    fake = FakeChat(500)
    with pytest.raises(RewardFailure, match="HTTP 500"):
        asyncio.run(_judge(fake, max_retries=1)("p", "c"))
    assert len(fake.requests) == 2


def test_a_judge_prompt_naming_an_unknown_field_is_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"judge.prompt names \{question\}"):
        JudgeConfig(prompt="{question}")


# A real server for the config path: the judge an env block builds is the one a run uses.


class ChatServer:
    """A real OpenAI-compatible /v1/chat/completions on 127.0.0.1 (starlette + uvicorn)."""

    def __init__(self, verdict: str | int) -> None:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.verdict = verdict
        self.requests: list[tuple[dict[str, Any], str | None]] = []

        async def chat(request: Request) -> JSONResponse:
            self.requests.append((await request.json(), request.headers.get("authorization")))
            if isinstance(self.verdict, int):
                return JSONResponse({"error": "down"}, status_code=self.verdict)
            return JSONResponse({"choices": [{"message": {"role": "assistant", "content": self.verdict}}]})

        self.app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> ChatServer:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(self.app, port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture
def chat_server() -> Iterator[ChatServer]:
    with ChatServer("yes") as server:
        yield server


def _reply(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def test_an_id_block_judge_scores_each_reply_as_its_own_metric(chat_server: ChatServer) -> None:
    judge = {"prompt": PROMPT, "base_url": chat_server.base_url, "model": "m", "weight": 0.25}
    env = load_environment(EnvConfig(id="short-answer", judge=judge))
    example = env.examples[0]
    score = asyncio.run(env.score(example, _reply("whatever"), {}))
    assert not score.failed and score.metrics["judge"] == 1.0
    ((body, _),) = chat_server.requests
    assert body["messages"][0]["content"].endswith(
        "A: whatever\nRef: " + str(example.get("answer", "")) + "\nCorrect?"
    )


def test_base_url_self_uses_the_runs_own_server_model_and_key(chat_server: ChatServer) -> None:
    use_own_server(Endpoint(chat_server.base_url, "the-policy", KEY))
    try:
        env = load_environment(EnvConfig(id="short-answer", judge={"prompt": PROMPT}))
        score = asyncio.run(env.score(env.examples[0], _reply("x"), {}))
    finally:
        use_own_server(None)
    assert score.metrics["judge"] == 1.0
    ((body, authorization),) = chat_server.requests
    assert body["model"] == "the-policy" and authorization == f"Bearer {KEY}"


def test_a_failing_judge_fails_only_its_rollout_with_the_reason(tmp_path: Path) -> None:
    with ChatServer(404) as server:
        env = load_environment(
            EnvConfig(id="short-answer", judge={"prompt": PROMPT, "base_url": server.base_url, "model": "m"})
        )
        score = asyncio.run(env.score(env.examples[0], _reply("x"), {}))
    assert score.failed and score.reward == 0.0
    assert (
        score.failure is not None
        and score.failure.startswith("reward judge: judge ")
        and "HTTP 404" in score.failure
    )


def one(completions: list[Any], **columns: Any) -> list[float]:
    return [1.0] * len(completions)


def test_a_dataset_block_judge_fails_only_the_completions_it_could_not_judge(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    with ChatServer("yes") as server:
        cfg = DatasetEnvConfig(
            dataset=str(data),
            reward_funcs=[f"{__name__}:one"],
            judge={"prompt": PROMPT, "base_url": server.base_url, "model": "m", "parse": r"(\d)"},
        )
        env = load_environment(cfg)
        assert isinstance(env, GroupScoring)
        server.verdict = "score 1"
        ok = asyncio.run(env.score_group(env.examples[0], [_reply("4")], [[1]]))
        server.verdict = "no digits"
        bad = asyncio.run(env.score_group(env.examples[0], [_reply("5")], [[1]]))
    assert ok[0].metrics["judge"] == 1.0 and not ok[0].failed
    assert bad[0].failed and "unparsable verdict 'no digits'" in (bad[0].failure or "")
    assert "Q: 2+2?\nA: 4\nRef: 4" in server.requests[0][0]["messages"][0]["content"]


def test_judge_and_reward_model_keys_are_refused_for_a_remote_env() -> None:
    with pytest.raises(UserError, match="added in-process"):
        load_environment(EnvConfig(id="x", address="127.0.0.1:9", judge={"prompt": PROMPT}))
