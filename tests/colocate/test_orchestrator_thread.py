"""The co-located orchestrator's thread: how each way the run can end reaches the trainer (on the
main thread) and back."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from grpo.colocate import orchestrator_thread
from grpo.colocate.orchestrator_thread import OrchestratorThread


@pytest.fixture(autouse=True)
def fast_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(orchestrator_thread, "WATCHDOG_INTERVAL_S", 0.02)


class Peers:
    """failure_of_peers as a switch a test flips."""

    def __init__(self) -> None:
        self.failure: str | None = None

    def __call__(self) -> str | None:
        return self.failure


def _until_stopped(seen: list[str]) -> orchestrator_thread.Orchestrate:
    async def orchestrate(stop: asyncio.Event) -> None:
        seen.append("started")
        await stop.wait()
        seen.append("stopped")

    return orchestrate


def _wait(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_after_the_orchestrator_finishes_the_thread_waits_for_the_trainer_then_ends_cleanly() -> None:
    async def orchestrate(stop: asyncio.Event) -> None:
        await asyncio.sleep(0)

    stop_trainer = threading.Event()
    thread = OrchestratorThread(orchestrate, Peers(), stop_trainer)
    thread.start()
    time.sleep(0.2)
    assert thread.is_alive(), "ended before the trainer said it was done"
    thread.trainer_finished()
    thread.join(5)
    assert not thread.is_alive()
    assert thread.failure is None and thread.error is None
    assert not stop_trainer.is_set()


def test_a_peer_failure_stops_the_orchestrator_and_the_trainer_with_its_reason() -> None:
    seen: list[str] = []
    peers, stop_trainer = Peers(), threading.Event()
    thread = OrchestratorThread(_until_stopped(seen), peers, stop_trainer)
    thread.start()
    _wait(lambda: seen == ["started"])
    peers.failure = "the inference server stopped"
    thread.join(5)
    assert seen == ["started", "stopped"]
    assert thread.failure == "the inference server stopped" and thread.error is None
    assert stop_trainer.is_set()


def test_a_peer_failure_while_the_trainer_trains_the_last_batches_stops_the_trainer() -> None:
    async def orchestrate(stop: asyncio.Event) -> None:
        return None

    peers, stop_trainer = Peers(), threading.Event()
    thread = OrchestratorThread(orchestrate, peers, stop_trainer)
    thread.start()
    time.sleep(0.1)
    peers.failure = "replica 1 exited with code 1"
    thread.join(5)
    assert thread.failure == "replica 1 exited with code 1"
    assert stop_trainer.is_set()


def test_what_the_orchestrator_raises_is_kept_for_the_main_thread_and_stops_the_trainer() -> None:
    async def orchestrate(stop: asyncio.Event) -> None:
        raise ValueError("env 'x' has no examples")

    stop_trainer = threading.Event()
    thread = OrchestratorThread(orchestrate, Peers(), stop_trainer)
    thread.start()
    thread.join(5)
    assert isinstance(thread.error, ValueError)
    assert stop_trainer.is_set()


@pytest.mark.parametrize("when", ["before it starts", "while it runs"])
def test_stop_from_the_main_thread_ends_the_orchestrator(when: str) -> None:
    seen: list[str] = []
    stop_trainer = threading.Event()
    thread = OrchestratorThread(_until_stopped(seen), Peers(), stop_trainer)
    if when == "before it starts":
        thread.stop()
        thread.start()
    else:
        thread.start()
        _wait(lambda: seen == ["started"])
        thread.stop()
    thread.join(5)
    assert not thread.is_alive()
    assert seen[-1] == "stopped"
    assert thread.failure == "interrupted"
    assert stop_trainer.is_set()


def test_stop_and_trainer_finished_after_the_thread_ended_change_nothing() -> None:
    async def orchestrate(stop: asyncio.Event) -> None:
        return None

    thread = OrchestratorThread(orchestrate, Peers(), threading.Event())
    thread.start()
    thread.trainer_finished()
    thread.join(5)
    thread.stop()
    thread.trainer_finished()
    assert thread.failure is None and thread.error is None
