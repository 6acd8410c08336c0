"""The liveness watchdog of a generation round (rollout/manager.py's module docstring).

Liveness is progress, not a request's duration: while an engine has requests in flight it
is probed (`GET /health` every `probe_interval_s`), and one that answers no probe and
finishes no request for `liveness_timeout_s` is hung: its requests are abandoned (`Hung`)
and it is marked dead. `EngineLiveness` is the part of `RoundDispatcher` (rollout/dispatch.py)
that does it; it reads the dispatcher's `m` (the manager), `in_flight`, `hung`, `done` and
`last_progress`.
"""

from __future__ import annotations

import asyncio
import time

from dapo_mega.engines.sglang.client import EngineClient

__all__ = ["EngineLiveness", "Hung"]


class Hung(Exception):
    """The liveness watchdog gave the engine up while this request was in flight."""


class EngineLiveness:
    """The watchdog methods of a round (module docstring)."""

    async def _until_hung(self, url: str, request):
        """The reply of `request`, or Hung once the watchdog gives the engine up."""
        task = asyncio.ensure_future(request)
        gone = asyncio.ensure_future(self.hung[url].wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Hung(self.m.dead.get(url, f"{url}: hung"))

    async def _watch(self, url: str) -> None:
        """Probe `url` while it has requests in flight; mark it hung after liveness_timeout_s
        without an answer or a finished request."""
        m = self.m
        async with EngineClient(m.endpoints[url]) as probe:
            while not self.done.is_set() and url not in m.dead:
                if self.in_flight.get(url, 0) <= 0:
                    self.last_progress[url] = time.monotonic()
                    await self._wait_for_change(m.probe_interval_s)
                    continue
                t0 = time.monotonic()
                if await probe.health(timeout_s=m.probe_interval_s):
                    self.last_progress[url] = time.monotonic()
                    await m._observe_loads(url, probe)
                elif time.monotonic() - self.last_progress[url] > m.liveness_timeout_s:
                    silent = time.monotonic() - self.last_progress[url]
                    m._mark_dead(url, f"{url}: hung: no answer to /health and no request finished for "
                                      f"{silent:.0f} s with {self.in_flight.get(url, 0)} request(s) in flight "
                                      f"(rollout.liveness_timeout_s={m.liveness_timeout_s:g})")
                    self.hung[url].set()
                    self._notify()
                    return
                await asyncio.sleep(max(0.0, m.probe_interval_s - (time.monotonic() - t0)))
