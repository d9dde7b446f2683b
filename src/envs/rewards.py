"""Calling user reward functions: by keyword, sync or async, with a timeout, never crashing the run.

A reward function declares the arguments it needs (`completion`, `prompt`, `answer`, `example`,
`info`, `task`, `messages`, `state`) and receives only those, unless it takes **kwargs. Sync
functions run in a worker thread so a slow one cannot stall the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from grpo.envs.base import Score
from grpo.utils.logging import get_logger

log = get_logger("envs")

RewardFn = Callable[..., Any]


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
            raise ValueError(f"got {len(weights)} reward weights for {len(rewards)} reward functions")
        if timeout <= 0:
            raise ValueError(f"reward timeout must be > 0 seconds, got {timeout}")
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
            value = await asyncio.wait_for(asyncio.to_thread(fn, **args), self.timeout)
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
            except Exception as exc:  # a user reward function may raise anything; the run goes on
                reason = f"reward {name} raised {type(exc).__name__}"
                detail = f"{reason}: {exc}"
            else:
                metrics[name] = value
                total += self.weights[i] * value
                continue
            self.failures.record(self.env_name, reason, detail)
            return Score(reward=0.0, metrics=metrics, failure=reason)
        return Score(reward=total, metrics=metrics)
