"""One generation round over the serving engines: chunks, workers, the watchdog, in order.

A `Round` is what a rollout manager opens for a list of prompts (the rules are in
rollout/manager.py's module docstring). The prompts are cut into chunks (`chunk_size`),
`requests_per_engine` workers per serving engine take chunks from one priority queue (a
retry first) while their engine is among the least loaded, a `Watchdog` probes each engine
while it has requests in flight, and finished chunks come out strictly in chunk order:

    async with manager.round(prompts, gen_round) as rnd:
        async for groups in rnd:      # one finished chunk's groups, in prompt order
            if enough(groups):
                rnd.stop()            # no new request; those in flight are aborted
            rnd.limit_open(n)         # send only while fewer than n prompts are open
    outcome = rnd.outcome

The round reads the engine set from the engine book and writes deaths and progress into it
(each request answered, each tool call of a multi-turn chunk, each chunk finished: the
driver's progress counter moves while a long chunk works); it calls nothing of whoever
iterates it. While chunks it has handed out wait to be read, no new request is sent: what the
reader decides (the batch is full, fewer prompts should be open) takes effect before the next
request, as if it had been told at once.

A stop reaches every chunk: no chunk is taken and no turn of a multi-turn chunk is sent
after it (the chunk's samples so far are kept as partial rollouts), and the round's requests
still running are aborted, again every ABORT_EVERY_S while one runs (a request that was on
its way when the engine took the abort arrives after it), ABORT_TRIES times at most.

One chunk's request (its inputs, /generate, its groups and, with an environment, its further
turns) is a `ChunkRequest` (rollout/request.py); the round sends it, retries or sets it aside.
With an environment (rollout/turns.py) the round owns the executor its steps run in:
`RoundSettings.tool_slots` threads, made when it starts and shut down when it ends.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Deque, Dict, List, Optional, Sequence

import aiohttp

from dapo_mega.engines.book import EngineBook
from dapo_mega.engines.sglang.client import EngineClient, EngineError, SampleResult
from dapo_mega.rollout.openai_endpoint import AgentEndpoints
from dapo_mega.rollout.outcome import RolloutError, RoundOutcome
from dapo_mega.rollout.partial import (
    PartialGroup,
    cut_chunks,
)
from dapo_mega.rollout.request import AgentStopped, ChunkRequest
from dapo_mega.rollout.samples import Group, PromptEncoding, PromptItem, scored_sample
from dapo_mega.rollout.settings import RoundSettings
from dapo_mega.rollout.watchdog import Hung, Pulse, Watchdog

__all__ = ["RolloutError", "Round", "RoundOutcome", "chunk_size", "scored_sample"]


class _Retry(Exception):
    """The engine aborted the request itself (not our stop): the chunk is sent again."""


_END = object()

ABORT_TRIES = 10
"""abort_all sent at most this many times after a stop, while the round's requests still run."""
ABORT_EVERY_S = 0.5
"""Seconds between two of them (the stop's aborts end within ABORT_TRIES x this, and each
abort's own control timeout)."""


def chunk_size(num_prompts: int, num_engines: int, prompts_per_request: int) -> int:
    """Prompts per request: `prompts_per_request`, or fewer so that every engine gets at least
    one request when there are few prompts (30 AIME problems over 32 engines: 1 each)."""
    if num_prompts <= 0:
        return max(1, prompts_per_request)
    return max(1, min(prompts_per_request, math.ceil(num_prompts / max(1, num_engines))))


class Round:
    """One round of `prompts` over the book's serving engines (module docstring).

    `partials` (prompt index -> its carried PartialGroup): those prompts' chunks resume their
    open samples instead (rollout/partial.py). `step` and `gen_round` seed the requests."""

    def __init__(self, book: EngineBook, settings: RoundSettings, encoding: PromptEncoding,
                 prompts: Sequence[PromptItem], step: int = 0, gen_round: int = 0,
                 partials: Optional[Dict[int, PartialGroup]] = None):
        self.book, self.s, self.encoding = book, settings, encoding
        self.partials = partials or {}
        self.prompts, self.step, self.gen_round = prompts, step, gen_round
        self.outcome = RoundOutcome()
        self.live = [e.url for e in book.serving()]
        size = chunk_size(len(prompts), len(self.live), settings.prompts_per_request) if self.live else 1
        self.chunks = cut_chunks(len(prompts), size, self.partials)
        self.attempts = [0] * len(self.chunks)
        self.remaining = len(self.chunks)
        self.finished: Dict[int, List[Group]] = {}
        self.settled: set = set()  # chunks finished or aborted: nothing more will come for them
        self.next_chunk = 0  # the first chunk not handed out yet
        self.open_prompts = 0  # prompts sent and not handed out yet (nor aborted, nor failed)
        self.max_open: Optional[float] = None
        self.errors: List[BaseException] = []
        self.abort_tasks: List[asyncio.Task] = []
        self.generating = {url: 0 for url in self.live}  # this round's /generate requests in flight
        self.tools: Optional[ThreadPoolExecutor] = None  # the environment's synchronous steps run here
        self.tool_gate: Optional[asyncio.Semaphore] = None
        self.agent_endpoints = AgentEndpoints()  # per engine url, with rollout.agent
        self.ready: Deque[object] = deque()  # handed out, not read yet; _END last
        self.reading = True  # the reader is inside `async with`: unread chunks hold new requests back

    # ---------------------------------------------------------------- what the reader does
    def stop(self) -> None:
        """No new request or turn; those in flight are aborted and their prompts end in
        `outcome.unsent` (module docstring)."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.agent_endpoints.stop()  # agents' new calls are refused from here
        self.pulse.notify()
        self.abort_tasks.append(asyncio.ensure_future(self._abort_until_idle()))

    def limit_open(self, max_open_prompts: Optional[float]) -> None:
        """Send a chunk only while fewer than this many prompts are open (sent and not read
        yet); None: no limit. A chunk that finished chunks wait for (a retry) always goes."""
        self.max_open = max_open_prompts
        self.pulse.notify()

    async def __aenter__(self) -> "Round":
        if not self.live:
            raise RolloutError(f"no live engine (dead: {self.book.dead()}; rejoining: {self.book.rejoining()})")
        self.over, self.stopping, self.pulse = asyncio.Event(), asyncio.Event(), Pulse()
        self.dog = Watchdog(self.book, self.live, self.s.probe_interval_s, self.s.liveness_timeout_s, self.pulse)
        self.task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, kind, exc, tb) -> None:
        if exc is not None and not isinstance(exc, Exception):  # cancelled, interrupted: drop everything
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            return
        if exc is not None:
            self.stop()  # the reader failed: abort what runs, end the round cleanly, then raise
        self.reading = False
        while self.ready:  # what the reader left unread
            self.ready.popleft()
        self.pulse.notify()
        result = await asyncio.gather(self.task, return_exceptions=True)
        if exc is None and isinstance(result[0], BaseException):
            raise result[0]

    def __aiter__(self) -> "Round":
        return self

    async def __anext__(self) -> List[Group]:
        while not self.ready:
            await self.pulse.wait()
        item = self.ready.popleft()
        self.pulse.notify()  # workers waiting for the reader look again
        if item is _END:
            self.ready.appendleft(_END)
            raise StopAsyncIteration
        return item

    # ---------------------------------------------------------------- the round
    async def _run(self) -> RoundOutcome:
        try:
            await self._dispatch()
            return self._conclude()
        finally:
            self.ready.append(_END)
            self.pulse.notify()

    async def _dispatch(self) -> None:
        if not self.chunks:
            return
        if self.s.environment is not None:
            self.tools = ThreadPoolExecutor(self.s.tool_slots, thread_name_prefix="dapo-mega-tool")
            self.tool_gate = asyncio.Semaphore(self.s.tool_slots)  # an async step's bound
        if self.s.agent is not None:  # the agents' OpenAI-compatible endpoint on each engine
            await self.agent_endpoints.open({url: self.book.endpoints[url] for url in self.live}, self.encoding, self.s)
        try:
            await self._dispatch_chunks()
        finally:
            if self.tools is not None:  # steps a failed round left running finish on their own
                self.tools.shutdown(wait=False, cancel_futures=True)
            await self.agent_endpoints.close()

    async def _dispatch_chunks(self) -> None:
        self.queue: asyncio.PriorityQueue = asyncio.PriorityQueue()  # lowest chunk (a retry) first
        for c in range(len(self.chunks)):
            self.queue.put_nowait(c)
        self.start = time.monotonic()
        # One HTTP session (connection pool) per engine, shared by its concurrent requests.
        clients = {url: EngineClient(self.book.endpoints[url], self.s.requests_at_once()) for url in self.live}
        for client in clients.values():
            await client.__aenter__()
        # engine by engine within each rank of worker: the first chunks go round the engines
        workers = [asyncio.ensure_future(self._worker(url, client)) for _ in range(self.s.requests_per_engine)
                   for url, client in clients.items()]
        watchers = [asyncio.ensure_future(self.dog.watch(url, self.over)) for url in self.live]
        try:
            await self._until_over(workers)
        except BaseException:
            for w in workers + watchers:
                w.cancel()
            await asyncio.gather(*workers, *watchers, return_exceptions=True)
            await asyncio.gather(*(c.__aexit__(None, None, None) for c in clients.values()), return_exceptions=True)
            raise
        # Workers return once their request in flight (aborted after a stop) is answered.
        self.over.set()
        self.pulse.notify()
        self.errors += [r for r in await asyncio.gather(*workers, return_exceptions=True)
                        if isinstance(r, Exception)]  # a worker's own bug, not an engine's failure
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await asyncio.gather(*self.abort_tasks, return_exceptions=True)
        await asyncio.gather(*(c.__aexit__(None, None, None) for c in clients.values()), return_exceptions=True)

    async def _until_over(self, workers: List[asyncio.Task]) -> None:
        """Until every chunk settled, the reader stopped, a chunk failed for good or every worker ended."""
        failures = self.outcome.failures
        while not self.over.is_set() and not self.stopping.is_set():
            if (failures and failures[-1].startswith("FATAL")) or all(w.done() for w in workers):
                return
            await self.pulse.wait()

    async def _abort_until_idle(self) -> None:
        """abort_all on each engine a request of this round runs on, again while one still runs
        there: an engine ends what it holds when the abort comes, not a request that arrives
        after it (tests/engines/test_conformance.py), and a request sent as the round stopped
        can. At most ABORT_TRIES times, ABORT_EVERY_S apart; what still runs then is noted."""
        for _ in range(ABORT_TRIES):
            busy = [url for url in self.generating if self._running(url)]
            if not busy:
                return
            await self.book.abort_all(busy, self.outcome.failures)
            again = time.monotonic() + ABORT_EVERY_S
            while any(self._running(url) for url in busy) and time.monotonic() < again:
                await self.pulse.wait(again - time.monotonic())
        busy = {url: self._running(url) for url in self.generating if self._running(url)}
        if busy:
            self.outcome.failures.append(f"requests still running after {ABORT_TRIES} aborts: {busy}")

    def _running(self, url: str) -> int:
        """This round's /generate requests running on `url`: its own and its agents' calls."""
        return self.generating[url] + self.agent_endpoints.in_flight(url)

    def _conclude(self) -> RoundOutcome:
        out = self.outcome
        for c in sorted(self.finished):  # finished after a gap (an aborted or failed chunk before them)
            self._hand_out(self.finished.pop(c))
        out.stopped = self.stopping.is_set()
        if out.stopped:
            while not self.queue.empty():
                out.unsent_chunks.append(self.queue.get_nowait())
            out.unsent = [self.prompts[i] for c in sorted(out.unsent_chunks) for i in self.chunks[c]
                          if i not in out.groups]
        if self.errors:
            raise self.errors[0]
        return out

    # ---------------------------------------------------------------- handing out, in order
    def _hand_out(self, c_groups: List[Group]) -> None:
        self.open_prompts -= len(c_groups)
        if self.reading:
            self.ready.append(c_groups)
        self.pulse.notify()

    def _settle(self, c: int) -> None:
        self.settled.add(c)
        self.remaining -= 1
        while self.next_chunk < len(self.chunks) and self.next_chunk in self.settled:
            n = self.next_chunk
            self.next_chunk += 1
            if n in self.finished:
                self._hand_out(self.finished.pop(n))
        if self.remaining == 0:
            self.over.set()

    # ---------------------------------------------------------------- gates
    def _may_send(self, c: int) -> bool:
        """Nothing handed out waits to be read, and the reader's limit (`limit_open`) allows it."""
        if self.ready and self.reading:
            return False
        return self.max_open is None or any(f > c for f in self.finished) or self.open_prompts < self.max_open

    def _least_loaded(self, url: str) -> bool:
        """No live engine has fewer requests in flight than `url` (manager docstring)."""
        mine = self.dog.in_flight[url]
        return all(mine <= self.dog.in_flight[u] for u in self.live if not self.book.is_dead(u))

    def _requeue(self, c: int, message: str, fatal: bool) -> None:
        self.attempts[c] += 1
        if fatal or self.attempts[c] > self.s.max_retries:
            self.outcome.failures.append(f"FATAL chunk {c} after {self.attempts[c]} attempts: {message}")
        else:
            self.outcome.failures.append(message)
            self.queue.put_nowait(c)

    # ---------------------------------------------------------------- workers
    async def _worker(self, url: str, client: EngineClient) -> None:
        try:
            await self._work(url, client)
        except Exception as exc:  # a bug, not an engine's failure: end the round, never hang on it
            self.errors.append(exc)
            self.over.set()
            raise
        finally:
            self.pulse.notify()

    async def _work(self, url: str, client: EngineClient) -> None:
        """Take chunks for `url` while the round goes on and the engine lives."""
        while not self.over.is_set() and not self.stopping.is_set() and not self.book.is_dead(url):
            if self.queue.empty() or not self._least_loaded(url):
                await self.pulse.wait()
                continue
            c = self.queue.get_nowait()  # no await from here to open_prompts += in _send
            if not self._may_send(c):
                self.queue.put_nowait(c)
                await self.pulse.wait()
                continue
            try:
                if not await self._send(url, client, c):
                    return
            finally:
                self.pulse.notify()

    async def _send(self, url: str, client: EngineClient, c: int) -> bool:
        """One request for chunk `c` on `url` (and, with an environment, its samples' further
        turns); False when this worker should stop (its engine died or hung)."""
        idx = self.chunks[c]
        self.dog.sent(url)
        self.open_prompts += len(idx)
        failed = True
        try:
            reply = await ChunkRequest(self, url, client, c).run()
            groups = reply.groups
            if reply.cut:
                if self.stopping.is_set():  # our own stop: the prompts go back unsent (their partials kept)
                    self._set_aside(c, reply.groups, reply.replies)
                    return True  # failed stays True: no longer open
                raise _Retry(f"{url}: request aborted by the engine")
        except AgentStopped:  # the round stopped under the chunk's agents: its prompts go back unsent
            self._set_aside(c, [], [])
            return True
        except Hung as exc:
            self._requeue(c, str(exc), False)
            return False
        except (_Retry, EngineError) as exc:
            self._requeue(c, f"{exc}", isinstance(exc, EngineError) and exc.status < 500)
            if isinstance(exc, EngineError) and exc.status >= 500:
                self.book.mark_dead(url, str(exc))
                return False
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            if await self.dog.connection_failed_not_engine(url, exc):
                self._requeue(c, f"{url}: {type(exc).__name__}: {exc} (the engine answers /health: "
                                 "retried, not dropped)", False)
                return True
            self.book.mark_dead(url, f"{type(exc).__name__}: {exc}")
            self._requeue(c, f"{url}: {self.book.why_dead(url)}", False)
            return False
        else:
            failed = False
        finally:
            self.dog.ended(url, finished=not failed)
            if failed:  # aborted, requeued or fatal: no longer open
                self.open_prompts -= len(idx)
        self._finish(url, c, groups)
        return True

    def _set_aside(self, c: int, groups: List[PartialGroup], replies: List[SampleResult]) -> None:
        """Chunk `c` cut by our stop (its request aborted, or its next turn not sent): its prompts
        go back unsent; with partial rollouts their samples so far (`groups`, those not ended
        open) are kept (`RoundOutcome.partials`)."""
        out = self.outcome
        out.aborted_requests += 1
        out.aborted_samples += len(replies)
        if self.s.partial_rollout and all(not isinstance(pg.group.prompt_input, str) for pg in groups):
            out.partials.update(zip(self.chunks[c], groups))
        else:
            out.aborted_tokens += sum(len(s.token_ids) for s in replies)
        out.unsent_chunks.append(c)
        self._settle(c)

    def _finish(self, url: str, c: int, groups: List[PartialGroup]) -> None:
        """A complete reply: its groups, the engine's progress and counters."""
        out = self.outcome
        self.book.count_finished()
        out.requests_by_engine[url] = out.requests_by_engine.get(url, 0) + 1
        out.samples_by_engine[url] = out.samples_by_engine.get(url, 0) + sum(len(pg.group.samples) for pg in groups)
        c_groups = [pg.group for pg in groups]
        for i, group in zip(self.chunks[c], c_groups):
            out.groups[i] = group
        self.finished[c] = c_groups
        self._settle(c)
