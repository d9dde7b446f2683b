"""The co-located orchestrator's thread: its event loop runs beside the trainer, which keeps the
process's main thread.

Why the trainer has the main thread: on CPU, torch runs each op on an OpenMP team (libgomp), and
libgomp gives every thread that starts parallel work a team of its own. The main thread has one
from loading the model, so a trainer on a second thread made two. Once a process's OpenMP workers
outnumber its CPUs, libgomp lets an idle worker spin only ~100 times before it sleeps (instead of
~300,000), so each of the step's thousands of small ops woke its worker through the kernel: a
standalone trainer step of 5.4 s took 7.7 s on a second thread (elementwise ops 2-5x slower, the
same batch; the process had 3 OpenMP workers on 2 CPUs). One team, the main thread's, avoids it.

The thread ends the run its own way in three cases: the orchestrator finished (it then keeps
watching the engine until the trainer says it is done), a peer failed (it sets the trainer's stop
event), or the orchestrator raised (kept for the main thread to re-raise).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from grpo.utils.logging import get_logger

log = get_logger("colocate")

WATCHDOG_INTERVAL_S = 1.0

Orchestrate = Callable[[asyncio.Event], Coroutine[Any, Any, None]]
"""Runs the orchestrator until it is done or the given stop event is set."""


class OrchestratorThread:
    """Runs `orchestrate` on its own event loop with a watchdog over `failure_of_peers`.

    `failure` says why the run stopped early (a peer failed, or `stop()` was called), `error` holds
    what the orchestrator raised; both None after a run to its end. Whenever the thread ends the
    run early it sets `stop_trainer`, so the trainer returns at its next batch.
    """

    def __init__(
        self,
        orchestrate: Orchestrate,
        failure_of_peers: Callable[[], str | None],
        stop_trainer: threading.Event,
    ) -> None:
        self._thread = threading.Thread(target=self._run, name="grpo-orchestrator", daemon=True)
        self._orchestrate = orchestrate
        self._failure_of_peers = failure_of_peers
        self._stop_trainer = stop_trainer
        self.failure: str | None = None
        self.error: BaseException | None = None
        # The loop is made here and run on the thread: what other threads schedule on it before the
        # thread starts runs once it does.
        self._runner = asyncio.Runner(loop_factory=asyncio.new_event_loop)
        self._runner.get_loop()
        self._stop = asyncio.Event()
        self._trainer_done = asyncio.Event()
        self._ended = False
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            with self._runner:
                self._runner.run(self._main())
        except BaseException as error:  # handed to the main thread, which re-raises it
            self.error = error
        if self.error is not None or self.failure is not None:
            self._stop_trainer.set()

    def stop(self, why: str = "interrupted") -> None:
        """End the run early (from any thread): the orchestrator stops at its next await."""
        self._call_in_loop(lambda: self._request_stop(why))

    def trainer_finished(self) -> None:
        """The trainer trained its last step (from any thread): the watchdog may end."""
        self._call_in_loop(self._trainer_done.set)

    def _request_stop(self, why: str) -> None:
        if not self._stop.is_set() and self.failure is None:
            self.failure = why
        self._stop.set()

    def _call_in_loop(self, action: Callable[[], None]) -> None:
        # Under the lock the loop cannot end between the check and the call (_main marks the end
        # under it before its loop closes).
        with self._lock:
            if not self._ended:
                self._runner.get_loop().call_soon_threadsafe(action)

    async def _main(self) -> None:
        watch = asyncio.create_task(self._watch())
        try:
            await self._orchestrate(self._stop)
            if not self._stop.is_set() and not self._trainer_done.is_set():
                log.info("orchestrator done; waiting for the trainer to finish its last step")
                # The trainer still trains the batches already sent: a dying engine must end it too.
                trainer_done = asyncio.create_task(self._trainer_done.wait())
                await asyncio.wait([watch, trainer_done], return_when=asyncio.FIRST_COMPLETED)
                trainer_done.cancel()
        finally:
            self._stop.set()
            watch.cancel()
            with self._lock:
                self._ended = True

    async def _watch(self) -> None:
        while not self._stop.is_set():
            if (failure := self._failure_of_peers()) is not None:
                self._request_stop(failure)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), WATCHDOG_INTERVAL_S)
