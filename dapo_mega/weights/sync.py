"""Learner-side weight sync into rollout engines (SGLang or the embedded engine).

Distributed mode (disaggregated; also usable colocated on CPU):

    once:      every PP stage's source rank (layout.is_weight_source) creates group
               `<prefix>_pp<stage>` = {that rank (rank 0)} ∪ {engine e at rank 1+e}, while
               POSTing /init_weights_update_group to every engine (both sides must enter
               the rendezvous together or they hang).
    each sync: rank 0 pauses the engines, flushes their cache and opens their weight-update
               session (/begin_weight_update); then the stages take turns
               (`run_stages_in_turn`: engines serve requests in arrival order), each
               stage's source streams `iter_megatron_to_hf` into buckets of ≤ bucket_mb; per
               bucket it starts one broadcast of the flattened bytes (SGLang's
               load_format="flattened_bucket") and POSTs /update_weights_from_distributed
               with the bucket's names/dtypes/shapes to every engine; the last bucket of
               the last stage carries `weight_version`; rank 0 closes the session
               (/end_weight_update) and continues generation. Pipelined: the next bucket
               is produced and flattened while the current one is being broadcast; its
               POST waits for that broadcast to complete (see `_sync_distributed`).

The embedded engine rejects a bad bucket (400: unknown name, wrong shape) before joining the
broadcast; the syncer raises at once, naming the engine and its message, instead of
waiting for the broadcast (the group should then be destroyed and re-initialised).
SGLang 0.5.23 receives the bucket first, then answers a wrong shape with a 400 (after a
partial load) and ignores an unknown name (a log line): names come from the HF mapping, and
`tests/engines/test_conformance.py` pins both behaviours.

Colocated mode: per bucket, the tensors go into a shared-memory file (CPU; JSON handle,
load_format "shared_memory_json") and are sent with /update_weights_from_tensor. On GPUs
an engine shares its devices with learner ranks and cannot join a NCCL group with them
("Duplicate GPU detected"): `weights.handover` has every learner rank take part, and the
rank on each engine TP rank's GPU makes that rank's CUDA IPC payload (one per TP rank);
here a TP-1 engine on the syncing rank's own GPU is all one process can serve. Engines
release their memory while the learner trains (`release_engine_memory` /
`resume_engine_memory`; SGLang needs `--enable-memory-saver` for that to free anything).

Memory beyond the model is bounded by two buckets on each side: on the engines, the one
being received and the one still being loaded; on the learner, two flat buffers (the one
being broadcast and the next one being filled) besides the stream's tensors of up to two
buckets (`iter_buckets`' lookahead). A tensor larger than a bucket is a bucket of its own.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar

import torch

from dapo_mega import log
from dapo_mega.engines.sglang.api import FLATTENED_BUCKET
from dapo_mega.engines.sglang.client import EngineClient, EngineError
from dapo_mega.engines.sglang.endpoint import CONTROL_TIMEOUT_S, EngineAddress, as_endpoint
from dapo_mega.weights.engine_memory import EngineMemory
from dapo_mega.wire import transport
from dapo_mega.wire.checksum import HeldAs

logger = log.get(__name__)

SHM_LOAD_FORMAT = "shared_memory_json"
T = TypeVar("T")


class WeightSyncError(RuntimeError):
    """An engine refused or failed a weight update."""


class EngineLostError(WeightSyncError):
    """Engines gone during a sync (their process exited, or a restart no longer holds the
    weight-update group): handled like engines the rollout manager found dead (dropped, the
    group formed again with the survivors, the sync done again), not a failed run."""

    def __init__(self, lost: Dict[str, str], others: Sequence[str] = ()):
        self.lost = dict(lost)
        """Engine url -> why it counts as lost."""
        self.others = list(others)
        """Errors of engines that are still there (refusals, failed loads)."""
        super().__init__("engines lost during the weight sync: " + "; ".join(f"{u}: {w}" for u, w in self.lost.items())
                         + ("; other errors: " + "; ".join(others) if others else ""))


SURVIVOR_WAIT_S = 30.0
"""Bounds the waits after an engine is lost mid-sync: the survivors leaving the aborted group,
the other engines' replies to a bucket whose broadcast failed."""

LOST_GROUP_MARKS = ("Please call `init_weights_update_group` first",)
"""What SGLang (model_runner) and the embedded engine answer an update into a group they do not
hold: an engine restarted at its address since the group formed."""


def lost_reason(exc: BaseException) -> Optional[str]:
    """Why `exc` (from one engine's HTTP call) means the engine is gone, or None when it is an
    answer (a refusal, a failed load) of an engine still there."""
    import aiohttp

    if isinstance(exc, EngineError):
        if any(mark in str(exc.body) for mark in LOST_GROUP_MARKS):
            return f"it no longer holds the weight-update group (restarted since it formed): {exc}"
        return None
    if isinstance(exc, (aiohttp.ClientConnectionError, ConnectionError)):
        return f"its connection failed ({type(exc).__name__}: {exc}): the engine process is gone"
    return None


def raise_for_engines(results: Dict[str, object]) -> None:
    """Raise for the errors among one call's per-engine results: `EngineLostError` when an
    engine is gone (with the others' errors), else `WeightSyncError`."""
    errors = {u: r for u, r in results.items() if isinstance(r, BaseException)}
    if not errors:
        return
    lost = {u: why for u, r in errors.items() if (why := lost_reason(r)) is not None}
    others = [f"{u}: {r}" for u, r in errors.items() if u not in lost]
    if lost:
        raise EngineLostError(lost, others)
    raise WeightSyncError("; ".join(others))


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    num_tensors: int
    num_buckets: int

    @property
    def gbps(self) -> float:
        """GB/s (1e9 bytes) of payload moved per engine."""
        return self.bytes / max(self.seconds, 1e-9) / 1e9

    def as_metrics(self) -> dict:
        return {"sync/seconds": self.seconds, "sync/gbps": self.gbps, "sync/bytes": self.bytes,
                "sync/buckets": self.num_buckets}


def iter_buckets(named_tensors: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int
                 ) -> Iterator[Tuple[List[Tuple[str, torch.Tensor]], bool]]:
    """Group a stream of tensors into buckets of ≤ bucket_bytes; yields (bucket, is_last).

    A tensor larger than the bucket is a bucket of its own. One bucket of lookahead tells
    which is last, so at most two buckets are alive.
    """
    pending: Optional[List[Tuple[str, torch.Tensor]]] = None
    current: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            if pending is not None:
                yield pending, False
            pending, current, size = current, [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        if pending is not None:
            yield pending, False
        pending = current
    if pending is not None:
        yield pending, True


class _LoopThread:
    """An asyncio loop in a daemon thread: HTTP calls run while this thread broadcasts."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="weight-sync-http", daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: Optional[float] = None):
        return self.submit(coro).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@dataclass
class _Broadcast:
    """One bucket in flight: its broadcast and each engine's reply to its POST (by url)."""

    work: object
    posts: Dict[str, Future]
    first: str
    last: str

    def settle(self, timeout_s: float) -> None:
        """Wait for every POST (bounded by `timeout_s` each); raise for the failed ones."""
        for fut in self.posts.values():
            try:
                fut.exception(timeout_s)
            except Exception:  # noqa: BLE001 - not answered in time: left to the caller's check
                pass
        raise_for_engines({u: f.exception(0) if f.done() else None for u, f in self.posts.items()})


class WeightSyncer:
    """Pushes learner weights (HF names) into every engine; see the module docstring."""

    def __init__(self, engines: Sequence[EngineAddress], bucket_mb: float = 512,
                 mode: str = "distributed", backend: str = "gloo", master_address: str = "127.0.0.1",
                 group_prefix: str = "dapo_weight_sync", pause_mode: str = "retract",
                 timeout_s: Optional[float] = None, engine_tp_size: int = 1,
                 cpu_tensor_format: str = SHM_LOAD_FORMAT,
                 incarnations: Optional[Callable[[], Mapping[str, str]]] = None):
        """`incarnations`: each engine's process as its launcher announced it (url -> id,
        `engines.process.engine_incarnations`), read by the memory ledger (`engine_memory.py`).
        `cpu_tensor_format`: how colocated mode hands tensors over: "shared_memory_json"
        (the embedded engine, which never unpickles and runs on the CPU: GPU tensors are copied
        to the host file too) or "sglang" (SGLang's own serializer: CUDA IPC handles for GPU
        tensors, torch's reductions over shared-memory files for CPU ones). `backend`: the
        group's (`placement.ProcessGroupPlan.backend`); gloo flattens each bucket on the host."""
        if mode not in ("distributed", "colocated"):
            raise ValueError(f"mode must be distributed or colocated, got {mode!r}")
        if cpu_tensor_format not in (SHM_LOAD_FORMAT, "sglang"):
            raise ValueError(f"cpu_tensor_format must be {SHM_LOAD_FORMAT} or sglang, got {cpu_tensor_format!r}")
        self.cpu_tensor_format = cpu_tensor_format
        endpoints = [as_endpoint(e) for e in engines]
        self.engine_urls = [e.url for e in endpoints]
        # group rendezvous and broadcasts: the engines' control timeout unless given
        timeout_s = timeout_s if timeout_s is not None else max((e.control_timeout_s for e in endpoints),
                                                                default=CONTROL_TIMEOUT_S)
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.mode, self.backend, self.master_address = mode, backend, master_address
        self.group_prefix, self.pause_mode, self.timeout_s = group_prefix, pause_mode, timeout_s
        self.engine_tp_size = engine_tp_size
        self._io = _LoopThread()
        self.clients = [EngineClient(e) for e in endpoints]
        self.group = None
        self.group_name: Optional[str] = None
        self.stage: Optional[int] = None
        """Pipeline stage whose weights this syncer broadcasts (set by init_group)."""
        self.generation = 0
        """Groups this syncer formed before the current one (each engine death forms a new one)."""
        self._flats: List[Optional[torch.Tensor]] = [None, None]  # the bucket being filled, the one in flight
        self.memory = EngineMemory()
        """Colocated: which engines released their memory, and which process did (`engine_memory.py`)."""
        self.incarnations = incarnations or dict

    def close(self) -> None:
        """Leave the weight-update group (engines that outlive this trainer, attached by URL or
        a registry, keep serving) and close the clients."""
        if self.group is not None:
            name = self.group_name
            try:
                self.destroy_group(timeout_s=10)
            except Exception as exc:  # an engine already gone must not hide the real error
                logger.info(f"[weight sync] leaving group {name}: {exc}", extra=log.EVERY_RANK)
        async def _close():
            for c in self.clients:
                await c.close()
        self._io.run(_close(), timeout=10)
        self._io.close()

    def drop_engines(self, urls: Sequence[str]) -> List[str]:
        """Stop syncing into engines found dead (by the rollout manager); returns those dropped.

        Colocated mode: each engine loads its own copy of a bucket, so the others carry on.
        Distributed mode: the weight-update group has the dead engine as a member, and a
        broadcast would wait for it until the group times out. The group is left (here and
        on every surviving engine) and `group` is None until `init_group(port, self.stage)`
        forms a new one with the survivors; stages must do that in turn (`PolicySync`).
        """
        wanted = {u.rstrip("/") for u in urls}
        gone = [c for c in self.clients if c.url in wanted]
        if not gone:
            return []
        names = [c.url for c in gone]
        self.clients = [c for c in self.clients if c not in gone]
        self.engine_urls = [c.url for c in self.clients]
        for c in gone:
            self._io.run(c.close(), timeout=10)
        if not self.clients:
            raise WeightSyncError(f"every engine is dead ({names}); nothing left to sync into")
        if self.mode == "distributed" and self.group is not None:
            self.destroy_group()
            self.generation += 1
        return names

    def add_engines(self, engines: Sequence[EngineAddress]) -> None:
        """Sync into these engines again (found dead, answering again). Distributed mode: the
        group is left as in `drop_engines`, and `init_group` forms a new one with them in it."""
        known = set(self.engine_urls)
        new = [e for e in map(as_endpoint, engines) if e.url not in known]
        if not new:
            return
        if self.mode == "distributed" and self.group is not None:  # left by its members only
            self.destroy_group()
            self.generation += 1
        self.clients += [EngineClient(e) for e in new]
        self.engine_urls = [c.url for c in self.clients]
        urls = [e.url for e in new]
        self.memory.forget(self.memory.restarted(urls, self.incarnations()))  # a new process holds its memory
        if not self.memory.lent:  # back outside the learner's step, still released: take it back before any write
            self._resume([u for u in urls if u in self.memory.released])

    async def _all(self, fn, skip: Sequence[str] = ()):
        """`fn(client)` on every engine (but `skip`) at once; raises `EngineLostError` when one
        is gone (the others' calls have run), `WeightSyncError` for other failures."""
        clients = [c for c in self.clients if c.url not in set(skip)]
        results = await asyncio.gather(*(fn(c) for c in clients), return_exceptions=True)
        raise_for_engines({c.url: r for c, r in zip(clients, results)})
        return results

    # ---------------------------------------------------------------- group
    def group_ranks(self) -> Tuple[int, Dict[str, int]]:
        """(world size, {engine url: group rank of its TP rank 0}) of the weight-update group
        this syncer forms: this rank is 0, the engines follow in their order here, by the
        placement's rule (`backends.placement.weight_update_rank_offset`), so the first group
        of a run is the one `dapo-mega plan` reports."""
        from dapo_mega.backends.placement import weight_update_rank_offset, weight_update_world_size

        return (weight_update_world_size(len(self.clients), self.engine_tp_size),
                {c.url: weight_update_rank_offset(i, self.engine_tp_size) for i, c in enumerate(self.clients)})

    def init_group(self, master_port: int, stage: int = 0) -> None:
        """On a stage's source rank: create the group with all engines (group-local rank 0).
        A group formed again after an engine died gets a new name (`..._g<generation>`)."""
        name = f"{self.group_prefix}_pp{stage}" + (f"_g{self.generation}" if self.generation else "")
        world, offsets = self.group_ranks()

        async def forget(c):  # a trainer killed before close() left its group on engines that outlive it
            try:
                await c.destroy_weights_update_group(name)
            except EngineError:  # 400: no such group (the usual case)
                pass
        self._io.run(self._all(forget), timeout=self.timeout_s)
        replies = self._io.submit(self._all(lambda c: c.init_weights_update_group(
            self.master_address, master_port, offsets[c.url], world,
            group_name=name, backend=self.backend, timeout_s=self.timeout_s)))
        joined: Future = Future()

        def join() -> None:  # this side of the rendezvous, in a thread: the engines' replies are watched
            try:
                joined.set_result(transport.init_custom_process_group(
                    self.backend, f"tcp://{self.master_address}:{master_port}", world, 0, name,
                    timeout=timedelta(seconds=self.timeout_s)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                joined.set_exception(exc)
        threading.Thread(target=join, name="weight-sync-join", daemon=True).start()
        wait([joined, replies], timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
        if replies.done() and replies.exception() is not None and not joined.done():
            # an engine that refused never joins: say why now rather than after timeout_s
            raise WeightSyncError(f"weight-update group {name}: {replies.exception()}")
        self.group = joined.result(self.timeout_s)
        replies.result(self.timeout_s)
        self.group_name, self.stage = name, stage

    def abort_group(self, lost: Sequence[str] = ()) -> Dict[str, str]:
        """An engine was lost mid-broadcast: abort the group here at once (its broadcast in
        flight would otherwise wait for the lost member until the group's timeout, under
        NCCL's watchdog), then ask the survivors to leave it, each bounded by SURVIVOR_WAIT_S.
        Returns the survivors that did not leave in time, url -> why: they count as lost too.
        A survivor's side is SGLang's: it joined the group without a timeout of its own, and its
        destroy (`destroy_process_group`, whose `pg.shutdown()` waits for in-flight NCCL kernels
        in recent torch; only `_abort_process_group` does not) waits for a broadcast whose
        member is gone, until NCCL's watchdog ends the process. Dropped, it never holds up this
        trainer; the engines role restarts it when it exits. `init_group` forms a new group
        (`_g<n+1>`) with the others."""
        if self.group is None:
            return {}
        name, group = self.group_name, self.group
        self.group = self.group_name = None
        self.generation += 1
        transport.abort_custom_process_group(group)
        survivors = [c for c in self.clients if c.url not in set(lost)]
        wait_s = min(self.timeout_s, SURVIVOR_WAIT_S)

        async def leave(c) -> Optional[str]:
            try:
                await asyncio.wait_for(c.destroy_weights_update_group(name), wait_s)
                return None
            except asyncio.TimeoutError:
                return (f"it did not leave the aborted weight-update group {name} within {wait_s:.0f} s (its "
                        "broadcast, or its group's teardown, waits for the member that is gone)")
            except Exception as exc:  # noqa: BLE001 - gone too, or refused (init_group asks again)
                return lost_reason(exc)
        async def leave_all() -> List[Optional[str]]:
            return await asyncio.gather(*(leave(c) for c in survivors))
        outcomes = self._io.run(leave_all(), timeout=wait_s + 10)
        stuck = {c.url: why for c, why in zip(survivors, outcomes) if why}
        for url, why in stuck.items():
            logger.info(f"[weight sync] engine {url} lost with the aborted group {name}: {why}", extra=log.EVERY_RANK)
        return stuck

    def destroy_group(self, timeout_s: Optional[float] = None) -> None:
        if self.group is None:
            return
        name, group = self.group_name, self.group
        self.group = self.group_name = None
        try:
            self._io.run(self._all(lambda c: c.destroy_weights_update_group(name)), timeout=timeout_s or self.timeout_s)
        finally:
            transport.destroy_custom_process_group(group)

    # ---------------------------------------------------------------- engine state
    def pause_engines(self) -> None:
        """Pause generation, flush the KV cache and open the weight-update session on every
        engine (SGLang 0.5.23 refuses updates outside `/begin_weight_update` ... `/end_weight_update`)."""
        self._io.run(self._all(self._pause_one), timeout=self.timeout_s)

    async def _pause_one(self, c: EngineClient) -> None:
        await c.pause_generation(self.pause_mode)
        await c.flush_cache()
        await c.begin_weight_update()

    def continue_engines(self, skip: Sequence[str] = ()) -> None:
        """Close the weight-update session and continue generation on every engine (but `skip`,
        engines lost during the sync)."""
        async def _continue(c):
            try:
                await c.end_weight_update()
            finally:
                await c.continue_generation()
        self._io.run(self._all(_continue, skip=skip), timeout=self.timeout_s)

    def release_engine_memory(self) -> None:
        """Colocated: free engine weights + KV cache before training, once each engine is idle
        (requests aborted when the batch filled may still be leaving its running batch). Only
        engines holding their memory are asked (`engine_memory.py`: a second pause ends them)."""
        urls = self.memory.to_release(self.engine_urls)
        incarnations = self.incarnations()
        self.memory.lent = True
        try:
            self._io.run(self._all(lambda c: c.release_memory_when_idle(timeout_s=self.timeout_s),
                                   skip=[u for u in self.engine_urls if u not in urls]), timeout=self.timeout_s)
        except EngineLostError as exc:  # the others were released
            self.memory.mark_released([u for u in urls if u not in exc.lost], incarnations)
            raise
        self.memory.mark_released(urls, incarnations)

    def resume_engine_memory(self) -> List[str]:
        """Colocated: the engines released take their memory back. Returns the engines restarted
        since their release (a new process at the same address, which holds its memory and
        no weight-update group): not resumed, they rejoin like engines found dead and back."""
        self.memory.lent = False
        resume, restarted = self.memory.to_resume(self.engine_urls, self.incarnations())
        self.memory.forget(restarted)
        self._resume(resume)
        return restarted

    def _resume(self, urls: Sequence[str]) -> None:
        if not urls:
            return
        try:
            self._io.run(self._all(lambda c: c.resume_memory_occupation(),
                                   skip=[u for u in self.engine_urls if u not in urls]), timeout=self.timeout_s)
        finally:  # resumed, or gone (and its memory with it)
            self.memory.forget(urls)

    # ---------------------------------------------------------------- sync
    def sync(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], weight_version: Optional[str],
             is_last_stage: bool = True, pause: bool = True) -> SyncStats:
        """Stream `named_tensors` (HF names, full tensors) into every engine.

        Call on the source rank of each PP stage (the other ranks of the stage must still
        drain their copy of the TP-gathering iterator). `pause=True` pauses/flushes before
        and continues after (set it False when a caller coordinates several stages); the
        pause runs while the first bucket is produced, and nothing is sent before it is done.
        """
        start = time.perf_counter()
        total, count, buckets = 0, 0, 0
        pausing = self._io.submit(self._all(self._pause_one)) if pause else None

        def paused() -> None:
            if pausing is not None:
                pausing.result(self.timeout_s)  # raises the engines' refusal

        try:
            if self.mode == "distributed":
                total, count, buckets = self._sync_distributed(named_tensors, weight_version, is_last_stage, paused)
            else:
                for bucket, is_last in iter_buckets(named_tensors, self.bucket_bytes):
                    paused()
                    self._send_bucket_colocated(bucket, weight_version if (is_last and is_last_stage) else None)
                    total += sum(t.numel() * t.element_size() for _, t in bucket)
                    count += len(bucket)
                    buckets += 1
            paused()
        except EngineLostError as exc:
            lost = dict(exc.lost)
            if self.mode == "distributed":  # survivors stuck in the aborted group are lost too
                lost.update(self.abort_group(list(lost)))
            if pausing is not None:  # the survivors' session is closed, the lost are skipped
                pause_error = pausing.exception(self.timeout_s)
                if isinstance(pause_error, EngineLostError):
                    lost.update(pause_error.lost)
                self.continue_engines(skip=list(lost))
                pausing = None
            if lost != exc.lost:
                raise EngineLostError(lost, exc.others) from exc
            raise
        finally:
            # continue only engines this sync paused (a failed pause leaves them as they are)
            if pausing is not None and pausing.exception(self.timeout_s) is None:
                self.continue_engines()
        return SyncStats(time.perf_counter() - start, total, count, buckets)

    def _sync_distributed(self, named_tensors, weight_version: Optional[str], is_last_stage: bool,
                          paused: Callable[[], None]) -> Tuple[int, int, int]:
        """Buckets through the group, pipelined: bucket k is produced (the stream's gathers
        and conversions) and flattened into one of two buffers while bucket k-1 is still
        being broadcast. Bucket k's POST goes out only once broadcast k-1 has completed, so
        every engine has already taken request k-1 and serves k after it (SGLang queues its
        update requests in arrival order; a POST sent earlier could overtake it). Before
        POSTing bucket k, the reply to bucket k-2 is awaited: at most two buckets are being
        received or loaded by an engine at once. `paused()` returns once the engines are
        paused (called before each POST). Returns (bytes, tensors, buckets)."""
        if self.group is None:
            raise WeightSyncError("call init_group() before sync() in distributed mode")
        total, count, index = 0, 0, 0
        inflight: Optional[_Broadcast] = None
        replies: List[Future] = []  # the POSTs of buckets already broadcast
        for bucket, is_last in iter_buckets(named_tensors, self.bucket_bytes):
            flat = self._flatten(bucket, slot=index % 2)  # overlaps the broadcast in flight
            if inflight is not None:
                self._finish(inflight)
            while len(replies) > 1:
                replies.pop(0).settle(self.timeout_s)
            version = weight_version if (is_last and is_last_stage) else None
            paused()
            inflight = self._start(bucket, flat, version)
            replies.append(inflight)
            total += flat.numel()
            count += len(bucket)
            index += 1
        if inflight is not None:
            self._finish(inflight)
        for reply in replies:
            reply.settle(self.timeout_s)
        return total, count, index

    def post_tensor_payloads(self, payloads: List[str], load_format: Optional[str],
                             weight_version: Optional[str]) -> None:
        """One `/update_weights_from_tensor` to every engine of this syncer: `payloads[r]`
        is what engine TP rank r loads (weights.handover builds them per rank)."""
        self._io.run(self._all(lambda c: c.update_weights_from_tensor(
            payloads, load_format=load_format, weight_version=weight_version, flush_cache=False)),
            timeout=self.timeout_s)

    def _flatten(self, bucket, slot: int) -> torch.Tensor:
        """The bucket's bytes in flat buffer `slot` (0 or 1, reused: no page faults per
        bucket), on the parameters' device (NCCL broadcasts GPU tensors; SGLang receives on
        its own device)."""
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        device = bucket[0][1].device if self.backend == "nccl" else torch.device("cpu")  # gloo: the host's copy
        buf = self._flats[slot]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._flats[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return transport.flatten_bucket([t.to(device) for _, t in bucket], out=buf)

    def _start(self, bucket, flat: torch.Tensor, version: Optional[str]) -> "_Broadcast":
        """POST the bucket's names/dtypes/shapes to every engine and start its broadcast."""
        names = [n for n, _ in bucket]
        dtypes = [transport.dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        posts = {c.url: self._io.submit(c.update_weights_from_distributed(
            names, dtypes, shapes, group_name=self.group_name, weight_version=version,
            load_format=FLATTENED_BUCKET, flush_cache=False, timeout_s=self.timeout_s)) for c in self.clients}
        work = torch.distributed.broadcast(flat, src=0, group=self.group, async_op=True)
        return _Broadcast(work, posts, names[0], names[-1])

    def _finish(self, b: "_Broadcast") -> None:
        """Wait for a broadcast to complete, watching each engine's reply to its POST: a 400
        (bad name/shape) arrives before the engine joins the broadcast, and an engine that
        is gone (its POST's connection fails: the process exited) never joins it. Either is
        raised at once (`EngineLostError` for the second) instead of blocking in work.wait()
        until the group times out. A broadcast that fails (gloo sees a member's socket close)
        is put down to the engines whose POST failed, once they answered (bounded)."""
        deadline = time.monotonic() + self.timeout_s
        while not b.work.is_completed():
            failed = {u: f.exception() for u, f in b.posts.items() if f.done() and f.exception() is not None}
            if failed:
                try:
                    raise_for_engines(failed)
                except EngineLostError:
                    raise
                except WeightSyncError as exc:
                    raise WeightSyncError(f"engine refused bucket {b.first}..{b.last}: {exc}; destroy and "
                                          "re-create the weight-update group before retrying") from None
            if time.monotonic() > deadline:
                raise WeightSyncError(f"broadcast of bucket {b.first}.. timed out after {self.timeout_s} s")
            time.sleep(0.001)
        try:
            b.work.wait()
        except Exception as exc:
            b.settle(min(self.timeout_s, SURVIVOR_WAIT_S))  # raises EngineLostError when one is gone
            raise WeightSyncError(f"broadcast of bucket {b.first}..{b.last} failed: {exc}") from exc

    def _send_bucket_colocated(self, bucket, version: Optional[str]) -> None:
        if bucket[0][1].is_cuda and self.cpu_tensor_format == "sglang":
            # SGLang's TP rank r reads payload r, handles to memory on its own GPU: one
            # process can only serve a TP-1 engine on its own GPU; the rest goes through
            # weights.handover (the learner rank on each engine GPU makes that rank's payload)
            if self.engine_tp_size != 1:
                raise WeightSyncError(f"colocated CUDA sync into engines of TP {self.engine_tp_size} needs one "
                                      "payload per engine TP rank: use weights.handover")
            # one pickle per engine: an IPC pickle read by two processes breaks the sender's
            # reference counting (SGLang tp_worker `deserialize_own_rank`)
            payloads = {c.url: transport.build_tp_payloads([bucket], [bucket[0][1].device],
                                                           transport.serialize_cuda_ipc) for c in self.clients}
            self._io.run(self._all(lambda c: c.update_weights_from_tensor(
                payloads[c.url], load_format=None, weight_version=version, flush_cache=False)),
                timeout=self.timeout_s)
            return
        if self.cpu_tensor_format == "sglang":
            # SGLang's MultiprocessingSerializer format; between unrelated processes CPU
            # storages must travel as files (the default fd strategy fails and takes the
            # scheduler down). The tensors stay alive here until every engine has loaded them.
            # One pickle per receiving process (engine x TP rank): pickling a storage gives it
            # one reference that its unpickler takes over and drops; one payload read by two
            # processes drops the sender's own, the file is unlinked, and the next sync of the
            # same storage fails in the engine ("unable to open shared memory object").
            torch.multiprocessing.set_sharing_strategy("file_system")
            named = [(n, t.detach().cpu().contiguous()) for n, t in bucket]
            payloads = {c.url: [transport.serialize_cuda_ipc(named) for _ in range(self.engine_tp_size)]
                        for c in self.clients}
            self._io.run(self._all(lambda c: c.update_weights_from_tensor(
                payloads[c.url], load_format=None, weight_version=version, flush_cache=False)),
                timeout=self.timeout_s)
            return
        handle = transport.write_shm_bucket([(n, t.detach().cpu()) for n, t in bucket])
        try:
            payload = [base64.b64encode(json.dumps(handle).encode()).decode()]
            self._io.run(self._all(lambda c: c.update_weights_from_tensor(
                payload, load_format=SHM_LOAD_FORMAT, weight_version=version, flush_cache=False)),
                timeout=self.timeout_s)
        finally:
            transport.remove_shm_bucket(handle)


def run_stages_in_turn(num_stages: int, my_stage: int, send: Callable[[], T],
                       barrier: Callable[[], None]) -> Optional[T]:
    """Pipeline stages send their weights one after the other: stage s calls `send` while
    the others wait, and `barrier` (every learner rank) closes each turn.

    Why: each engine serves update requests in arrival order, and every stage's source
    broadcasts on its own group; if two stages sent at once, engine A could enter stage 0's
    broadcast while engine B entered stage 1's, and each broadcast would wait for the
    engine stuck in the other one, forever. `send` returns only after every engine
    answered every bucket of the stage (`WeightSyncer.sync` waits for all replies), so
    after the barrier no engine is still inside stage s. Returns this rank's `send()`
    result (None on ranks of no stage that sent).
    """
    result: Optional[T] = None
    for stage in range(num_stages):
        if stage == my_stage:
            result = send()
        barrier()
    return result


def sync_learner_weights(syncer: WeightSyncer, model_chunks, info, layout, weight_version: str,
                         checksums: Optional[Dict[str, str]] = None,
                         held_as: Optional[HeldAs] = None) -> Optional[SyncStats]:
    """Sync a Megatron learner: every TP rank of DP rank 0 (every rank at EP > 1:
    `layout.drains_weights`) drains `iter_megatron_to_hf`
    (its TP gathers are collective); only each stage's weight source sends, and the
    stages take turns (`run_stages_in_turn`). `checksums` (a dict): each weight source keeps
    there the checksum of every tensor it sent, as an engine holding them as `held_as` (dtype,
    layout, hash kernel) will report it (`wire.checksum`).

    An engine lost before or during the sync (`EngineLostError` on the rank that saw it)
    raises `EngineLostError` on every rank, with every rank's lost engines, once the
    survivors continue: the caller drops them and syncs again (`PolicySync.push`).

    Pausing / continuing is done here by the global rank 0 around a barrier on the
    default group so that every stage streams into paused engines.
    """
    from dapo_mega.weights.stream import iter_megatron_to_hf
    from dapo_mega.wire.checksum import record_checksums

    dist = torch.distributed
    is_rank0 = dist.get_rank() == 0
    lost: Dict[str, str] = {}
    if is_rank0:
        try:
            syncer.pause_engines()
        except EngineLostError as exc:  # gone since the last sync (killed while the learner trained)
            lost.update(exc.lost)
    lost = agree_on_lost(lost)

    def send() -> Tuple[Optional[SyncStats], Dict[str, str]]:
        if not layout.drains_weights or lost:
            return None, {}
        stream = iter_megatron_to_hf(model_chunks, info, layout)
        if layout.is_weight_source:
            if checksums is not None:
                stream = record_checksums(stream, checksums, held_as or HeldAs())
            try:
                return syncer.sync(stream, weight_version, is_last_stage=layout.is_last_stage, pause=False), {}
            except EngineLostError as exc:
                for _ in stream:  # the stage's other TP ranks still gather: drain with them
                    pass
                return None, exc.lost
        for _ in stream:
            pass
        return None, {}

    try:
        # the last turn's barrier is the one every rank passes before generation continues
        stats, mine = run_stages_in_turn(layout.pp, layout.pp_rank, send, dist.barrier) or (None, {})
        lost = {**lost, **agree_on_lost(mine)}
    except BaseException:
        dist.barrier()
        raise
    finally:
        if is_rank0:
            syncer.continue_engines(skip=list(lost))
    if lost:
        raise EngineLostError(lost)
    return stats


def agree_on_lost(mine: Dict[str, str]) -> Dict[str, str]:
    """Every learner rank's lost engines, merged, on every rank (collective)."""
    from dapo_mega.distributed import merge_dicts

    return merge_dicts(mine)