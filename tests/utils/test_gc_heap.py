from __future__ import annotations

import gc
import weakref

from grpo.utils.gc_heap import startup_heap_frozen


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_what_exists_at_the_start_is_frozen_and_what_the_block_makes_is_collected() -> None:
    before = _cycle()  # garbage already: the start's full collection frees it, nothing frozen keeps it
    with startup_heap_frozen():
        assert before() is None
        assert gc.get_freeze_count() > 1000
        made = _cycle()
        gc.collect()
        assert made() is None
    assert gc.get_freeze_count() == 0


def test_a_frozen_object_that_becomes_a_garbage_cycle_is_collected_after_the_block() -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    with startup_heap_frozen():
        del a, b
        gc.collect()
        assert ref() is not None  # frozen: no collection visits it
    gc.collect()
    assert ref() is None
