"""RemoteEnv against servers that trickle or flood their replies: one deadline per request and a
bounded reply size, each failing only the rollout it hit."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from grpo.config.orchestrator import EnvConfig
from grpo.envs.remote import RemoteEnv

EXAMPLE = {"question": "q"}
INFO = {"max_turns": 1, "examples": [EXAMPLE], "prompts": [[{"role": "user", "content": "q"}]]}
RESET_REPLY = json.dumps({"session_id": "s"}).encode()


def _read_request(conn: socket.socket) -> None:
    """Read the whole request (headers, then the body its Content-Length gives): closing with
    unread bytes would reset the connection under the client."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [
        line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    ]
    missing = int(lengths[0]) - len(body) if lengths else 0
    while missing > 0:
        missing -= len(conn.recv(missing))


def _serve(reply: bytes, chunk_bytes: int, pause_s: float, declare_length: bool) -> Iterator[str]:
    """A raw HTTP server answering every request with `reply`, `chunk_bytes` at a time with
    `pause_s` between chunks (chunked transfer encoding unless `declare_length`)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn:
            _read_request(conn)
            length = f"Content-Length: {len(reply)}" if declare_length else "Transfer-Encoding: chunked"
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}\r\n\r\n".encode())
            try:
                for start in range(0, len(reply), chunk_bytes):
                    if stop.is_set():
                        return
                    piece = reply[start : start + chunk_bytes]
                    conn.sendall(piece if declare_length else b"%x\r\n%s\r\n" % (len(piece), piece))
                    time.sleep(pause_s)
                if not declare_length:
                    conn.sendall(b"0\r\n\r\n")
            except OSError:  # the client gave up
                return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


def _reset(address: str, **limits: Any) -> tuple[dict[str, Any], float]:
    remote = RemoteEnv(address, "env", INFO, token=None, **limits)

    async def reset() -> dict[str, Any]:
        try:
            return await remote.reset(EXAMPLE)
        finally:
            await remote.aclose()

    start = time.monotonic()
    state = asyncio.run(reset())
    return state, time.monotonic() - start


@pytest.fixture
def trickling_address() -> Iterator[str]:
    """A valid /reset reply, one byte every 0.15 s (about 3 s in all): no read ever waits 1 s."""
    yield from _serve(RESET_REPLY, 1, 0.15, declare_length=True)


def test_a_server_trickling_its_reply_is_cut_at_the_requests_deadline(trickling_address: str) -> None:
    state, elapsed = _reset(trickling_address, timeout_s=1.0)
    assert state["session_id"] is None
    assert "no reply within 1 s" in state["failure"] and "/reset" in state["failure"]
    assert elapsed < 2.0


def test_the_same_slow_reply_within_the_deadline_is_accepted(trickling_address: str) -> None:
    state, _elapsed = _reset(trickling_address, timeout_s=30.0)
    assert state == {"session_id": "s"}


PADDED_REPLY = json.dumps({"session_id": "s", "padding": "x" * (3 * 1024 * 1024)}).encode()


@pytest.mark.parametrize("declare_length", [True, False])
def test_a_reply_above_the_size_limit_fails_the_rollout(declare_length: bool) -> None:
    for address in _serve(PADDED_REPLY, 256 * 1024, 0.0, declare_length):
        state, _elapsed = _reset(address, max_reply_bytes=1024 * 1024)
        assert state["session_id"] is None
        assert "reply above 1 MiB" in state["failure"] and "max_reply_mib" in state["failure"]


def test_a_reply_below_the_size_limit_is_accepted() -> None:
    for address in _serve(PADDED_REPLY, 256 * 1024, 0.0, declare_length=False):
        state, _elapsed = _reset(address, max_reply_bytes=4 * 1024 * 1024)
        assert state == {"session_id": "s"}


def test_the_limits_are_env_config_fields() -> None:
    cfg = EnvConfig(id="e", address="127.0.0.1:8100", request_timeout_s=5, max_reply_mib=2)
    assert (cfg.request_timeout_s, cfg.max_reply_mib) == (5, 2)
    assert EnvConfig(id="e").request_timeout_s > 0 and EnvConfig(id="e").max_reply_mib > 0
