"""A process without the secret that reaches the trainer's rendezvous store (another process, as a
stranger on the network would be) can neither end the trainer's publish nor take a server's rank,
not even with the entries it saw in an earlier rendezvous, and a server loads no bytes but the ones
the trainer signed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
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


def _run_stranger(script: str, port: int, *args: str) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(port), *args], timeout=120)
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


_RECORD_ENTRIES = """
    import json, sys
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timedelta(seconds=30))
    entries = {key: store.get(key).hex() for key in store.list_keys()}
    with open(sys.argv[2], "w") as out:
        json.dump(entries, out)
"""

_REPLAY_ENTRIES = """
    import json, sys
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timedelta(seconds=30))
    with open(sys.argv[2]) as entries:
        for key, value in json.load(entries).items():
            store.set(key, bytes.fromhex(value))
"""


def _is_challenge(value: bytes) -> bool:
    try:
        return set(json.loads(value)) == {"nonce", "world_size"}
    except (ValueError, TypeError):
        return False


def test_entries_seen_in_one_rendezvous_neither_take_a_rank_nor_end_the_publish_in_the_next(
    tmp_path: Path,
) -> None:
    port, entries = free_port(), tmp_path / "entries.json"
    first_receive = threading.Thread(target=_real_server_receives, args=(port,), daemon=True)
    first_receive.start()
    sender = CollectiveWeightSender(
        "localhost", port, timeout=30, num_servers=1, backend="gloo", secret_env=SECRET_ENV
    )
    try:
        sender.send(1, _weights())
        _run_stranger(_RECORD_ENTRIES, port, str(entries))  # every entry of a whole rendezvous
    finally:
        sender.close()
    first_receive.join(timeout=30)
    seen = json.loads(entries.read_text())
    assert any(key.startswith("grpo/weights/k/") for key in seen)
    # The sender's challenge is the one entry a receiver must find by a fixed name; overwriting it
    # denies service (the store port is isolated for that). Every other name is this session's own.
    replayed = {key: value for key, value in seen.items() if not _is_challenge(bytes.fromhex(value))}
    entries.write_text(json.dumps(replayed))

    thread, outcome = _publish_in_thread(port, timeout=30)
    _wait_for_store(port)
    _run_stranger(_REPLAY_ENTRIES, port, str(entries))  # before the real server knocks
    named = _real_server_receives(port)
    _assert_published(thread, outcome, named)


class _SenderWhoseBytesAreRewritten(CollectiveWeightSender):
    """The trainer, with every bucket after the first rewritten between its manifest and the
    receivers, as a peer the receivers were pointed at would send."""

    num_broadcasts = 0

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self.num_broadcasts > 0:
            tensor = tensor.clone()
            tensor[0] ^= 0xFF
        self.num_broadcasts += 1
        super()._broadcast(tensor)


def test_bytes_other_than_the_ones_the_trainer_signed_are_refused_naming_the_bucket() -> None:
    port = free_port()
    weights = [(f"model.layers.{i}.weight", torch.full((64,), float(i))) for i in range(3)]
    sender = _SenderWhoseBytesAreRewritten(
        "localhost", port, timeout=10, num_servers=1, backend="gloo", secret_env=SECRET_ENV, bucket_bytes=256
    )
    publish = threading.Thread(target=lambda: _send_and_close(sender, weights), daemon=True)
    publish.start()
    receiver = CollectiveWeightReceiver(
        "localhost", port, timeout=10, backend="gloo", rank=1, world_size=2, secret_env=SECRET_ENV
    )
    taken: list[str] = []
    try:
        _step, buckets = receiver.receive_buckets(expected=None)
        with pytest.raises(ValueError) as refusal:
            for bucket in buckets:
                taken += [name for name, _ in bucket]
    finally:
        receiver.close()
    publish.join(timeout=60)
    assert taken == ["model.layers.0.weight"], "a rewritten bucket was handed on"
    (line,) = str(refusal.value).splitlines()
    assert "bucket 1 of update 0 (model.layers.1.weight)" in line
    assert "does not match the digest the trainer signed" in line


def _send_and_close(sender: CollectiveWeightSender, weights: list[tuple[str, torch.Tensor]]) -> None:
    try:
        sender.send(1, weights)
    except (RuntimeError, TimeoutError):  # the receiver left the broadcast; its side is asserted
        pass
    finally:
        sender.close()
