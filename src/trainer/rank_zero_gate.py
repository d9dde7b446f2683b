"""Ranks > 0 wait for rank 0 outside any collective (data parallel under torchrun).

Rank 0 alone waits for the orchestrator's next batch, for as long as that takes (an orchestrator
restart, slow inference). A rank waiting for it inside a collective would fail after the process
group's timeout (`dist_timeout`) and bring the job down, although nothing is wrong. So before each
collective that rank 0 may reach late (sharing a batch; a checkpoint, after rank 0 alone published a
policy), every rank passes a gate: rank 0 sets the gate's key in the process group's key-value store
and goes on into the collective; ranks > 0 wait for that key in the store, in bounded waits that
return as soon as it is set, and only then enter the collective. A collective's timeout thus
measures the ranks' work, never a wait for batches.

A rank 0 that dies does not leave the others waiting: either the store is rank 0's own (a launch
without torchrun's agent, the co-located replicas) and their waits fail at once with an error naming
rank 0, or torchrun's agent holds it and stops every rank of a job whose rank 0 failed.

Gates are numbered: every rank passes the same gates in the same order (they sit in functions every
rank calls). The last rank through a gate deletes its keys, so a long run leaves none behind.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING

from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    import torch.distributed as dist

log = get_logger("trainer")

WAIT_SLICE_S = 600.0
"""Longest single store wait; between two, a waiting rank logs that it still waits."""


class RankZeroGate:
    """This process's gates, over `store` (one per process group, shared by every Trainer using it)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.num_passed = 0

    def pass_gate(self, what: str) -> None:
        """Rank 0 opens the next gate, the other ranks wait (outside any collective) until it has.
        `what` names what comes after the gate, for the logs."""
        key = f"gate_{self.num_passed}"
        self.num_passed += 1
        if self.rank == 0:
            self.store.set(key, what)
            return
        self._wait(key, what)
        if self.store.add(f"{key}_passed", 1) == self.world_size - 1:
            self.store.delete_key(key)
            self.store.delete_key(f"{key}_passed")

    def _wait(self, key: str, what: str) -> None:
        import torch.distributed as dist

        start = time.monotonic()
        while True:
            try:
                self.store.wait([key], timedelta(seconds=WAIT_SLICE_S))
                return
            except dist.DistNetworkError as err:
                raise RuntimeError(
                    f"rank {self.rank} lost rank 0 while waiting for it ({what}): the process group's store "
                    f"is unreachable ({err}); rank 0 stopped or died, its log says why"
                ) from err
            except dist.DistStoreError:
                log.info(
                    "rank %d has waited %.0f s for rank 0 (%s)", self.rank, time.monotonic() - start, what
                )
