"""Reward functions called the way TRL's GRPOTrainer calls them: once per group, every argument a list.

`fn(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list[float | None]`, one
entry per completion; `columns` are the dataset's other columns, each value repeated per completion.
None means the function does not apply to that completion: its reward is the weighted sum over the
functions that returned a value, and a completion no function applies to is unscored (it fails,
which masks it and keeps it out of the group's baseline, and is counted and logged). The functions of
a group run concurrently: async ones on the event loop, sync ones on the reward pool's threads.
A function that raises, times out or returns something other than one number-or-None per
completion fails the whole group (it said nothing about any of them); a NaN or infinite value fails
its completion, as in every grpo environment.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from grpo.envs.base import Score
from grpo.envs.rewards import REWARD_POOL, FailureLog, RewardFailure
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

log = get_logger("envs")

OWN_ARGUMENTS = ("prompts", "completions", "completion_ids")
"""What every function gets besides the dataset's columns."""


def check_signature(where: str, fn: Callable[..., Any], columns: Sequence[str]) -> None:
    """Refuse at load a function that cannot be called with TRL's keywords (a run would otherwise fail
    every group with the same TypeError)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    names = [*OWN_ARGUMENTS, *columns]
    try:
        signature.bind(**dict.fromkeys(names))
    except TypeError as exc:
        raise UserError(
            f"{where}: cannot be called as fn({', '.join(names)}) ({exc}); TRL-style reward functions take "
            "those keywords: add **kwargs to its parameters"
        ) from None


def _value(value: Any) -> float | RewardFailure | None:
    """A reward entry as float or None (a built-in's RewardFailure kept: it fails that completion);
    ValueError for anything else (bool counts as a number)."""
    if value is None or isinstance(value, RewardFailure):
        return value
    if isinstance(value, str | bytes) or not (isinstance(value, int | float) or hasattr(value, "__float__")):
        raise ValueError(f"entry {value!r} ({type(value).__name__}) is not a number or None")
    return float(value)


class GroupRewardSet:
    """The weighted TRL-style reward functions of one environment."""

    def __init__(
        self,
        env_name: str,
        fns: Sequence[Callable[..., Any]],
        names: Sequence[str],
        weights: Sequence[float] | None = None,
        timeout: float = 60.0,
    ) -> None:
        assert len(names) == len(fns) and (weights is None or len(weights) == len(fns))
        self.env_name = env_name
        self.fns = list(fns)
        self.names = list(names)
        """Metric name of each function (its own name; a repeated name gets #index)."""
        self.weights = list(weights) if weights is not None else [1.0] * len(self.fns)
        self.timeout = timeout
        self.failures = FailureLog()

    def add(self, fn: Callable[..., Any], weight: float, name: str) -> None:
        """One more function (the LLM judge, a reward model), logged under `name`."""
        if name in self.names:
            raise UserError(f"env {self.env_name}: a reward function is already named {name!r}; rename one")
        self.fns.append(fn)
        self.names.append(name)
        self.weights.append(weight)

    async def _call(self, index: int, kwargs: dict[str, Any]) -> Any:
        fn = self.fns[index]
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(**kwargs), self.timeout)
        out = await REWARD_POOL.run(fn, kwargs, self.timeout)
        if inspect.isawaitable(out):  # an object whose async __call__ iscoroutinefunction does not see
            return await asyncio.wait_for(out, self.timeout)
        return out

    async def _values(
        self, index: int, kwargs: dict[str, Any], num_completions: int
    ) -> list[float | RewardFailure | None] | str:
        """Function `index`'s value per completion, or why the group fails."""
        name = self.names[index]
        try:
            out = await self._call(index, kwargs)
        except TimeoutError:
            reason = detail = f"reward {name} timed out after {self.timeout:g}s over a group"
            log.error("env %s: %s; the group's rollouts fail", self.env_name, reason)
        except Exception as exc:  # a user reward function may raise anything; the run goes on
            reason = f"reward {name} raised {type(exc).__name__}"
            detail = f"{reason}: {exc}"
        else:
            try:
                # a list, or what TRL also takes (torch.tensor(out)): a tuple, a numpy array, a tensor
                if (
                    isinstance(out, str | bytes | dict)
                    or not hasattr(out, "__len__")
                    or not hasattr(out, "__iter__")
                ):
                    raise ValueError(f"returned {type(out).__name__}, not a list")
                if len(out) != num_completions:
                    raise ValueError(f"returned {len(out)} values for {num_completions} completions")
                return [_value(v) for v in out]
            except ValueError as exc:
                reason = f"reward {name} returned a bad list"
                detail = f"{reason}: {exc}; return one float (or None) per completion"
        self.failures.record(self.env_name, reason, detail)
        return reason

    async def score(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[Any],
        columns: dict[str, list[Any]],
    ) -> list[Score]:
        """One Score per completion; `columns` holds one list (a value per completion) per column."""
        num_completions = len(completions)
        kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
        results = await asyncio.gather(
            *(self._values(i, kwargs, num_completions) for i in range(len(self.fns)))
        )
        group_failure = next((r for r in results if isinstance(r, str)), None)
        if group_failure is not None:
            return [Score(reward=0.0, failure=group_failure) for _ in range(num_completions)]
        return [
            self._combine([r[j] for r in results if not isinstance(r, str)]) for j in range(num_completions)
        ]

    def _combine(self, values: list[float | RewardFailure | None]) -> Score:
        """One completion's Score from each function's value for it."""
        metrics: dict[str, float] = {}
        total = 0.0
        for name, weight, value in zip(self.names, self.weights, values, strict=True):
            if value is None:
                continue
            if isinstance(value, RewardFailure):
                reason = f"reward {name}: {value}"
                self.failures.record(self.env_name, reason, reason)
                return Score(reward=0.0, failure=reason)
            if not math.isfinite(value):
                reason = f"reward {name} returned {value}, not a finite number"
                self.failures.record(self.env_name, reason, reason)
                return Score(reward=0.0, failure=reason)
            metrics[name] = value
            total += weight * value
        if not metrics:
            reason = "every reward function returned None (none applies)"
            self.failures.record(
                self.env_name, reason, f"{reason}; the rollout is not scored (masked, counted as failed)"
            )
            return Score(reward=0.0, failure=reason)
        return Score(reward=total, metrics=metrics)
