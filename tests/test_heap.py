"""heap.freeze_startup_objects: cyclic garbage made before it is collected, not frozen;
live objects are frozen, so a later full collection no longer walks them. (keep_freed_memory
changes only how fast a step runs: measured in bench/README.md, not tested here.)"""

import gc
import weakref

from dapo_mega.heap import freeze_startup_objects


class _Node:
    pass


def test_freeze_collects_cycles_first_then_freezes_live_objects():
    gc.unfreeze()
    try:
        dead = _Node()
        dead.self = dead  # a cycle: only the collector frees it
        dead_ref = weakref.ref(dead)
        del dead
        live = [_Node() for _ in range(100)]
        frozen = freeze_startup_objects()
        assert frozen == gc.get_freeze_count() > len(live)
        assert dead_ref() is None  # collected before the freeze, not kept forever
        # tracked objects in the collector's generations no longer include the frozen ones
        assert not any(o is live for o in gc.get_objects())
        assert sum(1 for o in gc.get_objects() if isinstance(o, _Node)) == 0
        new = [_Node()]
        assert any(o is new for o in gc.get_objects())
    finally:
        gc.unfreeze()
