"""Process memory habits that cost step time: the garbage collector's full passes
(`freeze_startup_objects`) and glibc handing freed heap back to the OS (`keep_freed_memory`).

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

import ctypes
import gc


def freeze_startup_objects() -> int:
    """Collect once, then exempt every object alive now from later collections.
    Returns the number of objects frozen. Call once start-up is done (model loaded)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


_M_TRIM_THRESHOLD, _M_TOP_PAD = -1, -2  # glibc malloc.h


def keep_freed_memory(trim_threshold: int = 1 << 30, top_pad: int = 64 << 20) -> bool:
    """glibc malloc: keep freed heap memory (up to `trim_threshold`) instead of returning it
    to the OS, and grow the heap `top_pad` at a time.

    A CPU learner allocates and frees activations of new shapes every micro-batch (packed
    rows change with each batch); by default the heap is trimmed as soon as 128 KiB are free
    at its top, so each step page-faults memory it freed a moment before. On the CPU default
    train_step went from 151 to 132 ms (the same samples every step hid it). Raising the mmap
    threshold as well made it slower (153 ms), so that one is left to glibc. The cost: a
    resident size that does not shrink after a peak. Returns False without glibc (nothing
    changed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return all(libc.mallopt(option, value) == 1
               for option, value in ((_M_TRIM_THRESHOLD, trim_threshold), (_M_TOP_PAD, top_pad)))
