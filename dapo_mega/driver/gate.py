"""Where learner ranks wait for the driver: on the rendezvous store, never inside a collective.

While the driver generates a rollout round or evaluates (tens of minutes at 32B), the other
learner ranks have nothing to do until it hands them the step's samples. Waiting for that
inside `broadcast_object_list` would put the wait under the process group's timeout
(`cluster.dist_timeout_s`: NCCL's watchdog kills the job when a rollout outlasts it) and
keep NCCL kernels spinning on GPUs that colocated engines decode on. So every hand-over from
the driver is two steps:

    driver:  gate.handover() = open()  (store key `dapo/gate/<n>`)   then the collective
    others:  gate.handover() = wait()  (poll that key on the store)  then the collective

and the collective starts only when the data is ready. The wait is bounded by progress,
not by time: the driver publishes a progress counter (`dapo/progress`: requests finished on
the engines of its engine book by training and evaluation rounds, and hand-overs) from a
heartbeat thread, and a waiting rank stops with an error naming the driver when that counter has not moved for
`cluster.driver_stall_timeout_s`. A driver that dies takes the store with it (the TCPStore
lives on global rank 0), so a waiting rank sees the store fail and stops.

Without torch.distributed (one process) both methods do nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from dapo_mega import distributed as D

KEY_PREFIX = "dapo/gate/"
PROGRESS_KEY = "dapo/progress"
POLL_S = 2.0
"""How often a waiting rank reads the driver's progress counter."""
HEARTBEAT_S = 2.0
"""How often the driver publishes its progress counter."""
MAX_PAUSE_S = 0.2
"""Longest sleep between two looks at the hand-over key."""


def _default_store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class DriverStalled(RuntimeError):
    """The driver made no progress for driver_stall_timeout_s while learner ranks waited."""


class DriverGate:
    """One rank's side of the hand-overs from the driver (module docstring)."""

    def __init__(self, stall_timeout_s: float = 1800.0, is_driver: bool = False,
                 progress: Optional[Callable[[], int]] = None, store=None,
                 poll_s: float = POLL_S, heartbeat_s: float = HEARTBEAT_S):
        self.stall_timeout_s = float(stall_timeout_s)
        self.is_driver = is_driver
        self.progress = progress or (lambda: 0)
        """The driver's progress counter (it must grow while the driver does useful work)."""
        self.poll_s, self.heartbeat_s = poll_s, heartbeat_s
        self.count = 0
        """Hand-overs so far: the same on every rank (each one opens or waits once)."""
        self._store = store
        self._beat: Optional[threading.Thread] = None
        self._stop = threading.Event()

    @property
    def active(self) -> bool:
        return self._store is not None or D.is_active()

    @property
    def store(self):
        if self._store is None:
            self._store = _default_store()
        return self._store

    def handover(self, stall_timeout_s: Optional[float] = None) -> None:
        """The driver opens hand-over number `count`; every other rank waits for it."""
        if self.is_driver:
            self.open()
        else:
            self.wait(stall_timeout_s)

    def open(self) -> None:
        """Driver: hand-over number `count` is ready; the others may enter its collective."""
        if not self.active:
            return
        self.start()
        self.store.set(f"{KEY_PREFIX}{self.count}", b"1")
        self.count += 1

    def wait(self, stall_timeout_s: Optional[float] = None) -> None:
        """Other ranks: until the driver opens hand-over number `count`, or DriverStalled
        (after `stall_timeout_s`, default the gate's, without the driver's progress)."""
        limit = self.stall_timeout_s if stall_timeout_s is None else float(stall_timeout_s)
        if not self.active:
            return
        key = f"{KEY_PREFIX}{self.count}"
        last_seen, last_change = None, time.monotonic()
        pause, next_look = 0.001, time.monotonic() + self.poll_s
        # check, not store.wait(timeout): a timed-out wait logs two c10d warnings each time
        while not self.store.check([key]):
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)  # a short wait costs ~ms, a long one 0.2 s of lag
            now = time.monotonic()
            if now < next_look:
                continue
            next_look = now + self.poll_s
            seen = self.store.get(PROGRESS_KEY) if self.store.check([PROGRESS_KEY]) else None
            if seen != last_seen:
                last_seen, last_change = seen, now
            elif now - last_change > limit:
                raise DriverStalled(
                    f"waited {now - last_change:.0f} s for the driver (global rank 0) at hand-over "
                    f"{self.count} while its progress counter stayed at {seen!r} "
                    f"(cluster.driver_stall_timeout_s={self.stall_timeout_s:g}, this wait {limit:g}): the driver is stuck; "
                    "see its log (rank 0) for what it was doing")
        self.count += 1

    def start(self) -> None:
        """Driver: publish the progress counter from now on (a thread; `close` stops it)."""
        if self._beat is not None or not self.is_driver or not self.active:
            return
        store, progress = self.store, self.progress

        def beat() -> None:
            while not self._stop.is_set():
                try:
                    store.set(PROGRESS_KEY, f"{progress()}:{self.count}".encode())
                except Exception:  # noqa: BLE001 - the store went away: the run is ending
                    return
                self._stop.wait(self.heartbeat_s)

        self._beat = threading.Thread(target=beat, name="driver-heartbeat", daemon=True)
        self._beat.start()

    def close(self) -> None:
        self._stop.set()


__all__ = ["DriverGate", "DriverStalled"]
