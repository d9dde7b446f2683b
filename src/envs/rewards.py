"""Calling user reward functions: by keyword, sync or async, with a timeout, never crashing the run.

A reward function declares the arguments it needs (`completion`, `prompt`, `answer`, `example`,
`info`, `task`, `messages`, `state`) and receives only those, unless it takes **kwargs. A function
marked `@group_reward` scores all completions of one prompt at once (pairwise or rank rewards): it
gets `completions` (the reply texts), `messages`, `states` and `completion_ids` (one entry per
completion) besides the shared `prompt`, `answer`, `example`, `info`, `task`, and returns one value
per completion. The functions of a rollout (and of its group) run concurrently, each under its own
timeout, and each failure keeps its own reason.

Sync functions run in a worker thread so a slow one cannot stall the event loop: in a pool of their
own (`reward_threads` threads), because a hanging reward keeps its thread forever, and in the
default pool it would starve batch sends, checkpoint saves and policy polling. A reward that
returns NaN, inf or no number fails its rollout (the orchestrator masks failed rollouts) instead of
poisoning the group's advantages.
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
"""Threads shared by every sync reward function of the process, unless the orchestrator's
`reward_threads` says otherwise (`REWARD_POOL.resize`)."""

GROUP_REWARD_ATTR = "__grpo_group_reward__"
"""Set on a function by `group_reward`: "group" (needs the whole group) or "batch" (scores each
completion alone, batched for speed: a group of one is fine, as in a multi-turn environment)."""


class RewardFailure(Exception):
    """Raised by a built-in reward (the LLM judge) for one completion: its message is the rollout's
    failure reason, one line."""


def group_reward(fn: RewardFn) -> RewardFn:
    """Mark `fn` as a group-level reward: it gets all completions of one prompt at once
    (`completions`, `messages`, `states`, `completion_ids`: one entry each) and returns one value
    per completion."""
    setattr(fn, GROUP_REWARD_ATTR, "group")
    return fn


def group_kind(fn: RewardFn) -> str | None:
    """ "group", "batch" or None (a per-rollout function)."""
    return getattr(fn, GROUP_REWARD_ATTR, None)


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

    def resize(self, max_workers: int) -> None:
        """Allow `max_workers` threads (threads already started stay; a smaller size starts no more)."""
        if max_workers < 1:
            raise UserError(f"reward_threads must be >= 1, got {max_workers}")
        self.max_workers = max_workers

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


Value = float | str
"""A function's value for one completion, or why it failed (the rollout's failure reason)."""


class RewardSet:
    """Weighted reward functions of one environment: per-rollout ones and group-level ones."""

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
        self.fns: list[RewardFn] = []
        self.names: list[str] = []
        """Metric name of each function."""
        self.weights: list[float] = []
        self.timeout = timeout
        self.failures = FailureLog()
        self._accepted: list[set[str] | None] = []
        for i, fn in enumerate(rewards):
            self.add(fn, 1.0 if weights is None else weights[i], getattr(fn, "__name__", f"reward_{i}"))

    def add(self, fn: RewardFn, weight: float, name: str) -> None:
        self.fns.append(fn)
        self.weights.append(weight)
        self.names.append(name)
        self._accepted.append(_accepted_names(fn))

    @property
    def has_group(self) -> bool:
        """Whether a function scores groups (the environment then offers score_group)."""
        return any(group_kind(fn) is not None for fn in self.fns)

    @property
    def needs_whole_group(self) -> bool:
        """Whether a function's values mean something only over a whole group (a rank reward)."""
        return any(group_kind(fn) == "group" for fn in self.fns)

    async def _call(self, index: int, kwargs: dict[str, Any]) -> Any:
        fn, names = self.fns[index], self._accepted[index]
        args = kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(**args), self.timeout)
        out = await REWARD_POOL.run(fn, args, self.timeout)
        if inspect.isawaitable(out):  # an object whose async __call__ iscoroutinefunction does not see
            return await asyncio.wait_for(out, self.timeout)
        return out

    def _failed(self, reason: str, detail: str) -> str:
        self.failures.record(self.env_name, reason, detail)
        return reason

    async def _values(self, index: int, kwargs: dict[str, Any], num_completions: int | None) -> list[Value]:
        """Function `index`'s value per completion (or failure reason); num_completions None: a
        per-rollout function and kwargs for one rollout, else a group function over that many."""
        name = self.names[index]
        count = 1 if num_completions is None else num_completions
        try:
            out = await self._call(index, kwargs)
        except TimeoutError:
            reason = f"reward {name} timed out after {self.timeout:g}s"
            # Loud every time: each timeout may leave a thread of the reward pool busy for good.
            log.error(
                "env %s: %s; its rollout fails (%d of %d reward threads busy)",
                self.env_name,
                reason,
                REWARD_POOL.busy,
                REWARD_POOL.max_workers,
            )
            return [self._failed(reason, reason)] * count
        except RewardFailure as exc:
            return [self._failed(f"reward {name}: {exc}", f"reward {name}: {exc}")] * count
        except Exception as exc:  # a user reward function may raise anything; the run goes on
            reason = f"reward {name} raised {type(exc).__name__}"
            return [self._failed(reason, f"{reason}: {exc}")] * count
        if num_completions is None:
            out = [out]
        elif isinstance(out, str | bytes | dict) or not hasattr(out, "__len__") or len(out) != count:
            reason = f"reward {name} returned a bad list"
            detail = f"{reason}: {str(out)[:80]!r}; a group reward returns one number per completion"
            return [self._failed(reason, detail)] * count
        return [self._number(name, v) for v in out]

    def _number(self, name: str, value: Any) -> Value:
        if isinstance(value, RewardFailure):  # a batched built-in's failure for this completion only
            return self._failed(f"reward {name}: {value}", f"reward {name}: {value}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if math.isfinite(number):
            return number
        reason = f"reward {name} returned {value!r}, not a finite number"
        return self._failed(reason, reason)

    async def score(self, kwargs: dict[str, Any]) -> Score:
        """One rollout's Score; a group function sees it as a group of one."""
        (score,) = await self.score_group([kwargs])
        return score

    async def score_group(
        self, rollouts: list[dict[str, Any]], completion_ids: Sequence[list[int] | None] | None = None
    ) -> list[Score]:
        """One Score per rollout from each one's keyword arguments (per-rollout functions' keywords);
        every function of every rollout runs concurrently."""
        group = group_arguments(rollouts, completion_ids)
        calls = []
        for i, fn in enumerate(self.fns):
            if group_kind(fn) is not None:
                calls.append(self._values(i, group, len(rollouts)))
            else:
                calls.append(_flat(*(self._values(i, kwargs, None) for kwargs in rollouts)))
        results = await asyncio.gather(*calls)
        return [self._combine([values[j] for values in results]) for j in range(len(rollouts))]

    def _combine(self, values: list[Value]) -> Score:
        metrics: dict[str, float] = {}
        total = 0.0
        failure = None
        for name, weight, value in zip(self.names, self.weights, values, strict=True):
            if isinstance(value, str):
                failure = failure or value
                continue
            metrics[name] = value
            total += weight * value
        if failure is not None:
            return Score(reward=0.0, metrics=metrics, failure=failure)
        return Score(reward=total, metrics=metrics)


async def _flat(*calls: Any) -> list[Value]:
    """The per-rollout values of one function over a group, its rollouts scored concurrently."""
    return [values[0] for values in await asyncio.gather(*calls)]


SHARED_ARGUMENTS = ("prompt", "answer", "example", "info", "task")
"""Per-rollout keywords that are the same for the whole group; a group function gets them as is."""

LISTED_ARGUMENTS = {"completion": "completions", "messages": "messages", "state": "states"}
"""Per-rollout keyword -> the group function's keyword (one entry per completion)."""


def group_arguments(
    rollouts: list[dict[str, Any]], completion_ids: Sequence[list[int] | None] | None = None
) -> dict[str, Any]:
    """A group function's keywords from its rollouts' per-rollout keywords."""
    first = rollouts[0]
    group = {k: first[k] for k in SHARED_ARGUMENTS if k in first}
    for one, many in LISTED_ARGUMENTS.items():
        group[many] = [kwargs.get(one) for kwargs in rollouts]
    group["completion_ids"] = list(completion_ids) if completion_ids is not None else [None] * len(rollouts)
    return group
