"""The engine fleet: the one place rollout engines are started, attached to, health-checked,
killed and restarted.

    fleet = EngineFleet(cfg.rollout, model_path, log_dir, device=cfg.cluster.device)
    endpoints = fleet.start(2)   # or EngineFleet.attach(urls, cfg.rollout), .from_registry(dir, cfg.rollout)

An engine is the embedded CPU engine or `sglang.launch_server`, with the argv of
`engines.sglang.commands.build_engine_command`, run by `rollout.engine_python`. The fleet adds
what each kind needs: `CUDA_VISIBLE_DEVICES` from the GPU ids it is given (it never chooses
devices; the placement gives them, `start_on_this_node` for a command's own node),
`--base-gpu-id`, and without a GPU `--device cpu`, `SGLANG_USE_CPU_ENGINE=1` and a KV pool sized
to the run (`cpu_pool_tokens`) for SGLang, threads for the embedded engine. Each engine writes
`engine-<i>.log`; one that dies before it is healthy raises `EngineStartError` quoting its tail.
Every engine starts tethered (`dapo_mega/tether.py`), so a crashed trainer leaves no engine
holding its port or GPU. SGLang's `/health` runs a one-token generation and sleeps 1 s
(`HEALTH_PROBE_TIMEOUT_S`); an answer counts only from the engine's own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from dapo_mega import log
from dapo_mega.config import DapoConfig, EngineKind, RolloutConfig
from dapo_mega.engines.process import (
    BIND_FAILED,
    EngineProcess,
    EngineStartError,
    announce_engine,
    announce_learners_ready,
    free_port,
    is_healthy,
    lost_port_race,
    resume_process,
    stop_process,
    wait_for_learners,
)
from dapo_mega.engines.sglang.commands import (
    ROUTED_EXPERTS_FLAG,
    build_engine_command,
    cpu_pool_tokens,
    cpu_server_args,
    cpu_threads_per_engine,
    model_context_tokens,
    reports_routed_experts,
)
from dapo_mega.engines.sglang.endpoint import EngineEndpoint, endpoint_of
from dapo_mega.engines.sglang.server_info import REGISTRY_ROUTED_EXPERTS, server_reports_routed_experts
from dapo_mega.tether import popen_tethered

logger = log.get(__name__)

__all__ = ["EngineEndpoint", "EngineFleet", "EngineProcess", "EngineStartError", "announce_engine", "endpoint_of",
           "free_port", "is_healthy", "open_fleet", "stop_process", "announce_learners_ready", "wait_for_learners",
           "REGISTRY_ROUTED_EXPERTS", "server_reports_routed_experts"]

MAX_PORT_RETRIES = 3
"""Restarts of an engine whose free port was taken between picking it and binding it."""

CPU_SGLANG_MALLOC_TUNABLE = "glibc.malloc.hugetlb=1"
"""glibc (2.35+) asks for transparent huge pages on the memory it maps (madvise mode); older
glibc ignores the tunable."""

DEFAULT_START_TIMEOUT_S = 300.0
"""Engine start bound when neither rollout.health_timeout_s nor a derived one is given (the
tiny engines of tests and tools; `open_fleet` derives the run's from its model and engines)."""


def open_fleet(cfg: DapoConfig, model_path: str, log_dir: Path, weight_version: str = "0",
               learner_ranks: int = 1, start_timeout_s: float = 0.0) -> "EngineFleet":
    """The run's engines: `rollout.engine_urls` attached, or those announced in
    `rollout.engine_registry`, or else `rollout.num_engines` started here serving `model_path`,
    each on its own GPUs from the placement (`backends.placement.trainer_placement`; the
    trainer's `learner_ranks` hold the first GPUs when disaggregated on one node).
    `start_timeout_s`: the engines' start bound when rollout.health_timeout_s is 0 (the
    caller derives it: `dapo_mega.plan.clock.resolve_health_timeout_s`)."""
    from dapo_mega.backends.placement import trainer_placement

    r = cfg.rollout
    if r.engine_urls:
        return EngineFleet.attach(r.engine_urls, r, start_timeout_s)
    if r.engine_registry:
        if cfg.cluster.mode == "colocated":  # the launcher's engines start once the learners hold their memory
            announce_learners_ready(Path(r.engine_registry))
        return EngineFleet.from_registry(Path(r.engine_registry), r, start_timeout_s=start_timeout_s)
    fleet = EngineFleet(r, model_path, log_dir, device=cfg.cluster.device, weight_version=weight_version,
                        memory_saver=cfg.cluster.mode == "colocated", start_timeout_s=start_timeout_s,
                        context_tokens=cfg.algo.max_prompt_length + cfg.algo.max_response_length)
    engines = trainer_placement(cfg, learner_ranks, fleet.on_gpu(), {}).engines if fleet.on_gpu() else ()
    fleet.start(gpu_ids=[list(e.gpu_ids) for e in engines], base_gpu_ids=[e.base_gpu_id for e in engines])
    return fleet


class EngineFleet:
    """Engines of one run: started here, or attached to by URL or through a registry."""

    def __init__(self, rollout: RolloutConfig, model_path: str = "", log_dir: Optional[Path] = None, *,
                 device: str = "auto", bind_host: str = "", advertise_host: str = "", num_threads: int = 0,
                 weight_version: str = "0", memory_saver: bool = False,
                 extra_env: Optional[Dict[str, str]] = None, start_timeout_s: float = 0.0,
                 context_tokens: int = 0):
        """`device`: cluster.device (auto: CUDA when torch sees one). `bind_host`: where engines
        listen (default rollout.host); `advertise_host`: the host in their URLs (default the bind
        host). `num_threads`: CPU threads per embedded engine (0: this machine's CPUs shared).
        `memory_saver`: `--enable-memory-saver` (colocated engines release memory in training).
        `start_timeout_s`: the derived start bound, used when rollout.health_timeout_s is 0.
        `context_tokens`: the longest request (prompt + response) the run sends; it sizes an SGLang
        CPU engine's KV pool (`cpu_kv_tokens`; 0: the model's context length)."""
        self.rollout = rollout
        self.start_timeout_s = rollout.health_timeout_s or start_timeout_s or DEFAULT_START_TIMEOUT_S
        """Bounds each engine's start until its first healthy answer (weights read, graphs captured)."""
        self.model_path = str(model_path)
        self.log_dir = Path(log_dir) if log_dir else None  # None: a temporary directory at first start
        self.device = device
        self.bind_host = bind_host or rollout.host
        self.advertise_host = advertise_host or self.bind_host
        self.num_threads = num_threads
        self.weight_version = str(weight_version)
        self.memory_saver = memory_saver
        self.context_tokens = context_tokens
        self.extra_env = dict(extra_env or {})
        self.python = rollout.engine_python or sys.executable
        self.engines: List[EngineProcess] = []
        self.attached: List[EngineEndpoint] = []
        self.attached_routed_experts: List[bool] = []
        """Per attached engine: started with --enable-return-routed-experts (`attach`)."""

    # ---------------------------------------------------------------- attach
    def endpoint(self, url: str) -> EngineEndpoint:
        return endpoint_of(url, self.rollout)

    @classmethod
    def attach(cls, urls: Sequence[str], rollout: RolloutConfig, start_timeout_s: float = 0.0,
               routed_experts: Sequence[Optional[bool]] = ()) -> "EngineFleet":
        """Engines someone else started; waits until each answers /health. `routed_experts[i]`:
        whether engine i was started with --enable-return-routed-experts, as its registry record
        says; where not given (None, or attached by URL) its /server_info is asked
        (`server_reports_routed_experts`)."""
        fleet = cls(rollout, start_timeout_s=start_timeout_s)
        fleet.attached = [fleet.endpoint(u) for u in urls]
        fleet.wait_attached()
        known = list(routed_experts) + [None] * (len(urls) - len(routed_experts))
        fleet.attached_routed_experts = [bool(k) if k is not None else bool(server_reports_routed_experts(e))
                                         for k, e in zip(known, fleet.attached)]
        if len(set(fleet.attached_routed_experts)) > 1:
            without = [e.url for e, on in zip(fleet.attached, fleet.attached_routed_experts) if not on]
            logger.warning(f"[fleet] engines {without} were started without {ROUTED_EXPERTS_FLAG}: their samples "
                           "carry no routed experts (the learner routes those by itself)")
        return fleet

    @classmethod
    def from_registry(cls, directory: Path, rollout: RolloutConfig, count: int = 0,
                      start_timeout_s: float = 0.0) -> "EngineFleet":
        """The first `count` (default rollout.num_engines) engines announced as `engine-<i>.json`
        files in `directory` (by the Slurm engines role: `launch.run_engines`), once each is
        healthy; whether each reports routed experts is its record's `REGISTRY_ROUTED_EXPERTS`."""
        count = count or rollout.num_engines
        directory = Path(directory)
        limit = rollout.health_timeout_s or start_timeout_s or DEFAULT_START_TIMEOUT_S
        deadline = time.monotonic() + limit
        while True:
            files = sorted(directory.glob("engine-*.json"), key=lambda p: int(p.stem.split("-")[1])) \
                if directory.exists() else []
            if len(files) >= count:
                records = [json.loads(f.read_text()) for f in files[:count]]
                return cls.attach([r["url"] for r in records], rollout, limit,
                                  routed_experts=[r.get(REGISTRY_ROUTED_EXPERTS) for r in records])
            if time.monotonic() > deadline:
                raise EngineStartError(f"rollout.engine_registry={directory}: {len(files)} of {count} engines "
                                       f"announced after {limit:.0f} s (rollout.health_timeout_s). Fix: check the engine "
                                       "role's log")
            time.sleep(0.5)

    def wait_attached(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        pending = list(self.attached)
        while pending:
            pending = [e for e in pending if not is_healthy(e)]
            if pending and time.monotonic() > deadline:
                raise EngineStartError(f"engines {[e.url for e in pending]} not healthy after "
                                       f"{self.start_timeout_s:.0f} s (rollout.health_timeout_s)")
            if pending:
                time.sleep(0.5)

    @property
    def endpoints(self) -> List[EngineEndpoint]:
        """Every engine of the fleet, started here or attached, in index order."""
        return self.attached + [e.endpoint for e in self.engines]

    # ---------------------------------------------------------------- start
    def on_gpu(self) -> bool:
        """Whether the engines run on GPUs (`placement.engine_uses_gpu`: never the embedded engine)."""
        from dapo_mega.backends.placement import engine_uses_gpu

        if self.device in ("cpu", "cuda"):
            return engine_uses_gpu(self.rollout.backend, self.device == "cuda")
        import torch

        return engine_uses_gpu(self.rollout.backend, torch.cuda.is_available())

    @property
    def returns_routed_experts(self) -> bool:
        """Whether the fleet's engines report each token's experts: those started here serve a
        mixture of experts (`reports_routed_experts`: the fleet passes the flag); attached ones,
        from a registry or by URL, were started with --enable-return-routed-experts, as their
        record or their /server_info says (any of them: one without reports none)."""
        if self.attached:
            return any(self.attached_routed_experts)
        return reports_routed_experts(self.model_path)

    def command(self, port: int, base_gpu_id: Optional[int] = None) -> List[str]:
        """argv of one engine on `port`: the shared command line plus what this machine needs."""
        r = self.rollout
        # SGLang's --enable-memory-saver imports torch_memory_saver, a CUDA library: without a GPU
        # SGLang does not start with it (release/resume still answer, there is no GPU memory to free)
        memory_saver = self.memory_saver and (r.backend != EngineKind.SGLANG or self.on_gpu())
        # an SGLang engine on a CPU: its KV pool capped at the run's need (`cpu_pool_tokens`, as the plan counts it)
        argv = build_engine_command(r, self.model_path, port, weight_version=self.weight_version,
                                    host=self.bind_host, python=self.python, memory_saver=memory_saver,
                                    base_gpu_id=base_gpu_id, routed_experts=self.returns_routed_experts,
                                    max_total_tokens=None if r.backend != EngineKind.SGLANG or self.on_gpu() else
                                    cpu_pool_tokens(r, self.context_tokens or model_context_tokens(self.model_path)))
        if r.backend == EngineKind.SGLANG:
            argv += [] if self.on_gpu() else cpu_server_args(r)
        elif "--num-threads" not in r.extra_server_args:
            argv += ["--num-threads", str(self._threads())]
        return argv

    def child_env(self, index: int, gpu_ids: Sequence[int] = (),
                  parent_env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """Variables one engine gets on top of `parent_env` (default: this process's environment)."""
        parent_env = os.environ if parent_env is None else parent_env
        env = {"DAPO_MEGA_ENGINE_INDEX": str(index), **self.extra_env}
        if gpu_ids:  # ids among the GPUs this process sees
            from dapo_mega.backends.placement import visible_devices

            env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpu_ids, parent_env.get("CUDA_VISIBLE_DEVICES"))
        elif not self.on_gpu():  # a CPU engine (the embedded one beside GPU learners) sees no GPU
            env["CUDA_VISIBLE_DEVICES"] = ""
        if self.rollout.backend == EngineKind.SGLANG:
            if not self.on_gpu():
                env["SGLANG_USE_CPU_ENGINE"] = "1"
                # SGLang receives each weight bucket into a fresh CPU tensor: on transparent huge
                # pages its first touch faults 2 MiB at a time, not 4 KiB (sync 0.42 -> 0.30 s, 378 MB)
                tunables = env.get("GLIBC_TUNABLES", parent_env.get("GLIBC_TUNABLES", ""))
                if "glibc.malloc.hugetlb" not in tunables:
                    env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, CPU_SGLANG_MALLOC_TUNABLE) if t)
        else:
            env.update(OMP_NUM_THREADS=str(self._threads()), TOKENIZERS_PARALLELISM="false")
        return env

    def _threads(self) -> int:
        return self.num_threads or cpu_threads_per_engine(os.cpu_count() or 2, self.rollout.num_engines)

    def spawn(self, index: int, gpu_ids: Sequence[int] = (), base_gpu_id: Optional[int] = None,
              port: int = 0) -> EngineProcess:
        """Start engine `index` without waiting for it (see `wait_healthy`)."""
        r = self.rollout
        port = port or (r.base_port + index if r.base_port else free_port(self.bind_host))
        argv = self.command(port, base_gpu_id)
        env = self.child_env(index, gpu_ids)
        self.log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="dapo_mega_engines_"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"engine-{index}.log"
        with open(log_path, "ab") as log:
            offset = log.tell()
            proc = popen_tethered(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
        engine = EngineProcess(index=index, endpoint=self.endpoint(f"http://{self.advertise_host}:{port}"), proc=proc,
                               log_path=log_path, argv=argv, env=env, port=port, gpu_ids=list(gpu_ids),
                               base_gpu_id=base_gpu_id, log_offset=offset)
        self.engines = sorted([e for e in self.engines if e.index != index] + [engine], key=lambda e: e.index)
        return engine

    def start(self, count: int = 0, gpu_ids: Sequence[Sequence[int]] = (),
              base_gpu_ids: Sequence[Optional[int]] = ()) -> List[EngineEndpoint]:
        """Start `count` engines (default rollout.num_engines) at once, engine i on `gpu_ids[i]`
        (and `--base-gpu-id base_gpu_ids[i]`) when given; wait until all are healthy. Kills
        them all when one fails."""
        count = count or self.rollout.num_engines
        if self.on_gpu() and len(gpu_ids) < count:
            raise ValueError(f"EngineFleet.start: {count} engines on GPUs, GPUs given for {len(gpu_ids)}; an engine "
                             "takes its GPUs from the device rule (backends.placement: place, node_engine_gpus), "
                             "never SGLang's default GPU 0. Fix: pass gpu_ids, or use start_on_this_node")
        first = len(self.engines)
        if not self.num_threads:  # this machine's CPUs shared by the embedded engines
            self.num_threads = cpu_threads_per_engine(os.cpu_count() or 2, first + count)
        try:
            started = [self.spawn(first + i, gpu_ids[i] if i < len(gpu_ids) else (),
                                  base_gpu_ids[i] if i < len(base_gpu_ids) else None) for i in range(count)]
            self.wait_healthy(started)
        except BaseException:
            self.close()
            raise
        return [e.endpoint for e in started]

    def start_on_this_node(self, who: str, count: int = 0,
                           gpus_on_node: Optional[int] = None) -> List[EngineEndpoint]:
        """Start `count` engines (default rollout.num_engines) on this node, each on its own GPUs
        by the device rule (`placement.node_engine_gpus`: engine i on GPUs [i·tp, (i+1)·tp)),
        none on the CPU: how `dapo-mega eval`, `dapo-mega audit` and the benchmarks start
        theirs. `gpus_on_node`: default the GPUs this process sees. More engines than fit
        raise DeviceRuleError (`who` names the command) before any starts."""
        count = count or self.rollout.num_engines
        if not self.on_gpu():
            return self.start(count)
        import dataclasses

        import torch

        from dapo_mega.backends.placement import node_engine_gpus

        gpus = torch.cuda.device_count() if gpus_on_node is None else gpus_on_node
        blocks = node_engine_gpus(dataclasses.replace(self.rollout, num_engines=count), gpus, who)
        return self.start(count, gpu_ids=[list(b) for b in blocks], base_gpu_ids=[0] * count)

    def wait_healthy(self, engines: Optional[Sequence[EngineProcess]] = None,
                     on_healthy: Optional[Callable[[EngineProcess], None]] = None) -> None:
        """Poll until each engine answers /health (`on_healthy` is called for each as it does).

        An engine that lost its free port (exited, hung after saying so, as SGLang's server can,
        or another server answers there) is restarted on a new one, MAX_PORT_RETRIES times;
        other exits: `EngineStartError`."""
        pending = {e.index for e in (engines if engines is not None else self.engines)}
        deadline = time.monotonic() + self.start_timeout_s
        while pending:
            for index in sorted(pending):
                engine = self.get(index)
                rc = engine.proc.poll()
                retry = not self.rollout.base_port and engine.port_retries < MAX_PORT_RETRIES
                tail = engine.log_tail(15) if retry else ""
                if retry and rc is None and BIND_FAILED in tail.lower() and lost_port_race(tail):
                    rc = engine.kill(grace_s=5.0) or engine.proc.poll()  # its HTTP server never bound
                if rc is not None and retry and lost_port_race(tail):
                    retries = engine.port_retries + 1
                    logger.info(f"[fleet] engine {index}: port {engine.port} was taken before it bound it; starting "
                                f"it again on another port ({retries}/{MAX_PORT_RETRIES})", extra=log.EVERY_RANK)
                    self.spawn(index, engine.gpu_ids, engine.base_gpu_id).port_retries = retries
                    continue
                if rc is not None:
                    how = f"signal {-rc}" if rc < 0 else f"code {rc}"
                    raise EngineStartError(f"engine {index} ({engine.url}) exited with {how} before becoming "
                                           f"healthy; log {engine.log_path}:\n{engine.log_tail()}")
                if engine.answers_health():  # from its own process; one that lost its port is stopped
                    pending.discard(index)
                    if on_healthy is not None:
                        on_healthy(engine)
            if pending and time.monotonic() > deadline:
                logs = ", ".join(str(self.get(i).log_path) for i in sorted(pending))
                raise EngineStartError(f"engines {sorted(pending)} not healthy after {self.start_timeout_s:.0f} s "
                                       "(rollout.health_timeout_s; raise it for large models); "
                                       f"logs: {logs}")
            if pending:
                time.sleep(0.2)

    # ---------------------------------------------------------------- stop
    def get(self, index: int) -> EngineProcess:
        return next(e for e in self.engines if e.index == index)

    def kill(self, index: int, grace_s: float = 10.0) -> None:
        self.get(index).kill(grace_s)

    def restart(self, index: int, weight_version: Optional[str] = None) -> EngineEndpoint:
        """Stop engine `index` and start it again on the same devices (and port, when it was
        fixed by rollout.base_port); returns its endpoint once healthy."""
        old = self.get(index)
        old.kill()
        if weight_version is not None:
            self.weight_version = str(weight_version)
        engine = self.spawn(index, old.gpu_ids, old.base_gpu_id)
        self.wait_healthy([engine])
        return engine.endpoint

    def dead(self) -> List[EngineProcess]:
        """Started engines whose process has exited."""
        return [e for e in self.engines if not e.alive()]

    def close(self, grace_s: float = 10.0) -> None:
        """Stop every engine this fleet started (attached engines are left alone)."""
        for engine in self.engines:
            resume_process(engine.proc)
            if engine.alive():
                engine.proc.terminate()
        deadline = time.monotonic() + grace_s
        for engine in self.engines:
            stop_process(engine.proc, max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> "EngineFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

