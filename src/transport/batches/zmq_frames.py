"""Framing of the zmq batch protocol (grpo.transport.batches.zmq_transport): signed frames, message parsing,
the polling wait and the log of dropped messages, shared by the sender and the receiver."""

from __future__ import annotations

import json
import time
from typing import Any

import zmq

from grpo.utils.auth import TAG_BYTES, sign, verify
from grpo.utils.logging import get_logger

WAIT_LOG_EVERY_S = 60.0
_DROP_LOG_EVERY = 100

log = get_logger("transport")


def zmq_ip(host: str) -> str:
    # "localhost" may resolve to ::1 on one side and 127.0.0.1 on the other; pin IPv4 loopback.
    return "127.0.0.1" if host == "localhost" else host


def check_hint(host: str, port: int) -> str:
    return (
        f"check that grpo-train (transport_type: zmq, zmq_host: {host}, zmq_port: {port}) and grpo-orch "
        f"(rollout_transport: {{type: zmq, host: {host}, port: {port}}}) are both running"
    )


def mac_input(frames: list[bytes]) -> bytes:
    # Length-prefixed, so that moving bytes between frames changes the tag.
    return b"".join(len(f).to_bytes(8, "little") + bytes(f) for f in frames)


def seal(secret: bytes | None, frames: list[bytes]) -> list[bytes]:
    """`frames` plus their tag frame (unchanged without a secret)."""
    return frames if secret is None else [*frames, sign(secret, mac_input(frames))]


def unseal(secret: bytes | None, frames: list[bytes]) -> list[bytes] | None:
    """The frames without their tag, or None when the tag is missing or wrong."""
    if secret is None:
        return frames
    if len(frames) < 2 or len(frames[-1]) != TAG_BYTES:
        return None
    body = frames[:-1]
    return body if verify(secret, mac_input(body), frames[-1]) else None


class DropLog:
    """Counts unauthenticated messages; logs the first and then every _DROP_LOG_EVERY-th."""

    def __init__(self, side: str, hint: str) -> None:
        self.side, self.hint, self.count = side, hint, 0

    def __call__(self) -> None:
        self.count += 1
        if self.count == 1 or self.count % _DROP_LOG_EVERY == 0:
            log.warning(
                "%s dropped %d zmq message(s) without a valid signature; %s", self.side, self.count, self.hint
            )


def wait_for(socket: zmq.Socket, event: int, timeout: float | None, on_slow: str) -> bool:
    """Poll until `event` is ready; False on timeout. Logs `on_slow` every minute of waiting."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        slice_s = WAIT_LOG_EVERY_S if deadline is None else min(WAIT_LOG_EVERY_S, deadline - time.monotonic())
        if socket.poll(max(0, int(slice_s * 1000)), event):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        log.info(on_slow)


def _json_header(frames: list[bytes]) -> dict[str, Any] | None:
    """The header of a [header, payload] message, with its session fields (grpo.transport.batches.zmq_session)
    well typed; None when it is not one."""
    try:
        header = json.loads(frames[0]) if len(frames) == 2 else None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    if (
        not isinstance(header, dict)
        or not isinstance(header.get("from"), str)
        or not isinstance(header.get("to"), (str, type(None)))
        or not isinstance(header.get("seq"), int)
    ):
        return None
    return header


def parse_want(frames: list[bytes]) -> dict[str, Any]:
    want = _json_header(frames)
    if (
        want is None
        or want.get("kind") != "want"
        or not isinstance(want.get("step"), int)
        or not isinstance(want.get("committed"), int)
    ):
        raise ValueError(f"corrupt message from the trainer: {frames[0][:200]!r}")
    return want


def parse_header(frames: list[bytes]) -> dict[str, Any]:
    header = _json_header(frames)
    if header is None or header.get("kind") not in ("hello", "batch", "end", "missing"):
        raise ValueError(f"corrupt zmq batch message (unknown step): {len(frames)} frames, bad header")
    if header["kind"] in ("batch", "missing") and not isinstance(header.get("step"), int):
        raise ValueError("corrupt zmq batch message (unknown step): header has no integer step")
    if header["kind"] == "missing" and not isinstance(header.get("committed"), int):
        raise ValueError("corrupt zmq missing-batch message: header has no integer committed step")
    if header["kind"] == "end" and not isinstance(header.get("next"), int):
        raise ValueError("corrupt zmq end message: header has no integer next step")
    return header
