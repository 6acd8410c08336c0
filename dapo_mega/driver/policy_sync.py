"""Policy sync: how the learner's weights reach the engines, and the engines' memory around a step.

One `PolicySync` per learner rank, built from the placement's rule
(`backends.placement.trainer_placement`):

- colocated on GPUs: the hand-over (`weights.handover`): every rank takes part; the learner
  rank on each engine's first GPU posts that engine's CUDA-IPC payloads; the driver pauses
  and resumes the engines. Never a NCCL group holding two ranks of one device.
- colocated on a CPU (engines on this machine): shared-memory tensors through
  `/update_weights_from_tensor`, posted by the driver.
- otherwise: the weight source of each pipeline stage (DP rank 0) joins a weight-update
  group with the engines (`/init_weights_update_group`, then broadcasts per bucket).

Ranks with no part hold an empty `PolicySync`; every method is still called on every rank
because dropping dead engines and the hand-over are collective.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional
from urllib.parse import urlsplit

import torch

from dapo_mega import log
from dapo_mega.config import DapoConfig, EngineKind, is_loopback
from dapo_mega.distributed import free_port, merge_dicts
from dapo_mega.driver.roles import LearnerRankRole
from dapo_mega.engines.book import BookView

if TYPE_CHECKING:
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.backends.placement import Placement
    from dapo_mega.engines.sglang.endpoint import EngineEndpoint
    from dapo_mega.weights.handover import HandoverPlan
    from dapo_mega.weights.sync import WeightSyncer
    from dapo_mega.wire.checksum import HeldAs

logger = log.get(__name__)


class PolicySync:
    """This rank's part in pushing weights to the engines (see the module docstring)."""

    def __init__(self, cfg: DapoConfig, layout: "ParallelLayout", role: LearnerRankRole,
                 incarnations: Optional[Callable[[], Dict[str, str]]] = None):
        from dapo_mega.engines.process import engine_incarnations

        self.cfg, self.layout, self.role = cfg, layout, role
        self.incarnations = incarnations or (lambda: engine_incarnations(cfg.rollout))
        """Each engine's process (`weights/engine_memory.py`): the caller's (the driver's Session:
        the registry's records and the pids of engines it started), else the registry's."""
        self.syncer: Optional["WeightSyncer"] = None
        """WeightSyncer of this rank: the driver's (pause/resume, memory) or a stage source's."""
        self.handover: Optional["HandoverPlan"] = None
        """Colocated on GPUs: this rank's part in the hand-over (weights.handover.HandoverPlan)."""
        self.posters: Dict[int, "WeightSyncer"] = {}
        """Colocated on GPUs: engine index -> WeightSyncer on the rank that posts its payloads."""
        self.handover_endpoints: Dict[int, "EngineEndpoint"] = {}
        """Colocated on GPUs: engine index -> its endpoint (posters are made again from it)."""
        self.handover_gpus: Dict[str, List[int]] = {}
        """Colocated on GPUs: engine url -> its GPUs on its node (named when it hangs)."""
        self.grouped = False
        """Weights travel over weight-update groups (one per stage) that an engine's death re-forms."""
        self.seen = BookView()
        """The engine book as this rank last acted on it (the same on every rank: the driver's
        book, broadcast): its dead engines are out of the weight sync, its rejoining ones in it
        and serving once the next push is done."""
        self.engine_dtype: Optional[str] = None
        """The parameter dtype every engine reports (`/server_info`), None when they do not
        report one dtype: their checksums are then not compared (`held_as`)."""
        self.sent_checksums: Optional[Dict[str, str]] = None
        """The checksum of every tensor the last push sent, as the engines should hold it (every
        rank); None where the engines' checksums are not compared (`held_as`)."""

    @classmethod
    def start(cls, cfg: DapoConfig, layout: "ParallelLayout", role: LearnerRankRole, engine_urls: Optional[List[str]],
              incarnations: Optional[Callable[[], Dict[str, str]]] = None) -> "PolicySync":
        """Collective: the driver's engine URLs reach every rank, each takes its part.
        `incarnations`: each engine's process (the driver's; default: the registry's records)."""
        from dapo_mega.backends.placement import CUDA_IPC, SHARED_MEMORY, trainer_placement
        from dapo_mega.engines.fleet import endpoint_of
        from dapo_mega.weights.sync import run_stages_in_turn

        sync = cls(cfg, layout, role, incarnations)
        from dapo_mega.plan.clock import resolve_health_timeout_s

        # the driver starts the engines meanwhile: their start bound comes on top
        urls = role.broadcast(engine_urls, resolve_health_timeout_s(cfg) + cfg.cluster.driver_stall_timeout_s)
        placement = trainer_placement(cfg, layout.world_size, torch.cuda.is_available(), os.environ)
        endpoints = [endpoint_of(u, cfg.rollout) for u in urls]
        if cfg.checks.checksum:  # what the engines say they hold, not what this config would start
            sync.engine_dtype = role.broadcast(sync._engines_dtype(endpoints) if role.is_driver else None)
        if placement.transport == CUDA_IPC:
            sync._start_handover(endpoints, placement)
            return sync
        local = all(is_loopback(urlsplit(u).hostname or "") for u in urls)
        colocated = placement.transport == SHARED_MEMORY and local
        if not colocated:
            sync.grouped = True
            # the stages' groups form in turn, as their broadcasts do: each engine serves
            # /init_weights_update_group in arrival order and blocks in the rendezvous, so two
            # stages at once could enter engine A as pp0, engine B as pp1, and wait forever
            group = placement.weight_update_group(layout.pp_rank)
            backend = group.backend if group is not None else "gloo"
            run_stages_in_turn(layout.pp, layout.pp_rank,
                               lambda: sync._start_syncer(endpoints, local, colocated, backend),
                               torch.distributed.barrier)
        else:
            sync._start_syncer(endpoints, local, colocated, "gloo")
        return sync

    def _start_syncer(self, endpoints: List["EngineEndpoint"], local: bool, colocated: bool, backend: str) -> None:
        """The syncer of a stage's weight source (which joins its group with the engines), or
        of the driver (pause, resume, memory); nothing on other ranks."""
        from dapo_mega.weights.sync import WeightSyncer

        cfg, layout, role = self.cfg, self.layout, self.role
        if not ((layout.dp_rank == 0 and layout.is_weight_source) or role.is_driver):
            return
        self.syncer = WeightSyncer(endpoints, bucket_mb=cfg.rollout.weight_sync_bucket_mb,
                                   mode="colocated" if colocated else "distributed",
                                   backend=backend,  # the placement's: gloo when an engine is on the CPU
                                   # DAPO_MEGA_SYNC_ADDR: this node's Slurm NodeAddr (dapo_mega.launch);
                                   # the hostname can resolve to a loopback alias
                                   master_address="127.0.0.1" if local else (os.environ.get("DAPO_MEGA_SYNC_ADDR")
                                                                             or socket.gethostbyname(socket.gethostname())),
                                   engine_tp_size=cfg.rollout.engine_tp_size,
                                   # colocated hand-over: SGLang loads its own serializer's format,
                                   # the embedded engine only shared-memory JSON (it never unpickles)
                                   cpu_tensor_format="sglang" if cfg.rollout.backend == EngineKind.SGLANG
                                   else "shared_memory_json", incarnations=self.incarnations)
        if not colocated and layout.is_weight_source:
            self.syncer.init_group(free_port(), stage=layout.pp_rank)

    def _start_handover(self, endpoints: List["EngineEndpoint"], placement: "Placement") -> None:
        from dapo_mega.weights.handover import HandoverPlan
        from dapo_mega.weights.sync import WeightSyncer

        problems = placement.problems()
        if problems:
            raise RuntimeError("colocated placement: " + "; ".join(problems))
        self.handover = HandoverPlan.for_rank(self.layout.rank, {e.index: e.ipc_ranks for e in placement.engines})
        self.handover_endpoints = {e.index: endpoints[e.index] for e in placement.engines}
        self.handover_gpus = {endpoints[e.index].url: list(e.gpu_ids) for e in placement.engines}
        self.posters = {e: WeightSyncer([endpoints[e]], mode="colocated") for e in self.handover.posts}
        if self.role.is_driver:
            self.syncer = WeightSyncer(endpoints, mode="colocated", engine_tp_size=self.cfg.rollout.engine_tp_size,
                                       incarnations=self.incarnations)

    def drop_dead_engines(self) -> None:
        """Engines the rollout manager found dead (hung past rollout.liveness_timeout_s,
        connection refused, HTTP 5xx) leave the weight sync too, so a lost engine costs the run
        its share of generation and nothing else; dead engines that answer again come back
        (they get this push's weights, then serve). Over weight-update groups, each stage's
        source leaves its group and forms a new one with the engines now in the sync, the
        stages in turn (each engine serves /init_weights_update_group in arrival order and
        blocks in the rendezvous). Collective: every learner rank calls it, and every rank sees
        the same lists (the driver's)."""
        from dapo_mega.engines.fleet import endpoint_of
        from dapo_mega.weights.handover import drop_dead_posters
        from dapo_mega.weights.sync import run_stages_in_turn

        view = self.role.engine_changes()
        # lost and answering again before it was dropped (restarted at its address): the groups
        # it was in went with its old process, so it leaves and rejoins in this one call
        newly, back = view.changes_since(self.seen)
        self.seen = view
        dead = view.dead
        if not newly and not back:
            return
        drop_dead_posters(self.posters, newly)  # GPU hand-over: the ranks that post for them
        if self.handover is not None:
            self._handover_changes(newly, back)
        if self.syncer is not None:
            for url in self.syncer.drop_engines(newly):
                self.role.say(f"[trainer] engine {url} dropped from rollouts and weight sync: "
                              f"{dead.get(url, 'restarted since it was found dead')}", error=True)
            self.syncer.add_engines([endpoint_of(u, self.cfg.rollout) for u in back])
        if self.grouped:
            run_stages_in_turn(self.layout.pp, self.layout.pp_rank, self._rejoin, torch.distributed.barrier)

    def _handover_changes(self, newly: List[str], back: List[str]) -> None:
        """Colocated on GPUs: payloads only for live engines (`HandoverPlan.drop` / `readmit`,
        posters again for engines back); an engine dropped that still holds its GPU memory
        (hung) stops the run, named (the driver probes, every rank raises). Only engines found
        dead are probed: one restarted (in `back` too) is a new process holding its memory, and
        a release there would be its second one after the driver's for the learner's step."""
        from dapo_mega.engines.fleet import endpoint_of
        from dapo_mega.weights.handover import GONE, RELEASED, probe_dropped_engine, require_dropped_engines_released
        from dapo_mega.weights.sync import WeightSyncer

        index = {endpoint.url: e for e, endpoint in self.handover_endpoints.items()}
        self.handover.drop([index[u] for u in newly if u in index])
        self.handover.readmit([index[u] for u in back if u in index])
        for e in self.handover.live_posts():
            if e not in self.posters:
                self.posters[e] = WeightSyncer([self.handover_endpoints[e]], mode="colocated")
        probed = [u for u in newly if u not in back]
        memory = self.syncer.memory if self.syncer is not None else None  # the driver's ledger
        if memory is not None:
            memory.forget([u for u in newly if u in back])
        if probed:
            timeout = self.cfg.rollout.liveness_probe_interval_s
            states = self.role.broadcast({u: probe_dropped_engine(endpoint_of(u, self.cfg.rollout), timeout,
                                                                  released=u in memory.released)
                                          for u in probed} if self.role.is_driver else None)
            if memory is not None:
                memory.mark_released([u for u, state in states.items() if state == RELEASED and
                                      u not in memory.released], self.incarnations())
                memory.forget([u for u, state in states.items() if state == GONE])
            require_dropped_engines_released(states, self.handover_gpus)

    def _rejoin(self) -> None:
        syncer = self.syncer
        if syncer is None or syncer.group is not None or syncer.stage is None:
            return  # no group on this rank (the driver's pause/resume syncer), or still whole
        syncer.init_group(free_port(), stage=syncer.stage)
        self.role.say(f"[trainer] weight-update group of stage {syncer.stage} formed again with "
                      f"{len(syncer.clients)} engine(s): {syncer.group_name}", error=True)

    @contextmanager
    def engines_released(self) -> Iterator[None]:
        """Around the learner's step. Colocated: the engines free their memory for it (the
        driver asks them) and take it back after. On GPUs every rank first returns its cached
        blocks (the training peak stays reserved by torch's allocator otherwise, and the
        engines' resume would not fit), and all have done so before the driver asks."""
        self.drop_dead_engines()
        self.role.release_engine_memory(self.syncer)
        try:
            yield
        finally:
            if self.cfg.cluster.mode == "colocated" and torch.cuda.is_available():
                import gc

                from dapo_mega import distributed as D

                gc.collect()
                torch.cuda.empty_cache()
                D.barrier()
            self.role.resume_engine_memory(self.syncer)

    def push(self, learner: "MegatronLearner", version: int) -> Dict[str, float]:
        """Push the learner's weights into every engine as `version` (collective). An engine
        lost before or during the sync (its process gone, or restarted without the group) is
        handled like one the rollout manager found dead: dropped (its group aborted and
        formed again with the survivors), and the sync done again, at most once per engine."""
        from dapo_mega.weights.sync import EngineLostError

        held = self.held_as(mixture=learner.info.shape.is_moe)
        for _attempt in range(self.cfg.rollout.num_engines):
            self.drop_dead_engines()
            checksums: Optional[Dict[str, str]] = {} if held is not None else None
            try:
                stats = self._sync(learner, version, checksums, held)
                break
            except EngineLostError as exc:
                self.role.engines_lost(exc.lost)  # the driver's dead list: every rank drops them next
        else:
            raise RuntimeError(f"the weight sync of version {version} lost an engine on each of "
                               f"{self.cfg.rollout.num_engines} tries (rollout.num_engines); see the engines' logs")
        # every weight source's checksums, on every rank (collective)
        self.sent_checksums = merge_dicts(checksums) if held is not None else None
        self.role.engines_serve(version, self.seen.rejoining)
        metrics = stats.as_metrics() if stats is not None else {}
        if self.syncer is not None:
            metrics["sync/engines"] = len(self.syncer.clients)
        return metrics

    def synced_engine_urls(self) -> List[str]:
        """The engines the last push reached (the driver's syncer's; [] on other ranks)."""
        return [c.url for c in self.syncer.clients] if self.syncer is not None else []

    def _engines_dtype(self, endpoints: List["EngineEndpoint"]) -> Optional[str]:
        """The dtype every engine says it holds its weights in (`/server_info`, the `--dtype` it
        was started with: an engine attached by URL may hold another than this config would
        start), or None, said once, where they differ or one does not tell (`auto`)."""
        import asyncio

        from dapo_mega.engines.sglang.client import EngineClient

        async def ask(endpoint) -> str:
            try:
                async with EngineClient(endpoint) as client:
                    return str((await client.server_info()).get("dtype", ""))
            except Exception as exc:  # noqa: BLE001 - named below
                return f"no answer ({type(exc).__name__})"
        async def ask_all() -> List[str]:
            return await asyncio.gather(*(ask(e) for e in endpoints))
        dtypes = asyncio.run(ask_all())
        known = set(dtypes) <= {"float32", "bfloat16", "float16"} and len(set(dtypes)) == 1
        if not known:
            self.role.say(f"[weight check] checksums not compared: the engines report dtypes {sorted(set(dtypes))} "
                          "(/server_info), not one dtype; the probe judges every sync", error=True)
            return None
        return dtypes[0]

    def held_as(self, mixture: bool = False) -> Optional["HeldAs"]:
        """How the engines hold and hash what they are sent (`wire.checksum.HeldAs`), where
        their checksums are compared with the learner's (`checks.checksum`): embedded engines
        (HF names, SHA-256); SGLang engines of TP 1 (q/k/v and gate/up fused, SHA-256 on a CPU,
        SGLang's GPU hash on GPUs, computed on the learner's GPU: `gpu_tensor_checksum`). Not
        SGLang at TP > 1 (each rank holds its own shards), nor with `--quantization` among its
        server args (it reports dequantized weights), nor the CUDA-IPC hand-over (it sends per
        engine TP rank), nor a mixture of experts on SGLang (it fuses each layer's experts into
        `w13_weight` / `w2_weight`, which the learner's per-expert tensors do not hash to): the
        probe judges those."""
        from dapo_mega.backends.placement import engine_uses_gpu
        from dapo_mega.wire.checksum import CPU_HASH, GPU_HASH, HF, SGLANG_TP1, HeldAs
        from dapo_mega.wire.transport import ENGINE_DTYPES

        r = self.cfg.rollout
        if not self.cfg.checks.checksum or self.handover is not None or self.engine_dtype is None:
            return None
        dtype = ENGINE_DTYPES[self.engine_dtype]
        if r.backend == EngineKind.EMBEDDED:
            return HeldAs(dtype, HF, CPU_HASH)
        if mixture or r.engine_tp_size != 1 or any(a.startswith("--quantization") for a in r.extra_server_args):
            return None
        on_gpu = engine_uses_gpu(r.backend, self.cfg.cluster.device != "cpu" and torch.cuda.is_available())
        return HeldAs(dtype, SGLANG_TP1, GPU_HASH if on_gpu else CPU_HASH)

    def _sync(self, learner: "MegatronLearner", version: int, checksums: Optional[Dict[str, str]] = None,
              held_as: Optional["HeldAs"] = None):
        from dapo_mega.weights.sync import sync_learner_weights

        if self.handover is not None:
            from dapo_mega.weights.handover import sync_colocated_learner_weights

            return sync_colocated_learner_weights(
                self.syncer, self.posters, learner.model_chunks, learner.info, self.layout, str(version),
                self.handover, self.cfg.rollout.weight_sync_bucket_mb << 20,
                torch.device("cuda", torch.cuda.current_device()))
        return sync_learner_weights(self.syncer, learner.model_chunks, learner.info, self.layout, str(version),
                                    checksums, held_as)

    def close(self) -> None:
        for syncer in [self.syncer, *self.posters.values()]:
            if syncer is None:
                continue
            try:
                syncer.close()
            except Exception as exc:  # an engine already gone must not hide the real error
                logger.warning(f"[trainer] closing the weight syncer: {exc}", extra=log.EVERY_RANK)

