"""The start-up heap kept out of the cyclic garbage collector's reach while a long loop runs.

By the time the orchestrator's loop starts, its process holds millions of objects it keeps for
good: transformers and torch (the tokenizer imports both), the tokenizer, environments and their
datasets, in a co-located run the trainer and vLLM too. Every full collection walks all of them,
and a loop that makes and drops many small objects per rollout triggers one often: in
benchmarks/orchestrator_bench.py (1,000 rollouts in flight) the collector took 40% of the
orchestrator's time. gc.freeze() moves what exists now into a generation no collection visits;
what the loop makes afterwards is collected as usual. vLLM's engine does the same after its own
start-up (vllm.utils.gc_utils.freeze_gc_heap).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Freeze every object alive now (after one full collection, so no garbage is kept) for the
    duration of the block. Unfrozen after it: a frozen object that later becomes part of a garbage
    cycle is never freed, which a process that runs several loops in turn (tests, an in-process
    trainer torn down) would notice as memory that never comes back. gc has one frozen generation,
    so the end also unfreezes what an in-process vLLM engine froze after its start-up: its objects
    are collectable again, as when that engine shuts down."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
