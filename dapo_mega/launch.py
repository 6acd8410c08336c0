"""The Python side of the Slurm scripts: decide each task's role and ranks, start it.

`slurm/colocated.sbatch` and `slurm/disaggregated.sbatch` hold the topology (nodes, tasks
per node, containers); they call this module once per role with the user's Hydra overrides:

    python -m dapo_mega.launch prepare  --mode M --engine-nodes N -- [overrides]
        one task, before the roles start: compose + validate the config, check that the
        SGLang engines' Python (`rollout.engine_python`) has SGLang, create the run
        directory and this job's log directory, clear the engine registry of the previous
        job, build the tiny model if the engines need it; prints shell assignments
        (RUN_DIR, LOG_DIR, NUM_ENGINES, RUN_COMPLETE, ...) for the sbatch script to `eval`.
        RUN_COMPLETE=1 when the latest checkpoint is already at trainer.total_steps: the
        sbatch script then exits 0 without starting any role (the tail of a job chain).
    python -m dapo_mega.launch engines  --engine-nodes N -- [overrides]
        one task per engine node: starts this node's engines through the engine fleet
        (`dapo_mega.engines.fleet`: embedded on CPU, SGLang on GPU, command lines from
        `dapo_mega.engines.sglang.commands.build_engine_command`, GPUs from the placement),
        waits for each `/health`, announces each as `<run_dir>/engines/engine-<i>.json`
        (atomically), then watches them: an engine that exits is restarted at its port and
        announced again, at most `rollout.engine_restarts` times each
        (`dapo_mega.engines.watch`); one more exit ends the task non-zero. With
        `rollout.use_router` on SGLang, the first engine node also starts sglang-router
        in front of all engines (`build_router_command`) and announces it as
        `<run_dir>/engines/router.json`.
    python -m dapo_mega.launch learner  --engine-nodes N -- [overrides]
        one task per learner GPU: sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
        MASTER_PORT from Slurm (and DAPO_MEGA_SYNC_ADDR, the address engines reach this
        node's weight source at) and execs `dapo-mega train` with the registry overrides.

Why a module of the package (there is no top-level `launch/` folder): the sbatch scripts
run it with `python -m dapo_mega.launch`, which works from any working directory and from
a container where the package is installed (not only from a source checkout).

Addresses travel through the shared run directory (engine registry) and the environment
exported by the sbatch script (MASTER_ADDR from `scontrol show hostnames` + NodeAddr,
MASTER_PORT, DAPO_MEGA_NODE_ADDRS). Teardown: every srun uses `--kill-on-bad-exit=1`, the
engines task restarts an engine that exits (bounded by rollout.engine_restarts) and exits
non-zero once one is past its restarts, and the sbatch script's wait loop stops the other
role when one role ends (slurm/lib.sh).

The router: the trainer itself spreads prompt groups over the engines and must address
every engine for the weight sync, so it always reads the `engine-<i>.json` files; the
router is for other clients of the live policy (evaluation, inspection). On the embedded
CPU backend `rollout.use_router` is ignored (logged): the engines are used directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from dapo_mega import log as logs
from dapo_mega.backends.placement import ClusterShape, engines_per_node, place
from dapo_mega.config import (
    DapoConfig,
    EngineKind,
    RolloutConfig,
    hydra_value,
    load_config,
    require_api_key,
    validate_config,
)
from dapo_mega.distributed import learner_process_env
from dapo_mega.engines.fleet import REGISTRY_ROUTED_EXPERTS, EngineFleet, wait_for_learners
from dapo_mega.engines.process import (
    EngineProcess,
    EngineStartError,
    announce_engine,
    free_port,
    is_healthy,
    log_tail,
    stop_process,
)
from dapo_mega.engines.sglang.commands import ROUTED_EXPERTS_FLAG
from dapo_mega.engines.sglang.endpoint import EngineEndpoint
from dapo_mega.engines.watch import EngineWatch

NODE_ADDRS_ENV = "DAPO_MEGA_NODE_ADDRS"
API_KEY_ENV = "DAPO_MEGA_ENGINE_API_KEY"
BIND_HOST_ENV = "DAPO_MEGA_ENGINE_BIND_HOST"
SYNC_ADDR_ENV = "DAPO_MEGA_SYNC_ADDR"
"""Address the engines reach a learner's weight-sync rendezvous at (session.py reads it)."""
ROUTER_FILE = "router.json"


# --------------------------------------------------------------------------------------
# Slurm environment → roles and ranks (pure functions, tested without Slurm)
# --------------------------------------------------------------------------------------
@dataclass
class SlurmTask:
    """What Slurm tells one task about itself (see `srun` OUTPUT ENVIRONMENT VARIABLES)."""

    job_id: str
    proc_id: int
    """SLURM_PROCID: rank of this task within its step (het step: within its component)."""
    num_tasks: int
    """SLURM_NTASKS of the step."""
    node_id: int
    """SLURM_NODEID: index of this task's node within the step's nodes."""
    num_nodes: int
    """SLURM_NNODES (SLURM_STEP_NUM_NODES) of the step."""
    local_id: int
    """SLURM_LOCALID: rank of this task on its node."""
    tasks_on_node: int
    """Tasks of this step on this node (SLURM_STEP_TASKS_PER_NODE, first entry)."""
    node_name: str
    """SLURMD_NODENAME."""


def _first_count(tasks_per_node: str) -> int:
    """'8(x16)' or '8,8' or '8' → 8: the count of the first node entry."""
    match = re.match(r"(\d+)", tasks_per_node or "")
    return int(match.group(1)) if match else 1


def read_slurm_task(env: Mapping[str, str]) -> SlurmTask:
    """Read this task's identity from a Slurm step environment; raises KeyError outside one."""
    num_tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
    num_nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    tasks_on_node = _first_count(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    if num_tasks and num_nodes and num_tasks % num_nodes == 0:
        tasks_on_node = num_tasks // num_nodes
    return SlurmTask(
        job_id=env.get("SLURM_JOB_ID", "0"),
        proc_id=int(env["SLURM_PROCID"]),
        num_tasks=num_tasks,
        node_id=int(env.get("SLURM_NODEID", 0)),
        num_nodes=num_nodes,
        local_id=int(env.get("SLURM_LOCALID", 0)),
        tasks_on_node=tasks_on_node,
        node_name=env.get("SLURMD_NODENAME", socket.gethostname()),
    )


@dataclass
class LearnerRank:
    """torch.distributed identity of one learner task (env:// rendezvous)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    def env(self) -> Dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def compute_learner_rank(task: SlurmTask, env: Mapping[str, str]) -> LearnerRank:
    """One task per learner GPU: the global rank is the task's rank within the learner step.

    MASTER_ADDR / MASTER_PORT come from the sbatch script (first learner host's NodeAddr).
    """
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise RuntimeError("MASTER_ADDR/MASTER_PORT not set: run the learner role through slurm/*.sbatch, "
                           "which exports them from `scontrol show hostnames`")
    return LearnerRank(rank=task.proc_id, world_size=task.num_tasks, local_rank=task.local_id,
                       local_world_size=task.tasks_on_node, node_rank=task.node_id,
                       master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]))


@dataclass
class EngineSlot:
    """One engine to start on this node."""

    index: int
    """Global engine index (the registry file is engine-<index>.json)."""
    gpu_ids: List[int] = field(default_factory=list)
    """Devices of this engine on its node (CUDA_VISIBLE_DEVICES); empty on CPU."""
    bind_host: str = ""
    """Address the engine listens on (`placement.EnginePlacement.bind_host`)."""
    announce_host: str = ""
    """Address written into its registry file (equal to bind_host on a one-node job)."""


def job_shape(cfg: DapoConfig, engine_nodes: int, use_gpu: bool, env: Mapping[str, str] = {}) -> ClusterShape:
    """The cluster shape of this Slurm job: its nodes (DAPO_MEGA_NODE_ADDRS, exported by
    slurm/lib.sh for every node of the job, learner nodes first) or, without it, the
    config's; colocated jobs run engines on every node."""
    names = list(parse_node_addrs(env.get(NODE_ADDRS_ENV, "")))
    if cfg.cluster.mode == "colocated":
        num_nodes = len(names) or engine_nodes
    else:
        num_nodes = len(names) or max(cfg.cluster.num_nodes, engine_nodes + 1)
    addrs = list(parse_node_addrs(env.get(NODE_ADDRS_ENV, "")).values())
    return ClusterShape.from_config(cfg, use_gpu, num_nodes=num_nodes, engine_nodes=engine_nodes, node_addrs=addrs)


def compute_engine_slots(cfg: DapoConfig, node_index: int, engine_nodes: int, use_gpu: bool,
                         env: Mapping[str, str] = {}) -> List[EngineSlot]:
    """The engines the `node_index`-th engine node (of `engine_nodes`) runs, with their
    GPUs, from the run's placement (`dapo_mega.backends.placement.place`).

    Raises when the engines of one node need more devices than the node has, or when the
    placement breaks a rule (two engines on one GPU, ...).
    """
    shape = job_shape(cfg, engine_nodes, use_gpu, env)
    per_node = engines_per_node(cfg.rollout.num_engines, engine_nodes)
    gpus = cfg.rollout.engine_tp_size * cfg.rollout.engine_dp_size
    if use_gpu and per_node * gpus > cfg.cluster.gpus_per_node:
        raise RuntimeError(f"rollout.num_engines={cfg.rollout.num_engines} over {engine_nodes} engine nodes puts "
                           f"{per_node} engines x {gpus} GPUs on one node, more than cluster.gpus_per_node="
                           f"{cfg.cluster.gpus_per_node}; lower num_engines or engine_tp_size, or add engine nodes")
    placement = place(cfg, shape)
    node = shape.first_engine_node + node_index
    problems = placement.problems()
    if problems:
        raise RuntimeError("placement of this job breaks a rule: " + "; ".join(problems))
    mine = placement.engines_on_node(node)
    return [EngineSlot(index=e.index, gpu_ids=list(e.gpu_ids), bind_host=e.bind_host, announce_host=e.announce_host)
            for e in mine]


def engine_addresses(cfg: DapoConfig, engine_nodes: int, use_gpu: bool, env: Mapping[str, str],
                     node_name: str) -> Tuple[str, str]:
    """(bind, announce) addresses of this node's engines. A one-node job binds and
    announces `rollout.host` (loopback by default: learners are on the same node);
    otherwise engines bind and announce the node's Slurm address (NodeAddr). An explicit
    DAPO_MEGA_ENGINE_BIND_HOST changes where they listen, never what a learner can reach."""
    node_addr = parse_node_addrs(env.get(NODE_ADDRS_ENV, "")).get(node_name) or socket.gethostname()
    if job_shape(cfg, engine_nodes, use_gpu, env).num_nodes == 1:
        bind_host = env.get(BIND_HOST_ENV) or cfg.rollout.host
        return bind_host, cfg.rollout.host if bind_host in ("0.0.0.0", "::") else bind_host
    return env.get(BIND_HOST_ENV) or node_addr, node_addr


def parse_node_addrs(text: str) -> Dict[str, str]:
    """'n1=10.0.0.1,n2=10.0.0.2' (exported by slurm/lib.sh) → {'n1': '10.0.0.1', ...}."""
    pairs = [item.split("=", 1) for item in text.split(",") if "=" in item]
    return {name.strip(): addr.strip() for name, addr in pairs}


# --------------------------------------------------------------------------------------
# the three roles
# --------------------------------------------------------------------------------------
_logger = logs.get(__name__)


def _log(message: str) -> None:
    """A line of this node's launcher (every node writes its own: Slurm keeps one log per task)."""
    _logger.info(f"[dapo-mega launch {time.strftime('%H:%M:%S')}] {message}", extra=logs.EVERY_RANK)


def _use_gpu(cfg: DapoConfig) -> bool:
    if cfg.cluster.device == "cpu":
        return False
    if cfg.cluster.device == "cuda":
        return True
    return cfg.rollout.backend == EngineKind.SGLANG


def registry_dir(cfg: DapoConfig) -> Path:
    """Where engines announce themselves: the configured one, else `<run_dir>/engines`."""
    return Path(cfg.rollout.engine_registry) if cfg.rollout.engine_registry else cfg.run_dir.resolve() / "engines"


def engine_model_path(cfg: DapoConfig) -> Path:
    """The checkpoint engines load at start (weights are replaced by the first sync)."""
    if cfg.rollout.model_path:
        return Path(cfg.rollout.model_path)
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    return cfg.run_dir.resolve() / "base_model"


def learner_overrides(cfg: DapoConfig, env: Mapping[str, str],
                      time_left_s: Optional[float] = None) -> List[str]:
    """Overrides appended after the user's so every rank agrees on paths and engines, and,
    when the user set no trainer.wall_time_minutes, the job's time left (`time_left_s`), so
    the trainer stops with a checkpoint before Slurm ends the job instead of losing the steps
    since its last one (each rank asks squeue; the driver's answer decides for all)."""
    out = [f"trainer.output_dir={hydra_value(str(Path(cfg.trainer.output_dir).resolve()))}",
           f"rollout.engine_registry={hydra_value(str(registry_dir(cfg)))}"]
    if env.get(API_KEY_ENV) and not cfg.rollout.api_key:
        out.append(f"rollout.api_key={hydra_value(env[API_KEY_ENV])}")
    if time_left_s and not cfg.trainer.wall_time_minutes:
        out.append(f"trainer.wall_time_minutes={time_left_s / 60.0:.2f}")
    return out


def parse_slurm_duration(text: str) -> Optional[float]:
    """Seconds of a Slurm duration, in the forms Slurm documents for --time: MM, MM:SS,
    HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (squeue's %L prints time left this way); None for
    UNLIMITED, NOT_SET, INVALID or anything else."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+(?::\d+){0,2})", text.strip())
    if not m:
        return None
    days, parts = int(m.group(1) or 0), [int(x) for x in m.group(2).split(":")]
    if m.group(1) is not None:
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:
        hours, minutes, seconds = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return float(days * 86400 + hours * 3600 + minutes * 60 + seconds)


def slurm_time_left(env: Mapping[str, str]) -> Optional[float]:
    """Seconds until Slurm ends this job (`squeue -h -j $SLURM_JOB_ID -o %L`), or None when
    not in a job, without a limit, or when squeue does not answer."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_slurm_duration(out.stdout.strip().splitlines()[0]) if out.returncode == 0 and out.stdout.strip() \
        else None


def completed_steps(cfg: DapoConfig) -> int:
    """Step of the checkpoint a resumed job would start from (0: none, or resume off)."""
    if not cfg.trainer.resume:
        return 0
    from dapo_mega.run_files.checkpoints import resume_checkpoint

    latest = resume_checkpoint(cfg.run_dir.resolve(), True, cfg.trainer.resume_step)
    return int(latest.name.split("_")[-1]) if latest is not None else 0


def _has_checkpoint(run_dir: Path) -> bool:
    from dapo_mega.run_files.checkpoints import find_latest_checkpoint

    return find_latest_checkpoint(run_dir) is not None


def run_prepare(cfg: DapoConfig, mode: str, engine_nodes: int, job_id: str) -> int:
    """Validate, create the run/log dirs, clear the stale registry; print shell assignments."""
    if cfg.cluster.mode != mode:
        raise RuntimeError(f"cluster.mode={cfg.cluster.mode} but this is slurm/{mode}.sbatch; "
                           f"pass cluster.mode={mode} or submit slurm/{cfg.cluster.mode}.sbatch")
    run_dir = cfg.run_dir.resolve()
    done = completed_steps(cfg)
    # a run of 0 steps (a warm start only, `dapo-mega ablate`) is complete once its step-0 checkpoint exists
    saved = done > 0 or (cfg.trainer.resume and _has_checkpoint(run_dir))
    if done >= cfg.trainer.total_steps and saved:  # a chain's tail job: nothing left, start nothing
        for key, value in {"RUN_DIR": str(run_dir), "RUN_COMPLETE": "1", "COMPLETED_STEPS": str(done),
                           "TOTAL_STEPS": str(cfg.trainer.total_steps)}.items():
            print(f"{key}={shlex.quote(value)}")
        return 0
    from dapo_mega.plan.preflight import check_engine_python, check_nccl_agreement
    from dapo_mega.run_files.identity import settle_run_dir

    check_engine_python(cfg.rollout, starts_engines=True)  # the engines role starts them: before any role
    check_nccl_agreement(cfg)
    settle_run_dir(cfg, write=False)  # a refused resume (a guarded field changed) stops the job before any role
    log_dir = run_dir / "logs" / f"job-{job_id}"
    log_dir.mkdir(parents=True, exist_ok=True)
    registry = registry_dir(cfg)
    registry.mkdir(parents=True, exist_ok=True)
    for stale in registry.glob("*.json"):  # a previous job's engines are gone
        stale.unlink()
    model_path = engine_model_path(cfg)
    if not cfg.rollout.model_path and not cfg.model.hf_path and not (model_path / "config.json").exists():
        # the engines load it at start; the learners find it built and use it as is
        from dapo_mega.models.tiny import build_tiny_model_in_place

        build_tiny_model_in_place(model_path, cfg.model, cfg.megatron.seed)
    engines_per = engines_per_node(cfg.rollout.num_engines, engine_nodes)
    assignments = {"RUN_DIR": str(run_dir), "LOG_DIR": str(log_dir), "REGISTRY_DIR": str(registry),
                   "NUM_ENGINES": str(cfg.rollout.num_engines), "ENGINES_PER_NODE": str(engines_per),
                   "RUN_COMPLETE": "0", "COMPLETED_STEPS": str(done), "TOTAL_STEPS": str(cfg.trainer.total_steps)}
    for key, value in assignments.items():
        print(f"{key}={shlex.quote(value)}")
    return 0


def engine_threads(env: Mapping[str, str], engines_on_node: int) -> int:
    """CPU threads per embedded engine: the node's CPUs given to this task, shared evenly."""
    cpus = int(env.get("SLURM_CPUS_ON_NODE") or os.cpu_count() or 1)
    return max(1, cpus // max(1, engines_on_node))


def engine_rollout_config(cfg: DapoConfig, api_key: str) -> RolloutConfig:
    """The rollout config each engine of this job starts from: the job's API key filled in
    (a copy; the config itself is unchanged)."""
    return dataclasses.replace(cfg.rollout, api_key=api_key)


def router_wanted(cfg: DapoConfig, node_index: int) -> bool:
    """sglang-router runs on the first engine node, in front of SGLang engines only."""
    return cfg.rollout.use_router and cfg.rollout.backend == EngineKind.SGLANG and node_index == 0


def engine_fleet(cfg: DapoConfig, rollout: RolloutConfig, model_path: str, bind_host: str, advertise: str = "",
                 log_dir: Optional[Path] = None, num_threads: int = 0) -> EngineFleet:
    """The fleet that starts this node's engines: `--enable-memory-saver` when colocated
    (else releasing their memory frees nothing), SGLang on the CPU unless this job uses GPUs."""
    from dapo_mega.plan.clock import resolve_health_timeout_s

    return EngineFleet(rollout, model_path, log_dir, device="cuda" if _use_gpu(cfg) else "cpu", bind_host=bind_host,
                       advertise_host=advertise, num_threads=num_threads, weight_version="default",
                       memory_saver=cfg.cluster.mode == "colocated", start_timeout_s=resolve_health_timeout_s(cfg),
                       context_tokens=cfg.algo.max_prompt_length + cfg.algo.max_response_length)


def engine_command_and_env(cfg: DapoConfig, rollout: RolloutConfig, slot: EngineSlot, model_path: str, port: int,
                           bind_host: str, parent_env: Mapping[str, str]) -> Tuple[List[str], Dict[str, str]]:
    """argv and environment the fleet starts one engine of this node with: its own GPUs
    only (CUDA_VISIBLE_DEVICES mapped through the task's, `--base-gpu-id 0`)."""
    fleet = engine_fleet(cfg, rollout, model_path, bind_host)
    argv = fleet.command(port, base_gpu_id=0 if slot.gpu_ids else None)
    return argv, dict(parent_env, **fleet.child_env(slot.index, slot.gpu_ids, parent_env))


class _Terminated(Exception):
    pass


def engine_record(engine: EngineProcess, task: SlurmTask) -> Dict[str, object]:
    """What the engines role announces of one healthy engine in the registry (`engine-<i>.json`):
    where it serves, which process it is, and whether it reports each token's routed experts
    (started with --enable-return-routed-experts: `EngineFleet.returns_routed_experts` of the
    learners that attach to it reads this)."""
    return {"url": engine.url, "engine_id": engine.index, "node": task.node_name, "pid": engine.pid,
            "job_id": task.job_id, "time": time.time(), REGISTRY_ROUTED_EXPERTS: ROUTED_EXPERTS_FLAG in engine.argv}


def run_engines(cfg: DapoConfig, task: SlurmTask, engine_nodes: int, env: Mapping[str, str]) -> int:
    """Start (through the engine fleet), health-check, announce and watch this node's engines
    (and the router on the first engine node when `router_wanted`). Returns the exit status."""
    from dapo_mega.plan.preflight import check_engine_python, check_nccl_agreement

    check_engine_python(cfg.rollout, starts_engines=True)  # prepare checked it too; this role may run alone
    check_nccl_agreement(cfg)
    use_gpu = _use_gpu(cfg)
    slots = compute_engine_slots(cfg, task.node_id, engine_nodes, use_gpu, env)
    bind_host, advertise = engine_addresses(cfg, engine_nodes, use_gpu, env, task.node_name)
    api_key = cfg.rollout.api_key or env.get(API_KEY_ENV, "")
    require_api_key(bind_host, api_key, "rollout.api_key",
                    f"set rollout.api_key or {API_KEY_ENV} (slurm/lib.sh generates one per job)")
    registry = registry_dir(cfg)
    log_dir = Path(env.get("DAPO_MEGA_LOG_DIR") or cfg.run_dir.resolve() / "logs" / f"job-{task.job_id}")
    fleet = engine_fleet(cfg, engine_rollout_config(cfg, api_key), str(engine_model_path(cfg)), bind_host, advertise,
                         log_dir, num_threads=0 if use_gpu else engine_threads(env, len(slots)))
    if cfg.rollout.use_router and not router_wanted(cfg, 0):
        _log(f"rollout.use_router ignored with rollout.backend={cfg.rollout.backend}: sglang-router fronts SGLang "
             "engines only; the trainer uses the embedded engines directly")

    def on_sigterm(signum, frame):
        raise _Terminated()

    def announce(engine: EngineProcess) -> None:
        announce_engine(registry, engine.index, engine_record(engine, task))
        _log(f"engine {engine.index} healthy, announced in {registry}")

    signal.signal(signal.SIGTERM, on_sigterm)
    procs: Dict[str, subprocess.Popen] = {}  # the router, when this node runs it
    logs: Dict[str, Path] = {}
    try:
        if cfg.cluster.mode == "colocated":
            try:
                wait_for_learners(registry, cfg.cluster.driver_stall_timeout_s)
            except EngineStartError as exc:
                _log(f"{exc}")
                return 1
        for slot in slots:
            engine = fleet.spawn(slot.index, slot.gpu_ids, base_gpu_id=0 if slot.gpu_ids else None)
            _log(f"engine {slot.index} on {task.node_name} (pid {engine.pid}): {shlex.join(engine.argv[:3])} ... -> "
                 f"{engine.url} (log {engine.log_path})")
        try:
            fleet.wait_healthy(on_healthy=announce)
        except EngineStartError as exc:
            _log(f"{exc}")
            dead = fleet.dead()
            return _exit_status(dead[0].proc.returncode) if dead else 1
        if router_wanted(cfg, task.node_id):
            failed = _start_router(cfg, registry, advertise, bind_host, log_dir, procs, logs, task, api_key=api_key)
            if failed is not None:
                return failed
        watch = EngineWatch(fleet, cfg.rollout, on_healthy=announce, say=_log)
        while True:  # watch: an engine that exits is restarted at its port (bounded); the router ending fails
            status = watch.check()
            if status is not None:
                return status
            for name, proc in procs.items():
                rc = proc.poll()
                if rc is not None:
                    return _role_process_failed(name, rc, logs[name])
            time.sleep(0.25)
    except _Terminated:
        _log("SIGTERM: stopping engines")
        return 143
    finally:
        fleet.close()
        _stop_all(procs)


def _start_router(cfg: DapoConfig, registry: Path, advertise: str, bind_host: str, log_dir: Path,
                  procs: Dict[str, subprocess.Popen], logs: Dict[str, Path], task: SlurmTask,
                  api_key: str = "") -> Optional[int]:
    """sglang-router in front of every engine of the job (all nodes): waits until all are
    announced, starts it, waits for its /health, announces it as router.json. Returns a
    failure status, or None when the router runs. Its flags are the pinned ones of
    `build_router_command`; `api_key` (the engines' key) goes to sglang-router's
    `--api-key`, which it sends to its workers. The trainer never depends on the router."""
    from dapo_mega.engines.sglang.commands import build_router_command
    from dapo_mega.plan.clock import resolve_health_timeout_s

    limit = resolve_health_timeout_s(cfg)
    deadline = time.monotonic() + limit
    while len(list(registry.glob("engine-*.json"))) < cfg.rollout.num_engines:
        if time.monotonic() > deadline:
            _log(f"router: only {len(list(registry.glob('engine-*.json')))} of {cfg.rollout.num_engines} engines "
                 f"announced after {limit:.0f} s (rollout.health_timeout_s)")
            return 1
        time.sleep(0.5)
    workers = [json.loads(p.read_text())["url"] for p in sorted(registry.glob("engine-*.json"))]
    port = cfg.rollout.base_port + cfg.rollout.num_engines if cfg.rollout.base_port else free_port(bind_host)
    cmd = build_router_command(workers, port, host=bind_host, api_key=api_key)
    logs["router"] = log_dir / "router.log"
    with open(logs["router"], "ab") as log_file:
        procs["router"] = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://{advertise}:{port}"
    _log(f"router (pid {procs['router'].pid}) in front of {len(workers)} engines -> {url} (log {logs['router']})")
    while not is_healthy(EngineEndpoint(url)):
        rc = procs["router"].poll()
        if rc is not None:
            return _role_process_failed("router", rc, logs["router"])
        if time.monotonic() > deadline:
            _log("router not healthy in time")
            return 1
        time.sleep(0.5)
    (registry / ROUTER_FILE).write_text(json.dumps({"url": url, "workers": workers, "node": task.node_name,
                                                    "job_id": task.job_id}))
    return None


def _exit_status(rc: int) -> int:
    """The task's exit status for a process that ended with `rc` (128 + signal, as a shell reports it)."""
    if rc < 0:
        return 128 + (-rc)
    return rc if rc != 0 else 1


def _role_process_failed(name: str, rc: int, log: Path) -> int:
    """Log which process of the role died and how; returns the task's exit status."""
    how = f"signal {-rc}" if rc < 0 else f"status {rc}"
    _log(f"{name} exited with {how}; stopping the other processes of this node")
    _logger.info(f"--- last lines of {log}\n{log_tail(log)}", extra=logs.EVERY_RANK)
    return _exit_status(rc)


def _stop_all(procs: Mapping[str, subprocess.Popen], grace_s: float = 10.0) -> None:
    for proc in procs.values():
        stop_process(proc, grace_s)


def build_learner_command(overrides: Sequence[str], python: str = sys.executable) -> List[str]:
    """`dapo-mega train <user overrides> <launcher overrides>`."""
    return [python, "-m", "dapo_mega.cli", "train", *overrides]


def learner_env(rank: LearnerRank, task: SlurmTask, env: Mapping[str, str]) -> Dict[str, str]:
    """The trainer's environment: the Slurm task's, plus its torch.distributed identity,
    the address engines reach this node's weight-sync rendezvous at (its NodeAddr; the
    hostname's address can be a loopback alias on some images), and what every learner starts
    with unless set (`distributed.learner_process_env`: OMP_NUM_THREADS=1, NCCL's error handling)."""
    out = learner_process_env(env)
    out.update(rank.env())
    node_addr = parse_node_addrs(env.get(NODE_ADDRS_ENV, "")).get(task.node_name)
    if node_addr and SYNC_ADDR_ENV not in env:
        out[SYNC_ADDR_ENV] = node_addr
    return out


def run_learner(cfg: DapoConfig, user_overrides: Sequence[str], task: SlurmTask, env: Mapping[str, str]) -> int:
    """Exec the trainer with this task's torch.distributed identity (does not return)."""
    rank = compute_learner_rank(task, env)
    validate_config(cfg, world_size=rank.world_size)
    cmd = build_learner_command(list(user_overrides) + learner_overrides(cfg, env, slurm_time_left(env)))
    child_env = learner_env(rank, task, env)
    # exec keeps this pid: the line names the trainer process of this rank
    _log(f"learner rank {rank.rank} of {rank.world_size} on {task.node_name} (pid {os.getpid()})")
    if rank.rank == 0:
        _log(f"learner world {rank.world_size} ({task.num_nodes} nodes), master {rank.master_addr}:"
             f"{rank.master_port}: {shlex.join(cmd)}")
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, child_env)
    return 127  # not reached


# --------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dapo_mega.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("prepare", "engines", "learner"))
    parser.add_argument("--mode", choices=("colocated", "disaggregated"), default=None,
                        help="prepare: the sbatch script calling (checked against cluster.mode)")
    parser.add_argument("--engine-nodes", type=int, required=True, help="nodes that run engines in this job")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.overrides = argv[split + 1:]  # Hydra overrides, after `--`
    cfg = load_config(args.overrides)
    env = os.environ
    if args.role == "prepare":
        return run_prepare(cfg, args.mode or cfg.cluster.mode, args.engine_nodes, env.get("SLURM_JOB_ID", "0"))
    task = read_slurm_task(env)
    if args.role == "engines":
        return run_engines(cfg, task, args.engine_nodes, env)
    return run_learner(cfg, args.overrides, task, env)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # one readable line in the role's log, then the traceback
        print(f"dapo-mega launch: error: {exc}", file=sys.stderr, flush=True)
        raise
