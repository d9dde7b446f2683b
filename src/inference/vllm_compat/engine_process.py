"""The lifetime of the engine core and worker processes a vLLM server starts: they end with the
server (even a SIGKILLed one), and get the time to close their shared-memory queues."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

ENGINE_TEARDOWN_GRACE_S = 15.0
"""How long a stopping server waits for its engine core to exit before vLLM kills it: the engine
core gives its workers 5 s (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS) and 4 s more after a SIGTERM."""

_teardown_patch_applied = False


def give_the_engine_time_to_tear_down() -> None:
    """Give the engine core ENGINE_TEARDOWN_GRACE_S to exit after its SIGTERM, requests still aborted.

    With vLLM's default shutdown_timeout 0 ("abort"), the server's engine process manager SIGKILLs
    the engine core right after its SIGTERM, so neither the engine core nor its workers close their
    shared-memory message queues: their /dev/shm segments and a semaphore stay registered with
    multiprocessing's resource tracker, which removes them when the server's process exits and
    warns "leaked shared_memory objects". The engine core still aborts its requests at once (it
    reads shutdown_timeout from its own config): this waits only for the teardown, which ends the
    process (_run_then_exit). A timeout other than 0 is kept as it is.
    """
    global _teardown_patch_applied
    if _teardown_patch_applied:
        return
    from vllm.v1.engine.utils import CoreEngineProcManager

    original = CoreEngineProcManager.shutdown

    def shutdown(self: Any, timeout: float | None = None) -> None:
        original(self, ENGINE_TEARDOWN_GRACE_S if timeout == 0 else timeout)

    CoreEngineProcManager.shutdown = shutdown
    _teardown_patch_applied = True


_original_run_engine_core: Any = None
ENGINE_PARENT_PID_ENV = "GRPO_ENGINE_PARENT_PID"


def end_engine_with_its_parent() -> None:
    """Make each engine core process this process starts end (SIGTERM) when this process does.

    vLLM's engine core outlives an API-server process that is SIGKILLed (the OOM killer, `kill -9`),
    holding its memory (seen here: the engine of a killed `grpo` ran on). Linux delivers a parent-death
    signal even then. The engine's workers end with the engine (vLLM watches that itself).
    """
    global _original_run_engine_core
    if _original_run_engine_core is not None or not sys.platform.startswith("linux"):
        return
    from vllm.v1.engine.core import EngineCoreProc

    _original_run_engine_core = EngineCoreProc.run_engine_core
    EngineCoreProc.run_engine_core = staticmethod(_run_engine_core_bound_to_parent)
    os.environ[ENGINE_PARENT_PID_ENV] = str(os.getpid())


def _run_engine_core_bound_to_parent(*args: Any, **kwargs: Any) -> Any:
    """The engine core's process target (module-level, so spawn can pickle it by name)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(os.environ[ENGINE_PARENT_PID_ENV]):  # it died before the signal was armed
        raise SystemExit(1)
    # Forked: the patched class is inherited, so the original is the saved one. Spawned: this is a
    # fresh interpreter where the class was never patched.
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc

    global _original_worker_main
    # The workers this engine core starts end as promptly (spawned workers find the function by name).
    if _original_worker_main is None:
        _original_worker_main = WorkerProc.worker_main
        WorkerProc.worker_main = staticmethod(_run_worker_then_exit)

    original = _original_run_engine_core or EngineCoreProc.run_engine_core
    _run_then_exit(original, *args, **kwargs)


_original_worker_main: Any = None


def _run_worker_then_exit(*args: Any, **kwargs: Any) -> None:
    """An engine worker's process target (module-level, so spawn can pickle it by name)."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    _run_then_exit(_original_worker_main or WorkerProc.worker_main, *args, **kwargs)


def _run_then_exit(target: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Run an engine process's target; once it has stopped cleanly (vLLM's teardown has closed its
    message queues), run the exit handlers and end the process without the interpreter's final
    teardown: native thread pools keep a stopped engine core or worker alive for seconds there,
    until vLLM's grace windows run out (give_the_engine_time_to_tear_down), and every server stop
    would wait that long."""
    import atexit

    try:
        target(*args, **kwargs)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
