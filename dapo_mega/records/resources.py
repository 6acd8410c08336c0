"""The resource envelope of a step: how long each phase took and the memory it peaked at.

    meter = PhaseMeter()
    with meter.phase("rollout"):
        ...
    meter.metrics   {"time/rollout_s": 41.2, "mem/rollout/rss_peak_gib": 3.1, ...}

Memory is this process's (the driver, global rank 0), measured per phase from a reset peak:
on a GPU the CUDA caching allocator's peak allocated and reserved bytes
(`torch.cuda.reset_peak_memory_stats`, `max_memory_allocated` / `max_memory_reserved`),
and always the resident set's peak (Linux: writing 5 to /proc/self/clear_refs resets
VmHWM, which /proc/self/status then reports). The keys:

    time/<phase>_s                     seconds
    mem/<phase>/rss_peak_gib           peak resident set (host memory), GiB
    mem/<phase>/cuda_allocated_peak_gib, mem/<phase>/cuda_reserved_peak_gib   on a GPU

Where a figure cannot be read (no /proc, a kernel that refuses clear_refs) it is left out,
never guessed.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional

GIB = float(1 << 30)
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_rss_peak() -> bool:
    """Reset this process's peak resident set (VmHWM) to its current size; False where the
    kernel does not allow it (the peak then stays the process's lifetime peak)."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def rss_peak_bytes() -> Optional[int]:
    """VmHWM of this process in bytes, or None without /proc."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PhaseMeter:
    """Times phases and records each one's peak memory (see the module docstring)."""

    def __init__(self, cuda: Optional[bool] = None):
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        self.cuda = cuda
        self.metrics: Dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        resettable = reset_rss_peak()
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        try:
            yield
        finally:
            self.metrics[f"time/{name}_s"] = time.perf_counter() - t
            peak = rss_peak_bytes()
            if peak is not None and resettable:
                self.metrics[f"mem/{name}/rss_peak_gib"] = peak / GIB
            if self.cuda:
                import torch

                self.metrics[f"mem/{name}/cuda_allocated_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                self.metrics[f"mem/{name}/cuda_reserved_peak_gib"] = torch.cuda.max_memory_reserved() / GIB

    def timings(self) -> Dict[str, float]:
        """The time/<phase>_s entries only."""
        return {k: v for k, v in self.metrics.items() if k.startswith("time/")}
