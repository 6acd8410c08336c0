"""Colocated weight sync: tensors handed over on each GPU, never a NCCL group with the engines.

A colocated engine shares its GPUs with learner ranks, and NCCL refuses two ranks of one
group on one device ("Duplicate GPU detected"), so the distributed path (a weight-update
group of the source rank and the engine ranks) cannot be used. Instead, as slime does:

    for each pipeline stage s, in turn (stage s+1 starts when s finished on every engine):
        the stage's TP ranks of DP rank 0 drain `iter_megatron_to_hf` and cut the same
        buckets; for each bucket
          1. the stage's source rank broadcasts the bucket's metadata, then its flattened
             bytes, over the learners' own group (every learner rank on its own GPU) into a
             buffer on each rank's device;
          2. the learner rank on the GPU of engine e's TP rank r (`placement.EnginePlacement
             .ipc_ranks[r]`) makes rank r's payload from views of that buffer: CUDA IPC
             handles to memory on that very GPU (`transport.serialize_cuda_ipc`, torch's
             reductions patched to name the GPU by UUID), or on a CPU a shared-memory file;
          3. the payloads are gathered, and each engine's poster (`ipc_ranks[0]`) sends them
             as ONE `/update_weights_from_tensor` request, payload r for TP rank r;
          4. a barrier: every engine has copied the bucket, so buffers and files may go.
        The last bucket of the last stage carries the new weight version.

`HandoverPlan.for_rank` reads this rank's part from the placement's `ipc_ranks`. Engines found
dead leave the plan (`drop`) and come back when they answer again (`readmit`): payloads are
made for live engines only, since a CUDA IPC payload nobody unpickles keeps its block in
torch's IPC limbo (the sender's reference count stays at 1). A dropped engine that still holds
its GPU memory (hung, not gone) stops the run, named (`require_dropped_engines_released`):
the learner's step would run out of memory on its GPUs.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from dapo_mega.weights.sync import (
    SHM_LOAD_FORMAT,
    EngineLostError,
    SyncStats,
    WeightSyncer,
    WeightSyncError,
    iter_buckets,
)
from dapo_mega.wire import transport

#: (payload text, cleanup) for one engine TP rank, made from named views of the bucket buffer.
PayloadMaker = Callable[[List[Tuple[str, torch.Tensor]]], Tuple[str, Callable[[], None]]]


@dataclass
class HandoverPlan:
    """This learner rank's part in the hand-over (see the module docstring)."""

    rank: int
    ipc_ranks: Dict[int, Tuple[int, ...]]
    """Engine index -> the learner rank on each of its TP ranks' GPUs (placement)."""
    holds: List[Tuple[int, int]] = field(default_factory=list)
    """(engine, engine TP rank) whose GPU this rank shares: it makes their payloads."""
    posts: List[int] = field(default_factory=list)
    """Engines whose request this rank sends (it holds their TP rank 0)."""
    dropped: Set[int] = field(default_factory=set)
    """Engines found dead: no payloads are made for them until they are readmitted."""

    def drop(self, engines: Sequence[int]) -> None:
        """Engines found dead leave the hand-over (the same on every rank)."""
        self.dropped.update(engines)

    def readmit(self, engines: Sequence[int]) -> None:
        """Dropped engines answering again take part from the next sync on."""
        self.dropped.difference_update(engines)

    def live_posts(self) -> List[int]:
        """Engines whose request this rank sends, but those dropped."""
        return [e for e in self.posts if e not in self.dropped]

    @classmethod
    def for_rank(cls, rank: int, ipc_ranks: Mapping[int, Sequence[int]]) -> "HandoverPlan":
        plan = cls(rank, {e: tuple(r) for e, r in ipc_ranks.items()})
        for engine, ranks in sorted(plan.ipc_ranks.items()):
            if not ranks:
                raise ValueError(f"engine {engine} has no learner rank on its GPUs: it cannot be colocated")
            plan.holds += [(engine, tp_rank) for tp_rank, r in enumerate(ranks) if r == rank]
            if ranks[0] == rank:
                plan.posts.append(engine)
        return plan

    def make_payloads(self, views: List[Tuple[str, torch.Tensor]], make_payload: PayloadMaker
                      ) -> Tuple[Dict[Tuple[int, int], str], List[Callable[[], None]]]:
        """This rank's payloads, {(engine, engine TP rank): payload}, and their cleanups: one
        payload made for each receiving process, never one shared (a CUDA IPC pickle read by
        two processes breaks the sender's reference counting, as SGLang's tp_worker says)."""
        payloads, cleanups = {}, []
        for engine, tp_rank in self.holds:
            if engine in self.dropped:  # nobody would unpickle it: its CUDA block would stay in IPC limbo
                continue
            payloads[(engine, tp_rank)], cleanup = make_payload(views)
            cleanups.append(cleanup)
        return payloads, cleanups

    def request_payloads(self, gathered: Sequence[Mapping[Tuple[int, int], str]], engine: int) -> List[str]:
        """Engine `engine`'s `serialized_named_tensors` from every rank's `make_payloads`
        (`gathered[rank]`): payload r was made by the learner rank on TP rank r's GPU."""
        return [gathered[rank][(engine, tp_rank)] for tp_rank, rank in enumerate(self.ipc_ranks[engine])]


def cuda_ipc_payload(views: List[Tuple[str, torch.Tensor]]) -> Tuple[str, Callable[[], None]]:
    """GPU: IPC handles to the views (on this rank's GPU), SGLang's pickled format."""
    return transport.serialize_cuda_ipc(views), lambda: None


def shared_memory_payload(views: List[Tuple[str, torch.Tensor]]) -> Tuple[str, Callable[[], None]]:
    """CPU: the bucket in a shared-memory file; the JSON handle is the payload."""
    handle = transport.write_shm_bucket(views)
    return base64.b64encode(json.dumps(handle).encode()).decode(), lambda: transport.remove_shm_bucket(handle)


def drop_dead_posters(posters: Dict[int, WeightSyncer], dead_urls: Sequence[str]) -> List[str]:
    """Engines found dead leave the hand-over: their posters are removed from `posters` (so
    `handover_learner_weights` posts to the others only). Returns the URLs dropped."""
    wanted = {u.rstrip("/") for u in dead_urls}
    dropped: List[str] = []
    for engine, poster in list(posters.items()):
        gone = [url for url in poster.engine_urls if url in wanted]
        if not gone:
            continue
        dropped += gone
        if len(gone) == len(poster.engine_urls):  # a poster holds one engine: it goes
            del posters[engine]
            poster.close()
        else:
            poster.drop_engines(gone)
    return dropped


GONE, RELEASED, HUNG = "gone", "released", "hung"
"""What became of a dropped colocated engine's memory (`probe_dropped_engine`)."""


class HungEngineError(RuntimeError):
    """A colocated engine found dead still holds its GPU memory: the run cannot go on."""


def require_dropped_engines_released(states: Mapping[str, str], gpus: Mapping[str, Sequence[int]]) -> None:
    """Colocated on GPUs: every engine dropped as dead must have given its memory back, its
    process gone (CUDA frees a process's memory when it exits) or its memory released on
    request. An engine that answers neither (hung) keeps the weights and KV cache it holds on
    its GPUs, and the learner's step there would run out of memory: raise naming it."""
    hung = [url for url, state in states.items() if state == HUNG]
    if hung:
        named = "; ".join(f"{url} (GPUs {list(gpus.get(url, ()))})" for url in hung)
        raise HungEngineError(f"colocated engine(s) {named} stopped answering but still hold their GPU memory "
                              "(neither exited nor released it on request): the learner's step would run out of "
                              "memory on those GPUs, so the run stops. Fix: kill the engine's processes (under "
                              "Slurm the engines role restarts it) and resume the run from its last checkpoint")


def probe_dropped_engine(endpoint, timeout_s: float, released: bool = False) -> str:
    """GONE when nothing listens at the engine's address any more (its process exited, and
    its memory with it), RELEASED when it releases its memory on request within `timeout_s`
    or had released it already (`released`, the driver's ledger: it is not asked twice,
    torch_memory_saver would end it), else HUNG (it accepts the connection and answers
    nothing: stopped, deadlocked)."""
    import asyncio
    import socket
    from urllib.parse import urlsplit

    from dapo_mega.engines.sglang.client import EngineClient

    parts = urlsplit(endpoint.url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return GONE
    except OSError:
        return HUNG
    if released:
        return RELEASED

    async def release() -> None:
        async with EngineClient(endpoint) as client:
            await asyncio.wait_for(client.release_memory_occupation(), timeout_s)
    try:
        asyncio.run(release())
        return RELEASED
    except Exception:  # noqa: BLE001 - a timeout or a refusal: it keeps its memory
        return HUNG


def handover_learner_weights(posters: Mapping[int, WeightSyncer], model_chunks, info, layout, weight_version: str,
                             plan: HandoverPlan, bucket_bytes: int, make_payload: PayloadMaker,
                             load_format: Optional[str], device: torch.device) -> Optional[SyncStats]:
    """Every learner rank calls this (see the module docstring); `posters[e]` is a
    WeightSyncer holding engine e, on the ranks in `plan.posts`. Pausing, flushing and the
    engines' update session are the caller's (around this call, on the driver rank).
    Returns the stats on each stage's source rank, else None."""
    from dapo_mega.weights.stream import iter_megatron_to_hf

    dist = torch.distributed
    stats = None
    for stage in range(layout.pp):
        source = layout.stage_source_rank(stage)
        drains = layout.pp_rank == stage and layout.drains_weights
        buckets = iter_buckets(iter_megatron_to_hf(model_chunks, info, layout), bucket_bytes) if drains else None
        start, total, count, num = time.perf_counter(), 0, 0, 0
        while True:
            # the stage's TP ranks advance together (their TP gathers are collective)
            item = next(buckets, None) if buckets is not None else None
            meta = [None]
            if dist.get_rank() == source and item is not None:
                bucket, is_last = item
                meta = [([n for n, _ in bucket], [transport.dtype_name(t.dtype) for _, t in bucket],
                         [list(t.shape) for _, t in bucket], is_last)]
            dist.broadcast_object_list(meta, src=source)
            if meta[0] is None:
                break
            names, dtypes, shapes, is_last = meta[0]
            metas, nbytes = transport.bucket_layout(names, [transport.parse_dtype(d) for d in dtypes], shapes)
            if dist.get_rank() == source:
                flat = transport.flatten_bucket([t for _, t in item[0]]).to(device)
            else:
                flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dist.broadcast(flat, src=source)
            views = transport.unflatten_bucket(flat, metas)
            mine, cleanups = plan.make_payloads(views, make_payload)
            gathered: List[Optional[dict]] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            version = weight_version if (is_last and stage == layout.pp - 1) else None
            error = None
            try:
                for engine in [e for e in plan.live_posts() if e in posters]:  # not those dropped as dead
                    posters[engine].post_tensor_payloads(plan.request_payloads(gathered, engine), load_format,
                                                         version)
            except Exception as exc:  # every rank must learn of it, or the others wait in the next bucket
                error = failure_of(exc, f"rank {dist.get_rank()}: ")
            # doubles as the barrier after which every engine has copied the bucket
            errors: List[Optional[Failure]] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            for cleanup in cleanups:
                cleanup()
            raise_failures(errors, "colocated weight hand-over failed")
            total += nbytes
            count += len(names)
            num += 1
        if dist.get_rank() == source:
            stats = SyncStats(time.perf_counter() - start, total, count, num)
        dist.barrier()  # stage s finished on every engine before stage s+1 starts
    return stats


def sync_colocated_learner_weights(driver: Optional[WeightSyncer], posters: Mapping[int, WeightSyncer], model_chunks,
                                   info, layout, weight_version: str, plan: HandoverPlan, bucket_bytes: int,
                                   device: torch.device) -> Optional[SyncStats]:
    """`handover_learner_weights` between the driver rank's pause (and flush) of every engine
    and its continue, as `sync.sync_learner_weights` does for the distributed path. CUDA
    IPC payloads on GPUs, shared-memory files on a CPU. The driver's pause and continue end
    the same way on every rank: an engine lost there is an `EngineLostError` everywhere (the
    caller's `push` drops it and syncs again), never rank 0 alone raising while the others
    wait in the next collective."""
    driving = torch.distributed.get_rank() == 0 and driver is not None
    on_every_rank(driver.pause_engines if driving else None, "pausing the engines")
    cuda = device.type == "cuda"
    try:
        return handover_learner_weights(posters, model_chunks, info, layout, weight_version, plan, bucket_bytes,
                                        cuda_ipc_payload if cuda else shared_memory_payload,
                                        None if cuda else SHM_LOAD_FORMAT, device)
    finally:
        on_every_rank(driver.continue_engines if driving else None, "continuing the engines")


Failure = Tuple[str, Dict[str, str], List[str]]
"""A rank's failure as every rank can raise it: (message, engines lost: url -> why, other errors)."""


def failure_of(exc: BaseException, prefix: str = "") -> Failure:
    if isinstance(exc, EngineLostError):
        return prefix + str(exc), dict(exc.lost), [prefix + o for o in exc.others]
    return prefix + str(exc), {}, [prefix + str(exc)]


def raise_failures(failures: Sequence[Optional[Failure]], what: str) -> None:
    """Raise the ranks' failures, the same on every rank: `EngineLostError` when engines were
    lost (the errors of engines still there ride along, as `others`), else `WeightSyncError`."""
    failures = [f for f in failures if f]
    if not failures:
        return
    lost = {url: why for _, gone, _ in failures for url, why in gone.items()}
    others = [o for _, _, rest in failures for o in rest]
    if lost:
        raise EngineLostError(lost, others)
    raise WeightSyncError(f"{what}: " + "; ".join(message for message, _, _ in failures))


def on_every_rank(call: Optional[Callable[[], object]], what: str) -> None:
    """`call()` where given (the driver rank), then its outcome on every rank (collective)."""
    failure = None
    if call is not None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            failure = failure_of(exc)
    shared = [failure]
    torch.distributed.broadcast_object_list(shared, src=0)
    raise_failures(shared, what)
