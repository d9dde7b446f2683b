"""A process without the secret that reaches the trainer's rendezvous store (another process, as a
stranger on the network would be) can neither end the trainer's publish nor take a server's rank."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
from free_ports import free_port

from grpo.transport.weights.collective import (
    DEFAULT_SECRET_ENV,
    CollectiveWeightReceiver,
    CollectiveWeightSender,
)

SECRET_ENV = "GRPO_TEST_WEIGHTS_SECRET"
ROGUE_SECRET_ENV = "GRPO_TEST_ROGUE_SECRET"


@pytest.fixture(autouse=True)
def _secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEFAULT_SECRET_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, "the-shared-secret-" + "s" * 32)
    monkeypatch.setenv(ROGUE_SECRET_ENV, "a-guessed-secret-" + "r" * 32)


def _weights() -> list[tuple[str, torch.Tensor]]:
    return [("model.norm.weight", torch.arange(8, dtype=torch.float32))]


def _publish_in_thread(port: int, timeout: float) -> tuple[threading.Thread, dict[str, Any]]:
    """The trainer publishing once; its outcome ("error" or "done") lands in the dict."""
    sender = CollectiveWeightSender(
        "localhost", port, timeout=timeout, num_servers=1, backend="gloo", secret_env=SECRET_ENV
    )
    outcome: dict[str, Any] = {}

    def publish() -> None:
        try:
            sender.send(1, _weights())
            outcome["done"] = True
        except BaseException as error:  # handed to the test, which asserts on it
            outcome["error"] = error
        finally:
            sender.close()

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    return thread, outcome


def _wait_for_store(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "the trainer's store did not come up"
            time.sleep(0.05)


def _run_stranger(script: str, port: int) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(port)], timeout=120)
    assert done.returncode == 0


def _real_server_receives(port: int) -> list[tuple[str, torch.Tensor]]:
    receiver = CollectiveWeightReceiver(
        "localhost", port, timeout=30, backend="gloo", rank=1, world_size=2, secret_env=SECRET_ENV
    )
    try:
        step, named = receiver.receive(expected=None)
    finally:
        receiver.close()
    assert step == 1
    return named


def _assert_published(thread: threading.Thread, outcome: dict[str, Any], named: list[Any]) -> None:
    thread.join(timeout=60)
    assert "error" not in outcome, outcome.get("error")
    assert outcome.get("done")
    assert [name for name, _ in named] == ["model.norm.weight"]
    assert torch.equal(named[0][1], _weights()[0][1])


_STORE_WRITER = """
    import json, sys
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.PrefixStore("grpo/weights", dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timedelta(seconds=30)))
    store.add("rank1_claims", 1)  # the rank is mine
    hello = {"world_size": 3, "nonce": "00", "proof": "00" * 32, "dtype": "", "device": ""}
    store.set("rank1_hello", json.dumps(hello))  # a group of 3, proven by nothing
"""


def test_a_strangers_hello_and_rank_claim_neither_end_the_publish_nor_take_the_rank() -> None:
    port = free_port()
    thread, outcome = _publish_in_thread(port, timeout=30)
    _wait_for_store(port)
    _run_stranger(_STORE_WRITER, port)
    named = _real_server_receives(port)
    _assert_published(thread, outcome, named)


_ROGUE_RECEIVER = f"""
    import sys
    from grpo.transport.weights.collective import CollectiveWeightReceiver
    receiver = CollectiveWeightReceiver(
        "localhost", int(sys.argv[1]), timeout=3, backend="gloo", secret_env={ROGUE_SECRET_ENV!r}
    )
    try:
        receiver.receive(expected=None)
    except (TimeoutError, ValueError) as err:
        print("rogue refused:", err)
    else:
        raise SystemExit("the rogue received weights")
"""


def test_a_server_with_another_secret_neither_ends_the_publish_nor_takes_the_rank() -> None:
    port = free_port()
    thread, outcome = _publish_in_thread(port, timeout=30)
    _wait_for_store(port)
    _run_stranger(_ROGUE_RECEIVER, port)  # joins first, as rank 1
    named = _real_server_receives(port)
    _assert_published(thread, outcome, named)
