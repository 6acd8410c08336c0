"""The engine book: the one record of which engines serve rollouts, are dead or rejoin.

Every part of the driver that needs the engine set reads it here, never a copy of its own:

* a generation round (rollout/) takes the serving engines when it starts, marks an engine
  dead when a request fails or the watchdog gives it up, and counts each finished request;
* the policy sync asks `probe_dead` before each weight sync, takes a `view()` (handed to
  every learner rank) and compares it with the last one it acted on (`BookView.changes_since`);
  a rejoining engine serves again once the sync gave it the new weights (`serve_again`);
* an evaluation beside the step (another thread) shares the book: an engine it loses is lost
  to the training rounds at once;
* the driver's progress counter (driver/gate.py) is `finished_requests`.

An engine moves serving -> dead (the first reason found is kept) -> rejoining (it answered
/health again and was told to abort what it still ran) -> serving. One lock guards every
move, so any thread may read or write.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from dapo_mega.aio import run_coroutine
from dapo_mega.engines.sglang.client import EngineClient
from dapo_mega.engines.sglang.endpoint import EngineAddress, EngineEndpoint, as_endpoint

__all__ = ["BookView", "EngineBook"]

LOAD_KEYS = ("num_used_tokens", "max_total_num_tokens", "num_running_reqs")
"""The /v1/loads figures whose peaks the book keeps (summed over an engine's data-parallel ranks)."""


@dataclass(frozen=True)
class BookView:
    """The book at one moment, as plain data (it crosses to the other learner ranks)."""

    dead: Dict[str, str] = field(default_factory=dict)
    """url -> why it was found dead."""
    rejoining: Tuple[str, ...] = ()
    """Engines that answered again and wait for the next weight sync."""
    deaths: Dict[str, int] = field(default_factory=dict)
    """url -> how many times it was found dead (a restart between two views shows here)."""

    def changes_since(self, before: "BookView") -> Tuple[List[str], List[str]]:
        """(engines to drop: found dead since `before` and not already out then; engines back:
        rejoining now that were out then or died since). An engine in both lists died and came
        back between the two views (restarted at its address): its old process, and the
        groups it was in, are gone."""
        died = {u for u, k in self.deaths.items() if k > before.deaths.get(u, 0)}
        newly = sorted(u for u in died if u not in before.dead)
        back = [u for u in self.rejoining if u in before.dead or u in died]
        return newly, back


class EngineBook:
    """Which engines serve, are dead or rejoin, and the requests they finished (module docstring)."""

    def __init__(self, engines: Sequence[EngineAddress] = ()):
        self._lock = threading.Lock()
        self.endpoints: Dict[str, EngineEndpoint] = {}
        self._dead: Dict[str, str] = {}
        self._rejoining: List[str] = []
        self._deaths: Dict[str, int] = {}
        self._finished = 0
        self._loads: Dict[str, Dict[str, float]] = {}
        self.add(engines)

    def add(self, engines: Iterable[EngineAddress]) -> None:
        """Engines that serve from now on (the driver's engines, once started)."""
        with self._lock:
            for e in map(as_endpoint, engines):
                self.endpoints.setdefault(e.url, e)

    @property
    def urls(self) -> List[str]:
        return list(self.endpoints)

    # ---------------------------------------------------------------- reading
    def serving(self) -> List[EngineEndpoint]:
        """Engines that serve rollouts: neither dead nor waiting for weights after rejoining."""
        with self._lock:
            return [e for u, e in self.endpoints.items() if u not in self._dead and u not in self._rejoining]

    def is_dead(self, url: str) -> bool:
        return url in self._dead  # one dict lookup: atomic under the GIL

    def why_dead(self, url: str) -> str:
        return self._dead.get(url, "")

    def dead(self) -> Dict[str, str]:
        with self._lock:
            return dict(self._dead)

    def rejoining(self) -> List[str]:
        with self._lock:
            return list(self._rejoining)

    def view(self) -> BookView:
        with self._lock:
            return BookView(dict(self._dead), tuple(self._rejoining), dict(self._deaths))

    # ---------------------------------------------------------------- moves
    def mark_dead(self, url: str, reason: str) -> None:
        """`url` serves no more; the first reason given is the cause. An unknown URL (another
        book's engine) is ignored."""
        with self._lock:
            if url in self.endpoints and url not in self._dead:
                self._dead[url] = reason
                self._deaths[url] = self._deaths.get(url, 0) + 1
                if url in self._rejoining:
                    self._rejoining.remove(url)

    def mark_all_dead(self, dead: Dict[str, str]) -> None:
        for url, reason in dead.items():
            self.mark_dead(url, reason)

    def probe_dead(self, timeout_s: float) -> List[str]:
        """Dead engines that answer /health again (a SIGCONT, a restart at the same address):
        each is told to abort what it still runs (requests a round gave up on) and rejoins;
        returns their URLs. Those that still do not answer stay dead."""
        dead = self.dead()
        if not dead:
            return []

        async def revive(url: str) -> Optional[str]:
            async with EngineClient(self.endpoints[url]) as client:
                if not await client.health(timeout_s=timeout_s):
                    return None
                try:
                    await client.abort_request(abort_all=True)
                except Exception:  # noqa: BLE001 - it answered; a failed abort only lets old work finish
                    pass
                return url

        async def revive_all() -> List[Optional[str]]:
            return await asyncio.gather(*(revive(u) for u in dead))

        back = [u for u in run_coroutine(revive_all()) if u]
        with self._lock:
            for url in back:
                self._dead.pop(url, None)
                if url not in self._rejoining:
                    self._rejoining.append(url)
        return back

    async def abort_all(self, urls: Sequence[str], failures: List[str]) -> None:
        """`/abort_request` (abort_all) on each engine in `urls`; a failure is noted in
        `failures`, not raised (best effort: a round that stops aborts what it sent)."""
        async def one(url: str) -> None:
            try:
                async with EngineClient(self.endpoints[url]) as client:
                    await client.abort_request(abort_all=True)
            except Exception as exc:  # noqa: BLE001 - best effort
                failures.append(f"{url}: abort_request failed: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(one(u) for u in urls))

    def serve_again(self, urls: Sequence[str]) -> None:
        """Rejoining engines now hold the current weights: they serve rollouts again."""
        with self._lock:
            self._rejoining = [u for u in self._rejoining if u not in set(urls)]

    # ---------------------------------------------------------------- progress and load
    def count_finished(self) -> None:
        """Progress: a request finished (any round, training or evaluation), or a turn's request
        or a tool call of a multi-turn chunk ended (rollout/request.py)."""
        with self._lock:
            self._finished += 1

    def finished_requests(self) -> int:
        """Requests, turns and tool calls finished on these engines: the driver's progress counter
        (driver/gate.py)."""
        return self._finished

    def observe_loads(self, url: str, loads: Sequence[Dict[str, object]]) -> None:
        """Keep the peaks of one /v1/loads answer of `url`."""
        with self._lock:
            peak = self._loads.setdefault(url, {})
            for key in LOAD_KEYS:
                value = sum(float(d.get(key, 0) or 0) for d in loads)
                peak[key] = max(peak.get(key, 0.0), value)

    def take_load_metrics(self) -> Dict[str, float]:
        """The engines' KV cache and batch at their busiest since the last call (then reset):
        engine/kv_used_tokens_peak (largest on one engine), engine/kv_capacity_tokens (the
        smallest engine's), engine/kv_usage_peak (used / capacity, worst engine) and
        engine/running_requests_peak. Empty when no probe saw an engine busy."""
        with self._lock:
            seen, self._loads = self._loads, {}
        if not seen:
            return {}
        capacity = [p["max_total_num_tokens"] for p in seen.values() if p.get("max_total_num_tokens")]
        usage = [p["num_used_tokens"] / p["max_total_num_tokens"] for p in seen.values()
                 if p.get("max_total_num_tokens")]
        out = {"engine/kv_used_tokens_peak": max(p.get("num_used_tokens", 0.0) for p in seen.values()),
               "engine/running_requests_peak": max(p.get("num_running_reqs", 0.0) for p in seen.values())}
        if capacity:
            out.update({"engine/kv_capacity_tokens": min(capacity), "engine/kv_usage_peak": max(usage)})
        return out
