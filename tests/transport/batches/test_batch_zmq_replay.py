"""Replayed zmq messages: a message signed with the run's secret is taken once, by the peer
session it was addressed to, and never again (not in a later run with the same secret, not after
a newer session of its sender took over)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.auth.thread import ThreadAuthenticator

from grpo.transport.batches.errors import TransportClosed
from grpo.transport.batches.synthetic import synthetic_batch
from grpo.transport.batches.zmq_curve import dial_curve, serve_curve
from grpo.transport.batches.zmq_transport import ZmqBatchReceiver, ZmqBatchSender

SECRET = b"the run's secret"


class _Recording:
    """A socket that records every message it receives and sends (what a wiretap would capture)."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self.received: list[list[bytes]] = []
        self.sent: list[list[bytes]] = []

    def recv_multipart(self, *args: Any, **kwargs: Any) -> list[bytes]:
        frames = self.socket.recv_multipart(*args, **kwargs)
        self.received.append([bytes(f) for f in frames[1:]])  # without the sender's routing id
        return frames

    def send_multipart(self, frames: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.sent.append([bytes(f) for f in frames[1:]])  # without the receiver's routing id
        return self.socket.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.socket, name)


def _tapped_receiver(**kwargs: Any) -> tuple[ZmqBatchReceiver, _Recording]:
    receiver = ZmqBatchReceiver("localhost", 0, secret=SECRET, **kwargs)
    tap = _Recording(receiver._socket)
    receiver._socket = tap  # type: ignore[assignment]
    return receiver, tap


def _peer_socket(context: zmq.Context, kind: int) -> zmq.Socket:
    """A socket of someone who captured the run's messages. CURVE keeps a peer without the secret
    from connecting at all (test_batch_zmq_flood.py); this one completes the handshake, so that
    what is tested is the message layer behind it."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 2000)
    if kind == zmq.ROUTER:
        _authenticators.append(serve_curve(context, socket, SECRET))
    else:
        dial_curve(socket, SECRET)
    return socket


_authenticators: list[ThreadAuthenticator] = []


def _close(context: zmq.Context, socket: zmq.Socket) -> None:
    socket.close()
    while _authenticators:
        _authenticators.pop().stop()
    context.term()


def _replay(port: int, messages: list[list[bytes]]) -> None:
    context = zmq.Context()
    dealer = _peer_socket(context, zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    for frames in messages:
        dealer.send_multipart(frames)
    _close(context, dealer)


def _run_captured(num_batches: int, metadata: dict[str, Any]) -> list[list[bytes]]:
    """A whole run (sender, trainer, the sender's end); every message the trainer received, as captured."""
    receiver, tap = _tapped_receiver()
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=10, secret=SECRET)
    try:
        for step in range(num_batches):
            sender.send(synthetic_batch(step, metadata=metadata))
            assert receiver.receive(step, timeout=10).step == step
        sender.close()
        with pytest.raises(TransportClosed):
            receiver.receive(num_batches, timeout=10)
    finally:
        sender.close()
        receiver.close()
    return tap.received


def _is_end(frames: list[bytes]) -> bool:
    return b'"end"' in frames[0]


def _is_batch(frames: list[bytes]) -> bool:
    return b'"batch"' in frames[0]


def test_a_captured_end_does_not_stop_a_later_run_with_the_same_secret() -> None:
    captured = _run_captured(1, {})
    end = [frames for frames in captured if _is_end(frames)]
    assert end, "the first run's end was not captured"

    receiver = ZmqBatchReceiver("localhost", 0, secret=SECRET)
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=5, secret=SECRET)
    try:
        sender.send(synthetic_batch(0))
        assert receiver.receive(0, timeout=10).step == 0
        _replay(receiver.port, end)  # "no batch from step 1 on"
        # Batch 1 comes a second later, so the trainer reads the replayed end first.
        later = threading.Timer(1.0, lambda: sender.send(synthetic_batch(1, metadata={"run": "second"})))
        later.start()
        assert receiver.receive(1, timeout=10).metadata == {"run": "second"}
        later.join()
    finally:
        sender.close()
        receiver.close()


def test_a_captured_batch_is_not_taken_by_a_later_run_with_the_same_secret() -> None:
    captured = _run_captured(1, {"run": "first"})
    old_batches = [frames for frames in captured if _is_batch(frames)]
    assert old_batches, "the first run's batch was not captured"

    receiver = ZmqBatchReceiver("localhost", 0, secret=SECRET)
    try:
        _replay(receiver.port, old_batches)
        time.sleep(0.5)  # the replayed copy is queued at the trainer before the real one
        sender = ZmqBatchSender("localhost", receiver.port, close_linger=5, secret=SECRET)
        try:
            sender.send(synthetic_batch(0, metadata={"run": "second"}))
            assert receiver.receive(0, timeout=10).metadata == {"run": "second"}
        finally:
            sender.close()
    finally:
        receiver.close()


def test_a_want_replayed_within_the_run_does_not_send_the_orchestrator_back(tmp_path: Path) -> None:
    receiver, tap = _tapped_receiver()
    port = receiver.port
    sender = ZmqBatchSender("localhost", port, hwm=8, close_linger=0.1, spool_dir=tmp_path, secret=SECRET)
    context = zmq.Context()
    impostor = _peer_socket(context, zmq.ROUTER)
    try:
        for step in range(4):
            sender.send(synthetic_batch(step))
            receiver.receive(step, timeout=10)
        receiver.close()  # the trainer goes; someone else takes its port
        old_wants = [frames for frames in tap.sent if b'"step": 1,' in frames[0]]
        assert old_wants, "the trainer's want of batch 1 was not captured"
        impostor.bind(f"tcp://127.0.0.1:{port}")
        assert impostor.poll(10_000), "the sender did not reconnect"
        peer = impostor.recv_multipart()[0]  # its hello
        for frames in old_wants:
            impostor.send_multipart([peer, *frames])  # "I need batch 1 again"
        got: list[bytes] = []
        while impostor.poll(1000):
            got.append(impostor.recv_multipart()[1])
        assert not [header for header in got if b'"batch"' in header], got
    finally:
        sender.close()
        _close(context, impostor)


def test_a_captured_commit_does_not_make_a_later_run_drop_its_spool(tmp_path: Path) -> None:
    receiver, tap = _tapped_receiver()
    sender = ZmqBatchSender("localhost", receiver.port, close_linger=5, secret=SECRET)
    try:
        for step in range(3):
            sender.send(synthetic_batch(step))
            receiver.receive(step, timeout=10)
        receiver.commit(3)
    finally:
        sender.close()
        receiver.close()
    commits = [frames for frames in tap.sent if b'"committed": 3' in frames[0]]
    assert commits, "the first run's commit was not captured"

    # A later run: its trainer is not up yet, and whoever holds its port replays the old commit.
    spool = tmp_path / "spool"
    context = zmq.Context()
    impostor = _peer_socket(context, zmq.ROUTER)
    port = impostor.bind_to_random_port("tcp://127.0.0.1")
    later = ZmqBatchSender("localhost", port, hwm=8, close_linger=0.1, spool_dir=spool, secret=SECRET)
    try:
        for step in range(3):
            later.send(synthetic_batch(step))
        assert impostor.poll(10_000), "the later run's sender did not connect"
        peer = impostor.recv_multipart()[0]
        for frames in commits:
            impostor.send_multipart([peer, *frames])
        time.sleep(1.0)
        assert sorted(p.name for p in spool.iterdir()) == [f"step_{n}.safetensors" for n in range(3)]
    finally:
        later.close()
        _close(context, impostor)
