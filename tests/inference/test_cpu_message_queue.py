"""The CPU engine's shared-memory queue readers block on the writer's notification instead of
spinning for a second after each message, and grpo's vLLM plugin applies that only to its own
engines."""

from __future__ import annotations

import threading
import time
from importlib.metadata import entry_points

import pytest

from grpo.inference.vllm_compat.cpu_message_queue import block_cpu_queue_readers
from grpo.inference.vllm_compat.cpu_weights import KEEP_DENSE_WEIGHTS_ENV
from grpo.inference.vllm_compat.plugin import apply_engine_patches

pytest.importorskip("vllm")


@pytest.fixture
def spin_condition(monkeypatch: pytest.MonkeyPatch) -> type:
    """vLLM's SpinCondition with vLLM's own `wait`, whatever ran before in this process (a grpo
    server started here has run the plugin), and the `wait` found restored after the test."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    vllm_wait = getattr(SpinCondition.wait, "_grpo_original", SpinCondition.wait)
    monkeypatch.setattr(SpinCondition, "wait", vllm_wait)
    return SpinCondition


def _reader_and_writer(spin_condition: type) -> tuple[object, object]:
    import zmq
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    context = zmq.Context.instance()
    address = get_open_zmq_ipc_path()
    writer = spin_condition(is_reader=False, context=context, notify_address=address)
    reader = spin_condition(is_reader=True, context=context, notify_address=address)
    return reader, writer


def _seconds_waited(reader: object, timeout_ms: int) -> float:
    start = time.monotonic()
    reader.wait(timeout_ms=timeout_ms)  # type: ignore[attr-defined]
    return time.monotonic() - start


def test_a_reader_blocks_until_the_writer_notifies_instead_of_spinning(spin_condition: type) -> None:
    reader, writer = _reader_and_writer(spin_condition)
    # vLLM's own reader, just after a read, returns at once to check the queue again (its spin)
    assert _seconds_waited(reader, timeout_ms=300) < 0.1

    block_cpu_queue_readers()
    block_cpu_queue_readers()  # idempotent

    assert _seconds_waited(reader, timeout_ms=300) >= 0.25  # nothing written: it slept on the socket
    threading.Timer(0.1, writer.notify).start()  # type: ignore[attr-defined]
    assert _seconds_waited(reader, timeout_ms=5_000) < 2.0  # woken by the writer, not the timeout


def test_the_plugin_is_registered_and_changes_only_a_grpo_engine(
    spin_condition: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = {entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert "grpo.inference.vllm_compat.plugin:apply_engine_patches" in values
    original = spin_condition.wait

    monkeypatch.delenv(KEEP_DENSE_WEIGHTS_ENV, raising=False)
    apply_engine_patches()
    assert spin_condition.wait is original

    monkeypatch.setenv(KEEP_DENSE_WEIGHTS_ENV, "1")
    apply_engine_patches()
    assert spin_condition.wait is not original
