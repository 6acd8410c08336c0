"""Keep the garbage collector's full passes off the step's critical path.

A trainer or engine process holds a few hundred thousand long-lived Python objects once it
has started (torch, transformers, megatron-core, aiohttp: modules, classes, functions).
CPython's full (generation-2) collection walks every one of them; in the embedded engine it
took 100-200 ms and came every few rollout steps, during which the engine generated nothing
(measured with gc.callbacks on the CPU default, where a rollout step takes ~90 ms). Objects
made before serving live for the whole process, so they are moved out of the collector's
reach once (`gc.freeze`, as SGLang does after its warm-up); later full passes walk only what
was made since. Reference counting still frees frozen objects; only cycles among them
would stay, and start-up leaves none worth a pass (it is collected once just before).
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect once, then exempt every object alive now from later collections.
    Returns the number of objects frozen. Call once start-up is done (model loaded)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
