"""Calling user reward functions: by keyword, sync or async, with a timeout, never crashing the run.

A reward function declares the arguments it needs (`completion`, `prompt`, `answer`, `example`,
`info`, `task`, `messages`, `state`) and receives only those, unless it takes **kwargs. Sync
functions run in a worker thread so a slow one cannot stall the event loop: in a pool of their
own, because a hanging reward keeps its thread forever, and in the default pool it would starve
batch sends, checkpoint saves and policy polling. A reward that returns NaN, inf or no number fails
its rollout (the orchestrator masks failed rollouts) instead of poisoning the group's advantages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from grpo.envs.base import Score
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

log = get_logger("envs")

RewardFn = Callable[..., Any]

REWARD_THREADS = 8
"""Threads shared by every sync reward function of the process."""


class RewardPool:
    """A bounded pool of daemon threads for sync reward functions.

    Daemon threads, unlike concurrent.futures' workers, are not joined at interpreter exit, so a
    reward that never returns cannot keep the process from exiting."""

    def __init__(self, max_workers: int = REWARD_THREADS) -> None:
        self.max_workers = max_workers
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.busy = 0
        """Threads running a reward right now (a hung one stays busy for good)."""

    def _worker(self) -> None:
        while True:
            call, future = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue  # timed out while queued: never started
            with self._lock:
                self.busy += 1
            try:
                future.set_result(call())
            except BaseException as exc:  # handed to the awaiting coroutine, which decides
                future.set_exception(exc)
            finally:
                with self._lock:
                    self.busy -= 1

    async def run(self, fn: RewardFn, kwargs: dict[str, Any], timeout: float) -> Any:
        """fn(**kwargs) on a pool thread; TimeoutError after `timeout` s, time spent queued included
        (a running thread cannot be stopped: it stays busy until fn returns)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if len(self._threads) < self.max_workers:
                thread = threading.Thread(target=self._worker, name="grpo-reward", daemon=True)
                thread.start()
                self._threads.append(thread)
        self._queue.put((lambda: fn(**kwargs), future))
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)


REWARD_POOL = RewardPool()


class FailureLog:
    """Logs each distinct failure reason once; counts every occurrence."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def record(self, env_name: str, reason: str, detail: str) -> None:
        """`reason` identifies the kind of failure (deduplicated); `detail` is logged the first time."""
        if reason not in self.counts:
            log.warning("env %s: rollout scoring failed (logged once per reason): %s", env_name, detail)
        self.counts[reason] = self.counts.get(reason, 0) + 1


def _accepted_names(fn: RewardFn) -> set[str] | None:
    """Parameter names fn accepts; None when it takes **kwargs (everything)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class RewardSet:
    """Weighted reward functions of one environment."""

    def __init__(
        self,
        env_name: str,
        rewards: Sequence[RewardFn],
        weights: Sequence[float] | None = None,
        timeout: float = 60.0,
    ) -> None:
        if weights is not None and len(weights) != len(rewards):
            raise UserError(
                f"env {env_name}: {len(weights)} reward weights for {len(rewards)} reward functions; give one "
                "weight per function"
            )
        if timeout <= 0:
            raise UserError(f"env {env_name}: reward timeout must be > 0 seconds, got {timeout}")
        self.env_name = env_name
        self.fns = list(rewards)
        self.weights = list(weights) if weights is not None else [1.0] * len(self.fns)
        self.timeout = timeout
        self.failures = FailureLog()
        self._names = [_accepted_names(fn) for fn in self.fns]

    async def _call(self, index: int, kwargs: dict[str, Any]) -> float:
        fn, names = self.fns[index], self._names[index]
        args = kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(**args), self.timeout)
        else:
            value = await REWARD_POOL.run(fn, args, self.timeout)
        return float(value)

    async def score(self, kwargs: dict[str, Any]) -> Score:
        metrics: dict[str, float] = {}
        total = 0.0
        for i, fn in enumerate(self.fns):
            name = getattr(fn, "__name__", f"reward_{i}")
            try:
                value = await self._call(i, kwargs)
            except TimeoutError:
                reason = detail = f"reward {name} timed out after {self.timeout:g}s"
                # Loud every time: each timeout may leave a thread of the reward pool busy for good.
                log.error(
                    "env %s: %s; its rollout fails (%d of %d reward threads busy)",
                    self.env_name,
                    reason,
                    REWARD_POOL.busy,
                    REWARD_POOL.max_workers,
                )
            except Exception as exc:  # a user reward function may raise anything; the run goes on
                reason = f"reward {name} raised {type(exc).__name__}"
                detail = f"{reason}: {exc}"
            else:
                if math.isfinite(value):
                    metrics[name] = value
                    total += self.weights[i] * value
                    continue
                reason = detail = f"reward {name} returned {value}, not a finite number"
            self.failures.record(self.env_name, reason, detail)
            return Score(reward=0.0, metrics=metrics, failure=reason)
        return Score(reward=total, metrics=metrics)
