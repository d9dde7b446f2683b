"""`openenv:` env blocks against a real OpenEnv server (openenv-core's own create_fastapi_app on loopback):
examples from resets, replies as actions, observations as user turns, rewards summed, failures per rollout."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from one_line_refusal import assert_refused_in_one_line
from openenv_fixtures import MAX_GUESSES, WRONG, guess_server, target
from pydantic import ValidationError

from grpo.config.orchestrator import EnvConfig
from grpo.envs import Environment, Message, Score, openenv_load
from grpo.envs.loading import check_environment, load_environment
from grpo.envs.openenv_env import OpenEnvEnv, server
from grpo.utils.errors import UserError


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with guess_server(max_concurrent_envs=8) as address:
        yield f"http://{address}"


def _load(url: str, **args: Any) -> OpenEnvEnv:
    env = load_environment(EnvConfig(id=f"openenv:{url}", args={"max_sessions": 8, **args}))
    assert isinstance(env, OpenEnvEnv)
    return env


async def _play(env: Environment, example: dict[str, Any], replies: list[str]) -> tuple[list[Message], Score]:
    completion, score, _ = await _play_turns(env, example, replies)
    return completion, score


async def _play_turns(
    env: Environment, example: dict[str, Any], replies: list[str]
) -> tuple[list[Message], Score, list[float]]:
    """One rollout as the orchestrator runs it: step after every model turn but the last (or until done),
    then score. Also each model turn's reward as the rollout loop adds them up: its step's reward, and
    the score on the last turn."""
    state = await env.reset(example)
    completion: list[Message] = []
    turn_rewards: list[float] = []
    history = env.prompt_messages(example)
    for turn, text in enumerate(replies):
        reply = {"role": "assistant", "content": text}
        history.append(reply)
        completion.append(reply)
        turn_rewards.append(0.0)
        if turn == env.max_turns - 1 or turn == len(replies) - 1:
            break
        env_reply = await env.step(history, state)
        turn_rewards[-1] += env_reply.reward or 0.0
        if env_reply.done:
            break
        history += env_reply.messages
        completion += env_reply.messages
    score = await env.score(example, completion, state)
    turn_rewards[-1] += score.reward
    return completion, score, turn_rewards


def test_examples_are_the_first_observations_of_seeded_resets(url: str) -> None:
    env = load_environment(
        EnvConfig(
            id=f"openenv:{url}", args={"num_examples": 3, "seed": 5, "system_prompt": "Answer with a number."}
        )
    )
    assert isinstance(env, Environment) and env.name == "openenv"
    assert [e["prompt"] for e in env.examples] == [
        f"Game {s}: guess my number from 1 to 10." for s in (5, 6, 7)
    ]
    assert env.prompt_messages(env.examples[0]) == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "Game 5: guess my number from 1 to 10."},
    ]


def test_a_multi_step_episode_is_a_multi_turn_rollout_with_each_steps_reward_on_its_turn(url: str) -> None:
    env = _load(url, num_examples=2, max_turns=5)
    example = env.examples[1]
    right = target(1)
    completion, score, turn_rewards = asyncio.run(
        _play_turns(env, example, [str(right + 1), f"then {right}"])
    )
    assert [m["content"] for m in completion] == [str(right + 1), "lower", f"then {right}"]
    assert [m["role"] for m in completion] == ["assistant", "user", "assistant"]
    assert not score.failed
    # the wrong guess's step reward on turn 0; the right one, stepped when scored, in the score
    assert turn_rewards == [WRONG, 1.0] and score.reward == 1.0
    assert score.metrics == {"env_reward": pytest.approx(WRONG + 1.0), "num_steps": 2.0, "episode_done": 1.0}


def test_the_episode_ends_when_the_server_says_done(url: str) -> None:
    env = _load(url, num_examples=1, max_turns=8)
    wrong = str(target(0) + 1)
    completion, score, turn_rewards = asyncio.run(_play_turns(env, env.examples[0], [wrong] * 8))
    assert [m["content"] for m in completion if m["role"] == "user"] == ["lower"] * (MAX_GUESSES - 1)
    # every step came back through step (the last one ended the episode): the score adds nothing
    assert turn_rewards == [WRONG] * MAX_GUESSES and score.reward == 0.0
    assert score.metrics["env_reward"] == pytest.approx(MAX_GUESSES * WRONG)
    assert score.metrics["episode_done"] == 1.0


def test_a_single_turn_rollout_steps_its_reply_when_scored(url: str) -> None:
    env = _load(url, num_examples=1, max_turns=1)
    _, right = asyncio.run(_play(env, env.examples[0], [str(target(0))]))
    _, wrong = asyncio.run(_play(env, env.examples[0], ["no idea"]))
    assert (right.reward, wrong.reward) == (1.0, WRONG)
    assert wrong.metrics["episode_done"] == 0.0


def test_reward_last_takes_the_final_step_reward_on_the_last_turn_only(url: str) -> None:
    env = _load(url, num_examples=1, max_turns=4, reward="last")
    _, score, turn_rewards = asyncio.run(_play_turns(env, env.examples[0], ["11", "12", str(target(0))]))
    assert score.reward == 1.0 and score.metrics["num_steps"] == 3.0
    assert turn_rewards == [0.0, 0.0, 1.0]  # a running total is no turn's own reward


def test_a_reset_that_shows_another_first_observation_fails_the_rollout(url: str) -> None:
    env = _load(url, num_examples=1)
    tampered = {**env.examples[0], "prompt": "something else"}
    _, score = asyncio.run(_play(env, tampered, ["1"]))
    assert score.failed and "must honour reset's seed" in str(score.failure)


def test_a_dead_server_fails_only_the_rollout_with_the_reason() -> None:
    srv = guess_server()
    address = srv.start()
    env = _load(f"http://{address}", num_examples=1)
    srv.stop()
    _, score = asyncio.run(_play(env, env.examples[0], ["1"]))
    assert score.failed and score.reward == 0.0
    assert score.failure == f"OpenEnv server http://{address} unreachable on connect (ConnectionRefusedError)"


def test_a_server_that_dies_mid_episode_fails_the_rollout() -> None:
    srv = guess_server()
    address = srv.start()
    env = _load(f"http://{address}", num_examples=1, max_turns=3)

    async def rollout() -> Score:
        state = await env.reset(env.examples[0])
        srv.stop()  # uvicorn closes the open WebSocket as it shuts down
        history = [{"role": "assistant", "content": "11"}]
        reply = await env.step(history, state)
        assert reply.done and reply.messages == []
        return await env.score(env.examples[0], history, state)

    score = asyncio.run(rollout())
    assert score.failed and str(score.failure).startswith(f"OpenEnv server http://{address} ")
    assert "on step" in str(score.failure)


def test_sessions_are_capped_at_max_sessions() -> None:
    with guess_server(max_concurrent_envs=1) as address:
        capped = _load(f"http://{address}", num_examples=1, max_sessions=1)
        too_many = _load(f"http://{address}", num_examples=1, max_sessions=2)

        async def group(env: OpenEnvEnv) -> list[Score]:
            plays = [_play(env, env.examples[0], [str(target(0))]) for _ in range(3)]
            return [score for _, score in await asyncio.gather(*plays)]

        assert [s.reward for s in asyncio.run(group(capped))] == [1.0, 1.0, 1.0]
        failures = [s.failure for s in asyncio.run(group(too_many)) if s.failed]
        assert failures and all("CAPACITY_REACHED" in str(f) and "max_sessions" in str(f) for f in failures)


def test_an_unscored_rollout_gives_its_session_back() -> None:
    """buffer.skip_verification never scores: dropping the rollout's state must free its session."""
    with guess_server(max_concurrent_envs=1) as address:
        env = _load(f"http://{address}", num_examples=1, max_sessions=1)

        async def two_rollouts() -> Score:
            state = await env.reset(env.examples[0])
            assert state["failure"] is None
            del state
            gc.collect()
            async with asyncio.timeout(10):
                _, score = await _play(env, env.examples[0], [str(target(0))])
            return score

        assert asyncio.run(two_rollouts()).reward == 1.0


def test_a_reply_above_max_reply_mib_fails_the_rollout(url: str) -> None:
    env = _load(url, num_examples=1, max_turns=2)
    env.max_reply_bytes = 40  # the step reply (an observation message) is longer
    _, score = asyncio.run(_play(env, env.examples[0], ["11", "12"]))
    assert score.failed and "above" in str(score.failure) and "max_reply_mib" in str(score.failure)


def test_dry_run_checks_the_action_field_against_the_servers_schema(url: str) -> None:
    check_environment(EnvConfig(id=f"openenv:{url}", args={"num_examples": 1}))
    with pytest.raises(UserError, match=r"has no field 'text' \(its fields: message\).*action_field"):
        check_environment(EnvConfig(id=f"openenv:{url}", args={"action_field": "text"}))
    with pytest.raises(UserError, match=r"observation's 'answer' is NoneType.*observation_field"):
        check_environment(EnvConfig(id=f"openenv:{url}", args={"observation_field": "answer"}))
    with pytest.raises(UserError, match=r"unknown arg 'num_example'.*did you mean 'num_examples'"):
        check_environment(EnvConfig(id=f"openenv:{url}", args={"num_example": 1}))
    with pytest.raises(
        UserError, match=r"arg 'max_turns': .*greater than or equal to 1, got 0; fix env\[\]\.args\.max_turns"
    ):
        check_environment(EnvConfig(id=f"openenv:{url}", args={"max_turns": 0}))


def test_dry_run_without_a_server_says_to_start_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openenv_load, "CONNECT_RETRY_S", 0.3)
    with guess_server() as address:
        pass  # a port nothing listens on any more
    with pytest.raises(UserError, match=r"no OpenEnv server answers .*start it first"):
        check_environment(EnvConfig(id=f"openenv:http://{address}"))


def test_openenv_ids_must_be_urls_with_a_port() -> None:
    for bad in ("openenv:localhost:8001", "openenv:ftp://127.0.0.1:1", "openenv:http://127.0.0.1"):
        with pytest.raises(ValidationError, match="scheme and port"):
            EnvConfig(id=bad)
    with pytest.raises(ValidationError, match="base URL only"):
        EnvConfig(id="openenv:http://127.0.0.1:8001/ws")
    with pytest.raises(ValidationError, match=r"remove env\[\]\.address"):
        EnvConfig(id="openenv:http://127.0.0.1:8001", address="127.0.0.1:8001")


def test_a_token_lets_a_remote_host_through_as_a_bearer_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_OPENENV_TOKEN", "x" * 32)
    srv = server("https://envs.example.org:443", "MY_OPENENV_TOKEN")
    assert srv.ws_url == "wss://envs.example.org:443/ws" and srv.http_url == "https://envs.example.org:443"
    assert srv.headers == {"Authorization": f"Bearer {'x' * 32}"} and not srv.loopback
    monkeypatch.delenv("MY_OPENENV_TOKEN")
    with pytest.raises(
        UserError, match=r"envs.example.org is not this machine and \$MY_OPENENV_TOKEN is unset"
    ):
        server("https://envs.example.org:443", "MY_OPENENV_TOKEN")


def test_a_remote_openenv_host_without_a_token_is_refused_in_one_line(tmp_path: Any) -> None:
    (tmp_path / "o.yaml").write_text('env:\n  - id: "openenv:http://10.1.2.3:8001"\n')
    assert_refused_in_one_line(
        [sys.executable, "-c", "from grpo.cli.orch import main; main()", "o.yaml", "--dry-run"],
        "OPENENV_API_KEY",
        "10.1.2.3 is not this machine and $OPENENV_API_KEY is unset",
        cwd=tmp_path,
        timeout=60,
    )


class _TricklingServer:
    """Answers every request with a 200 whose body trickles in a byte at a time: each read finishes
    well within any per-read timeout, the reply never does."""

    def __init__(self) -> None:
        import socket
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import contextlib

        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                )
                while not self.stop.wait(0.2):
                    conn.sendall(b" ")

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def test_a_server_trickling_its_schema_is_refused_at_the_request_deadline_in_one_line() -> None:
    import time

    trickler = _TricklingServer()
    try:
        started = time.monotonic()
        with pytest.raises(UserError, match=r"GET /schema did not complete within 1.5 s.*request_timeout_s"):
            check_environment(
                EnvConfig(id=f"openenv:http://127.0.0.1:{trickler.port}", request_timeout_s=1.5)
            )
        assert time.monotonic() - started < 10
    finally:
        trickler.close()
