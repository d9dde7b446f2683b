"""Batch transport over ZeroMQ PUSH/PULL (lower latency than the filesystem, one host or LAN).

The trainer binds a PULL socket (it is the long-lived service, and a restarted orchestrator
reconnects to it); the orchestrator connects a PUSH socket. A connecting PUSH socket creates its
outgoing queue at `connect()` time, before any peer exists, so batches sent before the trainer
binds wait in that queue and are delivered once it does: no slow-joiner loss at step 0.

Each message has two frames: a JSON header (`{"kind": "batch", "step": n}` or
`{"kind": "end"}` when the orchestrator finishes) and the safetensors blob from
`grpo.transport.wire`. SNDHWM = RCVHWM = `hwm` bound the queued batches; past that the
sender blocks (back-pressure). Note that the kernel's socket buffers may hold a little more.
"""

from __future__ import annotations

import json
import time

import zmq

from grpo.transport.batch import TrainingBatch
from grpo.transport.errors import TransportClosed
from grpo.transport.wire import decode_batch, encode_batch
from grpo.utils.logging import get_logger

_WAIT_LOG_EVERY_S = 60.0

log = get_logger("transport")


def _ip(host: str) -> str:
    # "localhost" may resolve to ::1 on one side and 127.0.0.1 on the other; pin IPv4 loopback.
    return "127.0.0.1" if host == "localhost" else host


def _check_hint(host: str, port: int) -> str:
    return (
        f"check that grpo-train (transport_type: zmq, zmq_host: {host}, zmq_port: {port}) and grpo-orch "
        f"(rollout_transport: {{type: zmq, host: {host}, port: {port}}}) are both running"
    )


def _wait_for(socket: zmq.Socket, event: int, timeout: float | None, on_slow: str) -> bool:
    """Poll until `event` is ready; False on timeout. Logs `on_slow` every minute of waiting."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        slice_s = (
            _WAIT_LOG_EVERY_S if deadline is None else min(_WAIT_LOG_EVERY_S, deadline - time.monotonic())
        )
        if socket.poll(max(0, int(slice_s * 1000)), event):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        log.info(on_slow)


class ZmqBatchSender:
    """Orchestrator side: PUSH, connects to the trainer at host:port."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        hwm: int = 10,
        send_timeout: float | None = None,
        close_linger: float = 30.0,
    ) -> None:
        if hwm < 1:
            raise ValueError(f"rollout_transport.hwm must be >= 1, got {hwm}")
        self.host, self.port, self.send_timeout = host, port, send_timeout
        self.endpoint = f"tcp://{_ip(host)}:{port}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        # close() keeps delivering queued batches this long, then drops them.
        self._socket.setsockopt(zmq.LINGER, int(close_linger * 1000))
        self._socket.connect(self.endpoint)

    def send(self, batch: TrainingBatch) -> None:
        blob = encode_batch(batch)
        slow = f"batch {batch.step} waits: the trainer at {self.endpoint} is not receiving"
        if not _wait_for(self._socket, zmq.POLLOUT, self.send_timeout, slow):
            raise TimeoutError(
                f"batch {batch.step} not accepted within {self.send_timeout}s: the queue to {self.endpoint} "
                f"is full; {_check_hint(self.host, self.port)}"
            )
        header = json.dumps({"kind": "batch", "step": batch.step}).encode()
        self._socket.send_multipart([header, blob], copy=False)

    def close(self) -> None:
        """Tell the trainer no more batches come, deliver what is queued (up to close_linger s)."""
        if self._socket.closed:
            return
        if self._socket.poll(0, zmq.POLLOUT):
            self._socket.send_multipart([json.dumps({"kind": "end"}).encode(), b""])
        self._socket.close()
        self._context.term()


class ZmqBatchReceiver:
    """Trainer side: PULL, bound on host:port (port 0 picks a free port, see `.port`)."""

    def __init__(self, host: str, port: int, *, hwm: int = 10) -> None:
        self.host = host
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(f"tcp://{_ip(host)}:{port if port else '*'}")
        except zmq.ZMQError as err:
            self.close()
            raise ValueError(
                f"cannot bind the batch socket on {host}:{port} ({err}): choose a free zmq_port, or stop "
                "the process using it"
            ) from err
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.endpoint.rsplit(":", 1)[1])

    def receive(self, step: int, timeout: float | None = None) -> TrainingBatch:
        slow = f"waiting for batch {step} on {self.endpoint}"
        if not _wait_for(self._socket, zmq.POLLIN, timeout, slow):
            raise TimeoutError(
                f"batch {step} did not arrive within {timeout}s on {self.endpoint}: "
                f"{_check_hint(self.host, self.port)}"
            )
        frames = self._socket.recv_multipart()
        header = _parse_header(frames)
        if header.get("kind") == "end":
            raise TransportClosed(f"no batch {step}: the orchestrator finished sending")
        sent_step = header["step"]
        batch = decode_batch(frames[1])
        if batch.step != sent_step:
            raise ValueError(f"zmq message for step {sent_step} carries batch {batch.step}: corrupt message")
        if batch.step != step:
            raise ValueError(
                f"received batch {batch.step} while expecting batch {step}: orchestrator and trainer disagree "
                "on the step; resume both from the same checkpoint step"
            )
        return batch

    def close(self) -> None:
        if not self._socket.closed:
            self._socket.close()
        self._context.term()


def _parse_header(frames: list[bytes]) -> dict:
    try:
        header = json.loads(frames[0]) if len(frames) == 2 else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("kind") not in ("batch", "end"):
        raise ValueError(f"corrupt zmq batch message (unknown step): {len(frames)} frames, bad header")
    if header["kind"] == "batch" and not isinstance(header.get("step"), int):
        raise ValueError("corrupt zmq batch message (unknown step): header has no integer step")
    return header
