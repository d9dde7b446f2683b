"""grpo-env's limits: sessions bounded in all and per token, client examples bounded in size,
request bodies read in one bounded read."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from remote_env_fixtures import load_echo_env
from starlette.testclient import TestClient

from grpo.envs.server import RequestGuard, build_app

TOKEN = "the-env-servers-token-0123"
EXAMPLE = {"prompt": "say 0", "answer": "0"}


def _client(app: Any, host: str, token: str | None = TOKEN) -> TestClient:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return TestClient(app, client=(host, 50000), headers=headers)


def test_one_token_from_many_addresses_is_bounded_as_one_client() -> None:
    # Addresses are no identity (NAT, proxies, a host with a whole IPv6 range): with a token, the
    # token is the client, so a flood spread over addresses is bounded like one from a single one.
    app = build_app(load_echo_env(), "echo-id", token=TOKEN, max_sessions=100, max_sessions_per_client=4)
    for i in range(30):
        assert _client(app, f"10.0.0.{i}").post("/reset", json={"example": EXAMPLE}).status_code == 200
    assert len(app.state.sessions) == 4


def test_without_a_token_the_source_address_is_the_client() -> None:
    app = build_app(load_echo_env(), "echo-id", max_sessions=100, max_sessions_per_client=4)
    for i in range(3):
        for _ in range(6):
            assert (
                _client(app, f"127.0.0.{i + 1}", None).post("/reset", json={"example": EXAMPLE}).status_code
                == 200
            )
    assert len(app.state.sessions) == 12


def test_sessions_are_bounded_in_all() -> None:
    app = build_app(load_echo_env(), "echo-id", max_sessions=5, max_sessions_per_client=4)
    for i in range(20):
        _client(app, f"127.0.0.{i + 1}", None).post("/reset", json={"example": EXAMPLE})
    assert len(app.state.sessions) == 5


def test_a_client_example_above_the_size_limit_is_refused_and_not_stored() -> None:
    app = build_app(load_echo_env(), "echo-id", token=TOKEN, max_example_bytes=1000)
    client = _client(app, "10.0.0.1")
    big = {"prompt": "x" * 2000, "answer": "0"}
    reset = client.post("/reset", json={"example": big})
    assert reset.status_code == 413 and "example" in reset.text and "--max-example-kb" in reset.text
    assert len(app.state.sessions) == 0
    session = client.post("/reset", json={"example": EXAMPLE}).json()["session_id"]
    completion = [{"role": "assistant", "content": "0"}]
    score = client.post("/score", json={"session_id": session, "example": big, "completion": completion})
    assert score.status_code == 413
    assert (
        client.post(
            "/score", json={"session_id": session, "example": EXAMPLE, "completion": completion}
        ).json()["reward"]
        > 0
    )


def test_a_body_arriving_in_many_small_pieces_is_read_in_linear_time() -> None:
    # 20,000 pieces of 256 bytes (5 MB): appending each to a bytes object copies ~50 GB.
    num_pieces, piece = 20_000, b"x" * 256
    received: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        received.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = RequestGuard(app, token=None, max_body_bytes=16 * 1024 * 1024)
    pieces = iter(range(num_pieces))

    async def receive() -> dict[str, Any]:
        i = next(pieces)
        return {"type": "http.request", "body": piece, "more_body": i < num_pieces - 1}

    async def send(_message: dict[str, Any]) -> None:
        return None

    scope = {"type": "http", "method": "POST", "path": "/reset", "headers": []}
    start = time.monotonic()
    asyncio.run(guard(scope, receive, send))
    assert time.monotonic() - start < 2.0
    assert received == [piece * num_pieces]


def test_a_declared_length_above_the_limit_is_refused_before_reading() -> None:
    reads: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the app must not run")

    async def receive() -> dict[str, Any]:
        reads.append(1)
        return {"type": "http.request", "body": b"", "more_body": False}

    statuses: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    guard = RequestGuard(app, token=None, max_body_bytes=100)
    scope = {"type": "http", "method": "POST", "path": "/reset", "headers": [(b"content-length", b"101")]}
    asyncio.run(guard(scope, receive, send))
    assert statuses == [413] and reads == []


@pytest.mark.parametrize("flag", ["--max-example-kb"])
def test_grpo_env_has_the_example_limit_flag(flag: str) -> None:
    from typer.testing import CliRunner

    from grpo.cli.env import app

    assert flag in CliRunner().invoke(app, ["--help"], terminal_width=200).output


def test_an_environment_with_image_prompts_is_refused_naming_in_process_loading() -> None:
    from grpo.envs.count_shapes import load_environment
    from grpo.utils.errors import UserError

    with pytest.raises(UserError, match=r"image parts.*env\[\]\.id without an address"):
        build_app(load_environment(num_examples=2, image_size=28), "count-shapes")
