"""Staleness: which policy the inference servers run, and which rollouts a batch may take.

Two knobs, two rules (docs/design.md, "Step semantics"):
- max_async_level gates *starting* rollouts: new rollouts for batch n start only from policy
  >= max(0, n - max_async_level). At policy v the orchestrator fills batches up to
  v + max_async_level and then waits for `broadcasts/step_{v+1}/STABLE` (launch_target in the
  loop); 0 is strictly on-policy sampling.
- max_off_policy_steps gates *training* on them: batch n takes a rollout only if the policy it
  started from is at most max_off_policy_steps versions old (n - start_version). A rollout started
  in time can still finish late (a long or multi-turn generation, or an oversampled leftover, while
  the trainer publishes newer policies): it trains in a later batch while it is young enough, and is
  dropped and counted (off_policy/num_dropped) once it is not. The config requires
  max_off_policy_steps >= max_async_level, so a rollout that arrives in time is never dropped.
- A batch takes the freshest finished groups first (FinishedGroups), so oversampling's surplus
  lowers a batch's lag instead of raising it; the older surplus is what goes stale.
- With partial_rollouts a rollout's tokens can come from several policies (grpo.orchestrator.rollouts.partial);
  its start_version is its oldest token's, so both rules judge it by that token.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from grpo.inference.types import RolloutClient
from grpo.orchestrator.rollouts.partial import UpdateGate
from grpo.orchestrator.types import Group
from grpo.transport.weights.filesystem import NOISY_NORMS_FILE, broadcast_dir, broadcasts_dir
from grpo.utils.atomic import STABLE
from grpo.utils.logging import get_logger

log = get_logger("orchestrator")

T = TypeVar("T")


def required_policy(step: int, max_async_level: int) -> int:
    """Oldest policy new rollouts for batch `step` may start from."""
    return max(0, step - max_async_level)


def oldest_acceptable(step: int, max_off_policy_steps: int) -> int:
    """Oldest start policy whose rollouts batch `step` may train on: a rollout started from policy v
    has its oldest tokens step - v policy updates behind the policy that trains on them."""
    return step - max_off_policy_steps


class FinishedGroups:
    """Finished groups no batch has taken yet, freshest (newest start policy) first; among equally
    fresh ones, the first to finish. A batch asks for its stale ones to go before each group it
    takes, so that check is O(1) while none is stale: a scan of every held group per take cost
    ~1.4 M staleness checks for a 1,000-group step (6.9 of 17 s in benchmarks/orchestrator_bench.py)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Group]] = []  # (-start_version, arrival, group)
        self._order = itertools.count()
        self._oldest = 0
        """The lowest start_version held (meaningless while empty)."""

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, group: Group) -> None:
        version = group.start_version
        self._oldest = version if not self._heap else min(self._oldest, version)
        heapq.heappush(self._heap, (-version, next(self._order), group))

    def remove_started_before(self, version: int) -> list[Group]:
        """Remove and return the groups whose start policy is older than `version`."""
        if not self._heap or self._oldest >= version:
            return []
        kept: list[tuple[int, int, Group]] = []
        rejected: list[Group] = []
        for entry in self._heap:
            if -entry[0] >= version:
                kept.append(entry)
            else:
                rejected.append(entry[2])
        heapq.heapify(kept)
        self._heap = kept
        if kept:
            self._oldest = min(-entry[0] for entry in kept)
        return rejected

    def pop_freshest(self) -> Group | None:
        return heapq.heappop(self._heap)[2] if self._heap else None


def newest_stable(run_dir: Path, after: int) -> int:
    """Highest v > after whose broadcast is STABLE; `after` if none.

    Lists the broadcasts folder (the trainer may prune old ones, so versions need not be
    contiguous). Blocking; call it off the event loop.
    """
    newest = after
    root = broadcasts_dir(run_dir)
    if not root.is_dir():
        return newest
    for entry in os.scandir(root):
        name = entry.name
        is_newer = name.startswith("step_") and name[5:].isdigit() and int(name[5:]) > newest
        if is_newer and os.path.exists(os.path.join(entry.path, STABLE)):
            newest = int(name[5:])
    return newest


class PolicyTracker:
    """Watches the run dir for new policies and switches the inference servers to them."""

    def __init__(
        self,
        run_dir: Path,
        client: RolloutClient,
        lora_adapter: str | None,
        base_model: str,
        version: int = 0,
        poll_interval: float = 0.05,
        update_gate: UpdateGate | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.client = client
        self.lora_adapter = lora_adapter
        self.base_model = base_model
        self.version = version
        self.poll_interval = poll_interval
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.num_updates = 0
        self.last_update_seconds = 0.0
        self.update_gate = update_gate
        """partial_rollouts: generation stops for each update and resumes on the new policy."""

    @property
    def model_name(self) -> str:
        """Served model name for requests: the adapter once one is loaded, else the base model."""
        if self.lora_adapter is not None and self.version > 0:
            return self.lora_adapter
        return self.base_model

    @property
    def cache_salt(self) -> str:
        return f"policy-{self.version}"

    async def load(self, version: int) -> None:
        """Switch the servers to `version` (its broadcast must be STABLE), with its QeRL noisy norms
        when the trainer wrote them."""
        if self.update_gate is None:
            await self._load(version)
            return
        # generation stops first and resumes once `version` is set: every token has one policy
        async with self.update_gate.update():
            await self._load(version)

    async def _load(self, version: int) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        folder = broadcast_dir(self.run_dir, version)
        path = str(folder)
        if self.lora_adapter is not None:
            await self.client.load_lora_adapter(self.lora_adapter, path)
        else:
            await self.client.update_weights(path)
        # After the weights: full weights carry clean norms, and a merged adapter only repacks linear
        # layers (norms are no LoRA target), so the noise applied last is what the servers run.
        noisy_norms = folder / NOISY_NORMS_FILE
        if await asyncio.to_thread(noisy_norms.is_file):
            await self.client.apply_noisy_norms(str(noisy_norms))
        self.last_update_seconds = loop.time() - started
        self.num_updates += 1
        async with self._changed:
            self.version = version
            self._changed.notify_all()
        log.debug("inference now runs policy %d (%.2fs)", version, self.last_update_seconds)

    async def poll_once(self) -> None:
        newest = await asyncio.to_thread(newest_stable, self.run_dir, self.version)
        if newest > self.version:
            await self.load(newest)

    async def _watch(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="policy-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def wait_for(self, version: int) -> None:
        """Return once the servers run a policy >= version."""
        async with self._changed:
            while self.version < version:
                if self._task is not None and self._task.done():
                    self._task.result()  # the watcher died: surface its error instead of hanging
                # wake up now and then to notice a dead watcher
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=1.0)
                except TimeoutError:
                    continue

    async def reached(self, version: int, timeout: float, stop: asyncio.Event) -> bool | None:
        """True once the servers run a policy >= `version`, False when `timeout` seconds pass first,
        None when `stop` is set first. A dead watcher's error is raised, as during the run."""
        waited = await unless_stopped(asyncio.wait_for(self.wait_for(version), timeout), stop)
        if waited is None:
            return None
        if isinstance(waited.exception(), TimeoutError):
            return False
        waited.result()
        return True


async def unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> asyncio.Task[T] | None:
    """The finished task that ran `work` (read its result or error), or None when `stop` was set
    first; `work` is then cancelled."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        task.cancel()  # a no-op once it finished
        await asyncio.gather(task, stopper, return_exceptions=True)
    return None if task.cancelled() else task
