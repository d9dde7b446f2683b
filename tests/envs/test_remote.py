"""RemoteEnv against a grpo-env server: same examples, prompts, replies and scores as in-process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from free_ports import free_port
from one_line_refusal import assert_refused_in_one_line
from remote_env_fixtures import SECRET, load_broken_env, load_echo_env, load_guess_env

from grpo.config.orchestrator import EnvConfig
from grpo.envs import Environment, Message
from grpo.envs import remote as remote_module
from grpo.envs.loading import load_environment
from grpo.envs.remote import RemoteEnv
from grpo.envs.server import BackgroundServer, SessionStore, build_app, info_payload

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def echo_address() -> Iterator[str]:
    with BackgroundServer(build_app(load_echo_env(), "echo-id")) as address:
        yield address


@pytest.fixture(scope="module")
def guess_address() -> Iterator[str]:
    with BackgroundServer(build_app(load_guess_env(), "guess-id")) as address:
        yield address


def _reply(text: str) -> list[Message]:
    return [{"role": "assistant", "content": text}]


def test_remote_env_lists_the_same_examples_and_prompts(echo_address: str) -> None:
    local = load_echo_env()
    remote = load_environment(EnvConfig(id="echo-id", name="echo-remote", address=echo_address))
    assert isinstance(remote, Environment)
    assert remote.name == "echo-remote"
    assert remote.max_turns == 1
    assert remote.examples == local.examples
    for example in remote.examples:
        assert remote.prompt_messages(example) == local.prompt_messages(example)
    assert remote.prompt_messages(remote.examples[0])[0] == {"role": "system", "content": "be brief"}


def test_remote_scores_equal_local_scores(echo_address: str) -> None:
    local = load_echo_env()
    remote = RemoteEnv.connect(echo_address, "echo-id", "echo")

    async def both(example: dict[str, Any], text: str) -> tuple[Any, Any]:
        remote_state = await remote.reset(example)
        local_state = await local.reset(example)
        return (
            await remote.score(example, _reply(text), remote_state),
            await local.score(example, _reply(text), local_state),
        )

    for example, text in [
        (remote.examples[0], "0"),
        (remote.examples[3], "wrong"),
        (remote.examples[5], "9"),
    ]:
        got, want = asyncio.run(both(example, text))
        assert got == want
    got, _ = asyncio.run(both(remote.examples[0], "0"))
    assert got.reward == pytest.approx(1.0 + 0.5 / 2) and not got.failed


def test_multi_turn_steps_and_scores_match_local_with_state_kept_on_server(guess_address: str) -> None:
    local = load_guess_env()
    remote = RemoteEnv.connect(guess_address, "guess-id", "guess")
    assert remote.max_turns == 4

    async def play(env: Environment) -> tuple[list[tuple[list[Message], bool, float | None]], Any]:
        example = env.examples[0]
        state = await env.reset(example)
        history = env.prompt_messages(example)
        completion: list[Message] = []
        replies = []
        for guess in ["3", "9", str(SECRET)]:
            history += _reply(guess)
            completion += _reply(guess)
            reply = await env.step(history, state)
            replies.append((reply.messages, reply.done, reply.reward))
            history += reply.messages
            completion += reply.messages
        return replies, await env.score(example, completion, state)

    remote_replies, remote_score = asyncio.run(play(remote))
    local_replies, local_score = asyncio.run(play(local))
    assert remote_replies == local_replies
    assert [messages for messages, _, _ in remote_replies[:2]] == [
        [{"role": "user", "content": "higher"}],
        [{"role": "user", "content": "lower"}],
    ]
    assert remote_replies[-1] == ([], True, 0.5)
    assert [reward for *_, reward in remote_replies[:2]] == [None, None]
    assert remote_score == local_score
    assert remote_score.reward == pytest.approx(1.0 + 1 / 3)  # the server-side set saw three guesses


def test_scoring_ends_the_session_on_the_server() -> None:
    app = build_app(load_guess_env(), "guess-id")
    with BackgroundServer(app) as address:
        remote = RemoteEnv.connect(address, "guess-id", "guess")

        async def rollout() -> Any:
            state = await remote.reset(remote.examples[0])
            assert len(app.state.sessions) == 1
            first = await remote.score(remote.examples[0], _reply(str(SECRET)), state)
            second = await remote.score(remote.examples[0], _reply(str(SECRET)), state)
            return first, second

        first, second = asyncio.run(rollout())
    assert not first.failed and len(app.state.sessions) == 0
    assert second.failed and "404" in (second.failure or "")


def test_raising_reward_on_the_server_gives_a_failed_score() -> None:
    with BackgroundServer(build_app(load_broken_env(), "broken-id")) as address:
        remote = RemoteEnv.connect(address, "broken-id", "broken")

        async def rollout() -> Any:
            state = await remote.reset(remote.examples[0])
            return await remote.score(remote.examples[0], _reply("hello"), state)

        score = asyncio.run(rollout())
    assert score.reward == 0.0
    assert score.failure == "reward broken raised RuntimeError"


def test_oldest_sessions_are_evicted_beyond_the_limit() -> None:
    store = SessionStore("env", max_sessions=2)
    ids = [store.add({"n": i}) for i in range(3)]
    assert store.get(ids[0]) is None
    assert [store.get(i) for i in ids[1:]] == [{"n": 1}, {"n": 2}]
    assert store.num_evicted == 1 and len(store) == 2


def test_evicted_session_fails_its_rollout_not_the_run() -> None:
    with BackgroundServer(build_app(load_guess_env(), "guess-id", max_sessions=1)) as address:
        remote = RemoteEnv.connect(address, "guess-id", "guess")

        async def two_rollouts() -> Any:
            old = await remote.reset(remote.examples[0])
            new = await remote.reset(remote.examples[1])
            reply = await remote.step(_reply("3"), old)
            return reply, await remote.score(remote.examples[0], _reply("3"), old), new

        reply, score, new = asyncio.run(two_rollouts())
    assert reply.done and reply.messages == []
    assert score.failed and "404 on /step" in (score.failure or "")
    assert new["session_id"] is not None


def test_server_down_at_load_names_the_address_and_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_module, "CONNECT_RETRY_S", 0.3)
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=rf"{address}.*grpo-env echo-id --port"):
        load_environment(EnvConfig(id="echo-id", address=address))


def test_client_refuses_a_server_serving_another_env_or_loader_args(echo_address: str) -> None:
    with pytest.raises(ValueError, match="serves 'echo-id'"):
        load_environment(EnvConfig(id="math", address=echo_address))
    with pytest.raises(ValueError, match="args go to the server"):
        load_environment(EnvConfig(id="echo-id", address=echo_address, args={"n": 1}))
    with pytest.raises(ValueError, match="not host:port"):
        load_environment(EnvConfig(id="echo-id", address="localhost"))


def test_examples_without_json_form_are_refused_at_server_start() -> None:
    env = load_echo_env()
    env.examples[2]["info"] = {"bad": object()}
    with pytest.raises(ValueError, match="example 2"):
        info_payload(env, "echo-id")


# ---- a real grpo-env process -------------------------------------------------------------------


@pytest.fixture
def guess_server_process() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "grpo.cli.env", "remote_env_fixtures:load_guess_env", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc, f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()


def test_killed_server_mid_run_fails_rollouts_and_leaves_no_process(
    guess_server_process: tuple[subprocess.Popen[bytes], str],
) -> None:
    proc, address = guess_server_process
    remote = RemoteEnv.connect(address, "remote_env_fixtures:load_guess_env", "guess", retry_s=60)
    example = remote.examples[0]

    async def rollouts_across_a_crash() -> Any:
        started = await remote.reset(example)
        assert (await remote.step(_reply("3"), started)).messages == [{"role": "user", "content": "higher"}]
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 30)
        reply = await remote.step(_reply(str(SECRET)), started)
        after_step = await remote.score(example, _reply(str(SECRET)), started)
        fresh = await remote.reset(example)
        after_reset = await remote.score(example, _reply(str(SECRET)), fresh)
        return reply, after_step, after_reset

    reply, after_step, after_reset = asyncio.run(rollouts_across_a_crash())
    assert reply.done
    for score in (after_step, after_reset):
        assert score.reward == 0.0 and score.failed
        assert f"env server {address} unreachable" in (score.failure or "")
    assert proc.poll() == -signal.SIGKILL


def test_server_process_stops_cleanly_on_sigterm(
    guess_server_process: tuple[subprocess.Popen[bytes], str],
) -> None:
    proc, address = guess_server_process
    remote = RemoteEnv.connect(address, "remote_env_fixtures:load_guess_env", "guess", retry_s=60)
    assert len(remote.examples) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["reverse-text", "--args", "[1]"], "--args must be a JSON object"),
        (["no-such-module:load"], "no module named 'no-such-module'"),
    ],
)
def test_bad_server_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "grpo.cli.env", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-env: error:") and message in lines[0]


def test_another_kind_of_server_at_the_address_is_a_clear_error() -> None:
    from fastapi import FastAPI

    other = FastAPI()

    @other.get("/info")
    async def info() -> dict[str, str]:
        return {"service": "something else"}

    with BackgroundServer(other) as address, pytest.raises(ValueError, match="not like a grpo-env server"):
        load_environment(EnvConfig(id="echo-id", address=address))


# ---- hardening: auth, limits, bounded sessions, malformed replies -------------------------------


def test_server_with_a_token_refuses_clients_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    monkeypatch.delenv(remote_module.TOKEN_ENV, raising=False)
    with BackgroundServer(build_app(load_echo_env(), "echo-id", token="s3cret-env-token-0123")) as address:
        assert httpx.post(f"http://{address}/reset", json={"example": {}}).status_code == 401
        with pytest.raises(ValueError, match="refused the token; export GRPO_ENV_TOKEN"):
            RemoteEnv.connect(address, "echo-id", "echo", retry_s=0)
        monkeypatch.setenv(remote_module.TOKEN_ENV, "s3cret-env-token-0123")
        remote = RemoteEnv.connect(address, "echo-id", "echo", retry_s=0)

        async def rollout() -> Any:
            state = await remote.reset(remote.examples[0])
            return await remote.score(remote.examples[0], _reply("0"), state)

        assert not asyncio.run(rollout()).failed


def test_request_bodies_above_the_limit_are_refused() -> None:
    import httpx

    with BackgroundServer(build_app(load_echo_env(), "echo-id", max_body_bytes=1000)) as address:
        big = {"example": {"prompt": "x" * 2000}}
        assert httpx.post(f"http://{address}/reset", json=big).status_code == 413

        def chunks() -> Iterator[bytes]:  # no content-length: the limit counts what arrives
            yield b'{"example": {"prompt": "'
            yield b"x" * 2000
            yield b'"}}'

        assert httpx.post(f"http://{address}/reset", content=chunks()).status_code == 413
        small = httpx.post(f"http://{address}/reset", json={"example": {"prompt": "say 0"}})
        assert small.status_code == 200


def test_a_reset_flood_from_one_client_evicts_only_its_own_sessions() -> None:
    store = SessionStore("env", max_sessions=6, max_sessions_per_client=3)
    live = store.add({"n": "live"}, client="10.0.0.1")
    flood = [store.add({"n": i}, client="10.0.0.2") for i in range(100)]
    assert store.get(live) == {"n": "live"}
    assert [store.get(i) for i in flood[-3:]] == [{"n": 97}, {"n": 98}, {"n": 99}]
    assert len(store) == 4
    # the total bound takes from the biggest holder, not from the oldest session overall
    store = SessionStore("env", max_sessions=3, max_sessions_per_client=3)
    live = store.add({"n": "live"}, client="a")
    for i in range(10):
        store.add({"n": i}, client="b")
    assert store.get(live) == {"n": "live"} and len(store) == 3


def _not_grpo_env_app(reset_reply: Any, score_reply: Any, html: bool = False) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse

    app = FastAPI()
    info = info_payload(load_echo_env(), "echo-id")

    @app.get("/info")
    async def get_info() -> dict[str, Any]:
        return info

    @app.post("/reset")
    async def reset() -> Any:
        return HTMLResponse("<html>proxy says hi</html>") if html else reset_reply

    @app.post("/score")
    async def score() -> Any:
        return score_reply

    return app


@pytest.mark.parametrize(
    ("reset_reply", "score_reply", "html", "where"),
    [
        (None, None, True, "/reset"),
        ({"session_id": "s"}, {"metrics": {}, "failure": None}, False, "/score"),
        ({"session_id": "s"}, {"reward": "high", "metrics": {}, "failure": None}, False, "/score"),
        ({"session_id": "s"}, [1, 2], False, "/score"),
        ({"session": 3}, None, False, "/reset"),
    ],
)
def test_a_malformed_reply_fails_the_rollout_not_the_run(
    reset_reply: Any, score_reply: Any, html: bool, where: str
) -> None:
    with BackgroundServer(_not_grpo_env_app(reset_reply, score_reply, html)) as address:
        remote = RemoteEnv.connect(address, "echo-id", "echo", retry_s=0)

        async def rollout() -> Any:
            state = await remote.reset(remote.examples[0])
            return await remote.score(remote.examples[0], _reply("0"), state)

        score = asyncio.run(rollout())
    assert score.failed and score.reward == 0.0
    assert score.failure == f"env server {address} sent a malformed reply on {where}"


def test_grpo_env_refuses_a_public_bind_without_a_token() -> None:
    assert_refused_in_one_line(
        [sys.executable, "-m", "grpo.cli.env", "echo", "--host", "0.0.0.0"],
        "GRPO_ENV_TOKEN",
        "export GRPO_ENV_TOKEN",
        timeout=60,
    )
