"""One generation round over the live engines: chunks, workers, the liveness watchdog.

`RoundDispatcher` is what `RolloutManager._generate` runs for one round (the rules are in
rollout/manager.py's module docstring): the round's prompts are cut into chunks
(`chunk_size`), `requests_per_engine` workers per live engine take chunks from one priority
queue (a retry first) while their engine is among the least loaded, a watchdog per engine
probes it while it has requests in flight, and finished chunks are handed to `on_groups`
strictly in chunk order. Everything the round keeps between those pieces is an attribute of
the dispatcher; the manager keeps what outlives a round (dead engines, counters).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import aiohttp

from dapo_mega.engines.sglang.client import EngineClient, EngineError, PromptInput, RequestSamplingParams, SampleResult
from dapo_mega.engines.sglang.endpoint import EngineEndpoint
from dapo_mega.rollout.liveness import EngineLiveness, Hung
from dapo_mega.rollout.partial import (
    GroupOrigin,
    PartialGroup,
    ResumeRequest,
    cut_chunks,
    per_prompt,
    reply_groups,
    resume_request,
)
from dapo_mega.rollout.samples import Group, PromptItem, scored_sample

__all__ = ["IN_FLIGHT_MARGIN", "RolloutError", "RoundDispatcher", "RoundOutcome", "abort_in_flight", "chunk_size",
           "finished_requests", "scored_sample"]

IN_FLIGHT_MARGIN = 1.0
"""A streamed round keeps requests in flight for want x this many expected kept groups."""


class RolloutError(RuntimeError):
    """Generation cannot complete (every engine dead, retries exhausted)."""


_finished_requests = 0


def finished_requests() -> int:
    """Requests completed by every round of this process: the driver's progress counter
    (`driver/gate.py`), which training and evaluation rounds alike move."""
    return _finished_requests


@dataclass
class RoundOutcome:
    """What one generation round produced."""

    groups: Dict[int, Group] = field(default_factory=dict)
    """prompt index -> its finished group."""
    failures: List[str] = field(default_factory=list)
    stopped: bool = False
    """The batch filled and the rest of the round was cancelled."""
    unsent_chunks: List[int] = field(default_factory=list)
    unsent: List[PromptItem] = field(default_factory=list)
    """Prompts of the round never completed (never sent, or aborted in flight), in order."""
    aborted_requests: int = 0
    aborted_samples: int = 0
    """Samples of the aborted requests (never completed: no ledger rows)."""
    aborted_tokens: int = 0
    """Tokens those samples had generated when aborted (and thrown away: not kept as partials)."""
    partials: Dict[int, PartialGroup] = field(default_factory=dict)
    """prompt index -> its samples so far, of requests aborted in flight (with the manager's
    `partial_rollout`; rollout/partial.py)."""


class _Retry(Exception):
    """The engine aborted the request itself (not our stop): the chunk is sent again."""


def chunk_size(num_prompts: int, num_engines: int, prompts_per_request: int) -> int:
    """Prompts per request: `prompts_per_request`, or fewer so that every engine gets at least
    one request when there are few prompts (30 AIME problems over 32 engines: 1 each)."""
    if num_prompts <= 0:
        return max(1, prompts_per_request)
    return max(1, min(prompts_per_request, math.ceil(num_prompts / max(1, num_engines))))


class RoundDispatcher(EngineLiveness):
    """One round of `prompts` over the manager's live engines (module docstring).

    `manager` is the RolloutManager that owns the engines: its endpoints, dead-engine book,
    request settings and counters. With `on_groups`, each finished chunk's groups are handed
    to it once every earlier chunk has been; once it returns True no new request is sent, the
    requests in flight are aborted and their prompts, with those never sent, end in
    `RoundOutcome.unsent`. With `want` (groups still needed) and a `keep_rate` estimate, a
    request is sent only while the prompts in flight are expected to keep fewer than
    want() x IN_FLIGHT_MARGIN groups. `partials` (prompt index -> its carried PartialGroup):
    those prompts' chunks resume their open samples instead (rollout/partial.py).
    """

    def __init__(self, manager, prompts: Sequence[PromptItem], gen_round: int,
                 on_groups: Optional[Callable[[List[Group]], bool]] = None,
                 want: Optional[Callable[[], int]] = None,
                 keep_rate: Optional[Callable[[], Optional[float]]] = None,
                 partials: Optional[Dict[int, PartialGroup]] = None):
        self.m = manager
        self.partials = partials or {}
        self.prompts, self.gen_round = prompts, gen_round
        self.on_groups, self.want, self.keep_rate = on_groups, want, keep_rate
        self.out = RoundOutcome()
        self.live = [e.url for e in manager.alive_engines()]
        size = chunk_size(len(prompts), len(self.live), manager.prompts_per_request) if self.live else 1
        self.chunks = cut_chunks(len(prompts), size, self.partials)
        self.attempts = [0] * len(self.chunks)
        self.remaining = len(self.chunks)
        self.finished: Dict[int, List[Group]] = {}
        self.settled: set = set()  # chunks finished or aborted: nothing more will come for them
        self.next_chunk = 0  # the first chunk not handed over yet
        self.in_flight: Dict[str, int] = {}
        self.open_prompts = 0  # prompts sent and not handed over yet (nor aborted, nor failed)
        self.errors: List[BaseException] = []
        self.abort_tasks: List[asyncio.Task] = []
        self.last_progress = {u: time.monotonic() for u in self.live}  # a probe answered or a request finished

    # ---------------------------------------------------------------- events
    def _notify(self) -> None:
        """A request ended (or the round stopped): idle workers and watchers look again."""
        self.changed.set()
        self.changed = asyncio.Event()

    async def _wait_for_change(self, timeout_s: float = 1.0) -> None:
        """Until a request ends (or timeout_s: a safety net, not the mechanism)."""
        try:
            await asyncio.wait_for(self.changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    # ---------------------------------------------------------------- the round
    async def run(self) -> RoundOutcome:
        if not self.live:
            raise RolloutError(f"no live engine (dead: {self.m.dead_engines()}; rejoining: {self.m.rejoining})")
        if not self.chunks:
            return self.out
        self.queue: asyncio.PriorityQueue = asyncio.PriorityQueue()  # lowest chunk (a retry) first
        for c in range(len(self.chunks)):
            self.queue.put_nowait(c)
        self.start = time.monotonic()
        self.done, self.stop, self.changed = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.hung = {u: asyncio.Event() for u in self.live}
        # One HTTP session (connection pool) per engine, shared by its concurrent requests.
        clients = {url: EngineClient(self.m.endpoints[url]) for url in self.live}
        for client in clients.values():
            await client.__aenter__()
        # engine by engine within each rank of worker: the first chunks go round the engines
        workers = [asyncio.create_task(self._worker(url, client)) for _ in range(self.m.requests_per_engine)
                   for url, client in clients.items()]
        watchers = [asyncio.create_task(self._watch(url)) for url in self.live]
        try:
            await self._until_over(workers)
        except BaseException:
            for w in workers + watchers:
                w.cancel()
            await asyncio.gather(*workers, *watchers, return_exceptions=True)
            await asyncio.gather(*(c.__aexit__(None, None, None) for c in clients.values()), return_exceptions=True)
            raise
        # Workers return once their request in flight (aborted after a stop) is answered.
        self.done.set()
        self._notify()
        self.errors += [r for r in await asyncio.gather(*workers, return_exceptions=True)
                        if isinstance(r, Exception)]  # a worker's own bug, not an engine's failure
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await asyncio.gather(*self.abort_tasks, return_exceptions=True)
        await asyncio.gather(*(c.__aexit__(None, None, None) for c in clients.values()), return_exceptions=True)
        return self._conclude()

    async def _until_over(self, workers: List[asyncio.Task]) -> None:
        """Until every chunk settled, the batch filled, a chunk failed for good or every worker ended."""
        failures = self.out.failures
        while not self.done.is_set() and not self.stop.is_set():
            if (failures and failures[-1].startswith("FATAL")) or all(w.done() for w in workers):
                return
            await self._wait_for_change()

    def _conclude(self) -> RoundOutcome:
        out = self.out
        for c in sorted(self.finished):  # finished after a gap (an aborted or failed chunk before them)
            self._hand_over(self.finished.pop(c))
        out.stopped = self.stop.is_set()
        if out.stopped:
            while not self.queue.empty():
                out.unsent_chunks.append(self.queue.get_nowait())
            out.unsent = [self.prompts[i] for c in sorted(out.unsent_chunks) for i in self.chunks[c]
                          if i not in out.groups]
        if self.errors:
            raise self.errors[0]
        return out

    # ---------------------------------------------------------------- handing over, in order
    def _hand_over(self, c_groups: List[Group]) -> None:
        self.open_prompts -= len(c_groups)
        if self.on_groups is None:
            return
        try:
            full = self.on_groups(c_groups)
        except BaseException as exc:  # raised by collect_step after the round
            self.errors.append(exc)
            full = True
        if full and not self.stop.is_set():
            self.stop.set()
            self._notify()
            busy = [u for u, k in self.in_flight.items() if k > 0]
            self.abort_tasks.append(asyncio.create_task(
                abort_in_flight(self.m.endpoints, busy, self.out.failures)))

    def _settle(self, c: int) -> None:
        self.settled.add(c)
        self.remaining -= 1
        while self.next_chunk < len(self.chunks) and self.next_chunk in self.settled:
            n = self.next_chunk
            self.next_chunk += 1
            if n in self.finished:
                self._hand_over(self.finished.pop(n))
        if self.remaining == 0:
            self.done.set()

    # ---------------------------------------------------------------- gates
    def _may_send(self, c: int) -> bool:
        """The keep-rate gate (class docstring); a chunk that finished chunks wait for (a retry) always goes."""
        rate = self.keep_rate() if self.keep_rate is not None else None
        return (self.want is None or rate is None or any(f > c for f in self.finished)
                or self.open_prompts * rate < self.want() * IN_FLIGHT_MARGIN)

    def _least_loaded(self, url: str) -> bool:
        """No live engine has fewer requests in flight than `url` (manager docstring)."""
        dead = self.m.dead
        mine = self.in_flight.get(url, 0)
        return all(mine <= self.in_flight.get(u, 0) for u in self.live if u not in dead)

    def _requeue(self, c: int, message: str, fatal: bool) -> None:
        self.attempts[c] += 1
        if fatal or self.attempts[c] > self.m.max_retries:
            self.out.failures.append(f"FATAL chunk {c} after {self.attempts[c]} attempts: {message}")
        else:
            self.out.failures.append(message)
            self.queue.put_nowait(c)

    # ---------------------------------------------------------------- workers
    async def _worker(self, url: str, client: EngineClient) -> None:
        try:
            await self._work(url, client)
        except Exception as exc:  # a bug, not an engine's failure: end the round, never hang on it
            self.errors.append(exc)
            self.done.set()
            raise
        finally:
            self._notify()

    async def _work(self, url: str, client: EngineClient) -> None:
        """Take chunks for `url` while the round goes on and the engine lives."""
        while not self.done.is_set() and not self.stop.is_set() and url not in self.m.dead:
            if self.queue.empty() or not self._least_loaded(url):
                await self._wait_for_change()
                continue
            c = self.queue.get_nowait()  # no await from here to open_prompts += in _send
            if not self._may_send(c):
                self.queue.put_nowait(c)
                await self._wait_for_change()
                continue
            try:
                if url in self.m.dead or self.stop.is_set():  # no attempt spent
                    self.queue.put_nowait(c)
                    return
                if not await self._send(url, client, c):
                    return
            finally:
                self._notify()

    async def _send(self, url: str, client: EngineClient, c: int) -> bool:
        """One request for chunk `c` on `url`; False when this worker should stop (its engine
        died or hung)."""
        m, idx = self.m, self.chunks[c]
        inputs, params, resume = self._request(idx)
        t0 = time.monotonic()
        self.in_flight[url] = self.in_flight.get(url, 0) + 1
        self.open_prompts += len(idx)
        failed = True
        try:  # a resumed chunk with nothing open (every sample had finished) needs no request
            reports = bool(m.routed_experts_every) and c % m.routed_experts_every == 0
            samples = await self._until_hung(url, client.generate(inputs, params, return_logprob=m.return_logprob,
                                                                    return_routed_experts=reports)) \
                if inputs else []
            if any(s.aborted for s in samples):
                if self.stop.is_set():  # our own abort: the prompts go back unsent (their partials kept)
                    self._set_aside(url, c, inputs, params, resume, samples, t0)
                    return True  # failed stays True: no longer open
                raise _Retry(f"{url}: request aborted by the engine")
        except Hung as exc:
            self._requeue(c, str(exc), False)
            return False
        except (_Retry, EngineError) as exc:
            self._requeue(c, f"{exc}", isinstance(exc, EngineError) and exc.status < 500)
            if isinstance(exc, EngineError) and exc.status >= 500:
                m._mark_dead(url, str(exc))
                return False
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            if await self._connection_failed_not_engine(url, exc):
                self._requeue(c, f"{url}: {type(exc).__name__}: {exc} (the engine answers /health: "
                                 "retried, not dropped)", False)
                return True
            m._mark_dead(url, f"{type(exc).__name__}: {exc}")
            self._requeue(c, f"{url}: {m.dead[url]}", False)
            return False
        else:
            failed = False
        finally:
            self.in_flight[url] -= 1
            if failed:  # aborted, requeued or fatal: no longer open
                self.open_prompts -= len(idx)
        self._finish(url, c, inputs, params, resume, samples, t0)
        return True

    async def _connection_failed_not_engine(self, url: str, exc: BaseException) -> bool:
        """A request's connection dropped (closed or reset: not refused) while the engine still
        answers /health on a new one: the connection failed, not the engine (a server closing
        an idle keep-alive connection as it is reused resets it)."""
        dropped = isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) \
            and not isinstance(exc, aiohttp.ClientConnectorError)
        if not dropped or url in self.m.dead:
            return False
        async with EngineClient(self.m.endpoints[url]) as probe:
            return await probe.health(timeout_s=self.m.probe_interval_s)

    def _request(self, idx: List[int]):
        """(inputs, sampling params, ResumeRequest or None) of the chunk of prompts `idx`."""
        params = self.m._params_for([self.prompts[i] for i in idx], self.gen_round)
        if idx[0] not in self.partials:
            return [self.m.prompt_to_input(self.prompts[i]) for i in idx], params, None
        resume = resume_request([self.partials[i] for i in idx], per_prompt(params, len(idx)))
        return resume.inputs, resume.params, resume

    def _groups(self, url: str, c: int, inputs: List[PromptInput], params: RequestSamplingParams,
                resume: Optional[ResumeRequest], samples: List[SampleResult], t0: float) -> List[PartialGroup]:
        """The chunk's groups from a reply (complete or aborted), each with its samples still open."""
        latency, delay = time.monotonic() - t0, t0 - self.start
        return reply_groups([self.prompts[i] for i in self.chunks[c]], inputs, params, resume, samples,
                            [self.partials.get(i) for i in self.chunks[c]], self.m.n_samples,
                            GroupOrigin(url, delay, latency, self.gen_round, self.m.dataset_revision))

    def _set_aside(self, url: str, c: int, inputs: List[PromptInput], params: RequestSamplingParams,
                   resume: Optional[ResumeRequest], samples: List[SampleResult], t0: float) -> None:
        """A request of chunk `c` aborted by our stop: its prompts go back unsent; with the
        manager's partial_rollout their samples so far are kept (`RoundOutcome.partials`)."""
        out = self.out
        out.aborted_requests += 1
        out.aborted_samples += len(samples)
        if self.m.partial_rollout and not any(isinstance(x, str) for x in inputs):
            out.partials.update(zip(self.chunks[c], self._groups(url, c, inputs, params, resume, samples, t0)))
        else:
            out.aborted_tokens += sum(len(s.token_ids) for s in samples)
        out.unsent_chunks.append(c)
        self._settle(c)

    def _finish(self, url: str, c: int, inputs: List[PromptInput], params: RequestSamplingParams,
                resume: Optional[ResumeRequest], samples: List[SampleResult], t0: float) -> None:
        """A complete reply: its groups, the engine's progress and counters."""
        global _finished_requests
        m = self.m
        self.last_progress[url] = time.monotonic()
        _finished_requests += 1
        m.requests_by_engine[url] = m.requests_by_engine.get(url, 0) + 1
        m.samples_by_engine[url] = m.samples_by_engine.get(url, 0) + len(samples)
        c_groups = [pg.group for pg in self._groups(url, c, inputs, params, resume, samples, t0)]
        for i, group in zip(self.chunks[c], c_groups):
            self.out.groups[i] = group
        self.finished[c] = c_groups
        self._settle(c)


async def abort_in_flight(endpoints: Dict[str, EngineEndpoint], urls: Sequence[str], failures: List[str]) -> None:
    """`/abort_request` (abort_all) on each engine in `urls`; a failure is noted, not raised."""
    async def one(url: str) -> None:
        try:
            async with EngineClient(endpoints[url]) as client:
                await client.abort_request(abort_all=True)
        except Exception as exc:  # noqa: BLE001 - best effort
            failures.append(f"{url}: abort_request failed: {type(exc).__name__}: {exc}")

    await asyncio.gather(*(one(u) for u in urls))
