"""The liveness watchdog of a generation round (rollout/manager.py's module docstring).

Liveness is progress, not a request's duration: while an engine has requests in flight it
is probed (`GET /health` every `probe_interval_s`), and one that answers no probe and makes
no progress for `liveness_timeout_s` is hung: its requests are abandoned (`Hung`) and it is
marked dead in the engine book. Progress is a request answered, or a tool call of a
multi-turn chunk ended (`progressed`): a chunk of sixteen turns is many requests, not one. A
`Watchdog` is made per round: it holds the book, the two settings and the round's chunks in
flight per engine; the round tells it when a chunk starts and ends (`sent`, `ended`) and
when it progresses, and runs `until_hung` around each request.
"""

from __future__ import annotations

import asyncio
import time
from typing import Dict, Sequence

import aiohttp

from dapo_mega.engines.book import EngineBook
from dapo_mega.engines.sglang.client import EngineClient, EngineError

__all__ = ["Hung", "Pulse", "Watchdog"]


class Hung(Exception):
    """The liveness watchdog gave the engine up while this request was in flight."""


class Pulse:
    """Wakes whoever waits for something in the round to change (a request ended, an engine
    hung, the round stopped)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float = 1.0) -> None:
        """Until the next `notify` (or timeout_s: a safety net, not the mechanism)."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass


class Watchdog:
    """Probes the round's busy engines and gives up those that make no progress (module docstring)."""

    def __init__(self, book: EngineBook, urls: Sequence[str], probe_interval_s: float, liveness_timeout_s: float,
                 pulse: Pulse):
        self.book, self.pulse = book, pulse
        self.probe_interval_s, self.liveness_timeout_s = float(probe_interval_s), float(liveness_timeout_s)
        self.in_flight: Dict[str, int] = {u: 0 for u in urls}
        self.last_progress = {u: time.monotonic() for u in urls}  # a probe answered or a request finished
        self.hung = {u: asyncio.Event() for u in urls}

    def sent(self, url: str) -> None:
        self.in_flight[url] += 1

    def ended(self, url: str, finished: bool) -> None:
        """A chunk on `url` ended; `finished`: with a complete reply (progress)."""
        self.in_flight[url] -= 1
        if finished:
            self.progressed(url)

    def progressed(self, url: str) -> None:
        """Work on `url` went on: a request answered, or a tool call between its turns ended."""
        self.last_progress[url] = time.monotonic()

    async def until_hung(self, url: str, request):
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
        raise Hung(self.book.why_dead(url) or f"{url}: hung")

    async def watch(self, url: str, over: asyncio.Event) -> None:
        """Probe `url` while it has requests in flight, until the round is `over`; mark it hung
        after liveness_timeout_s without an answer or progress."""
        async with EngineClient(self.book.endpoints[url]) as probe:
            while not over.is_set() and not self.book.is_dead(url):
                if self.in_flight[url] <= 0:
                    self.last_progress[url] = time.monotonic()
                    await self.pulse.wait(self.probe_interval_s)
                    continue
                t0 = time.monotonic()
                if await probe.health(timeout_s=self.probe_interval_s):
                    self.last_progress[url] = time.monotonic()
                    await self._observe_loads(url, probe)
                elif time.monotonic() - self.last_progress[url] > self.liveness_timeout_s:
                    silent = time.monotonic() - self.last_progress[url]
                    self.book.mark_dead(url, f"{url}: hung: no answer to /health and no progress for "
                                             f"{silent:.0f} s with {self.in_flight[url]} request(s) in flight "
                                             f"(rollout.liveness_timeout_s={self.liveness_timeout_s:g})")
                    self.hung[url].set()
                    self.pulse.notify()
                    return
                await asyncio.sleep(max(0.0, self.probe_interval_s - (time.monotonic() - t0)))

    async def connection_failed_not_engine(self, url: str, exc: BaseException) -> bool:
        """A request's connection dropped (closed or reset: not refused) while the engine still
        answers /health on a new one: the connection failed, not the engine (a server closing
        an idle keep-alive connection as it is reused resets it)."""
        dropped = isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) \
            and not isinstance(exc, aiohttp.ClientConnectorError)
        if not dropped or self.book.is_dead(url):
            return False
        async with EngineClient(self.book.endpoints[url]) as probe:
            return await probe.health(timeout_s=self.probe_interval_s)

    async def _observe_loads(self, url: str, probe: EngineClient) -> None:
        """The peaks of one /v1/loads answer, into the book (an engine without it is not held to it)."""
        try:
            loads = await asyncio.wait_for(probe.loads(), timeout=self.probe_interval_s)
        except (asyncio.TimeoutError, EngineError, aiohttp.ClientError, OSError, KeyError, TypeError):
            return
        try:
            self.book.observe_loads(url, loads)
        except (AttributeError, TypeError, ValueError):
            return
