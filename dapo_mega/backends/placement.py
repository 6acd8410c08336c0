"""Where every process of a run lives: one pure function from a config and a cluster shape.

    place(cfg, ClusterShape.from_config(cfg, use_gpu=True)) -> Placement

A `Placement` says, before anything starts,

* the device (node, GPU) of every learner rank and its (tp, cp, dp, pp) coordinates, in
  megatron-core's default rank order `tp-cp-ep-dp-pp` (TP fastest, PP slowest), one
  learner task per GPU, nodes filled in order;
* every engine: its node, its GPUs (engine TP rank r on `gpu_ids[r]`), the
  `CUDA_VISIBLE_DEVICES` its process gets (so SGLang's `--base-gpu-id` is 0 and two
  engines of one node never share a GPU), the address it binds and the address it
  announces (the same loopback address when the whole job is one node), and how weights
  reach it (`transport`);
* the process groups the weight sync forms: for distributed engines one weight-update
  group per pipeline stage (that stage's source rank = group rank 0, engine e's TP rank r
  = group rank 1 + e·tp + r, world size 1 + engines·tp; SGLang asserts dp_size == 1 for
  updates from distributed, so `validate_config` refuses rollout.engine_dp_size > 1), and
  for colocated GPU engines one CUDA-IPC hand-over group per engine (the learner ranks on
  the engine's GPUs, in engine TP-rank order; the first one posts the per-rank payloads).

Why: NCCL refuses two ranks of one group on one device ("Duplicate GPU detected"), so a
colocated engine (it shares its GPUs with learner ranks) must get its weights by CUDA IPC
from the learner rank on its own GPU, never through a NCCL group with them. On a CPU
(gloo) devices are the node's CPU and may be shared; the rules below concern GPUs.

Layout rules:

* colocated: learners and engines share every node; engines fill each node's GPUs from
  GPU 0, `ceil(num_engines / num_nodes)` engines per node.
* disaggregated on several nodes: learners on nodes [0, learner_nodes), engines on nodes
  [learner_nodes, num_nodes) (the heterogeneous Slurm job's component 0 and 1).
* disaggregated on one node: learners on GPUs [0, learner ranks), engines after them.

`Placement.problems()` lists every broken rule (two learner ranks or two engines on one
GPU, a group with two ranks on one device, a colocated engine GPU without a learner rank),
and the launcher, `dapo-mega plan` and the trainer read their devices from here.

The device rule of one node (`gpu_block`, `node_gpu_blocks`) is the one every process that
may touch a GPU takes its device from: the k-th task of a node runs on GPUs
[k·g, (k+1)·g) of it (g = GPUs per task), and a node never holds more tasks than its GPUs.
`place` follows it for learner ranks and engines; `conversion_cuda_index` for the ranks of
`tools/convert_checkpoint.py` (on the CPU unless told `--device cuda`), `node_engine_gpus`
for the engines `dapo-mega eval` and `dapo-mega audit` start on their node. No process
chooses `LOCAL_RANK` or `CUDA_VISIBLE_DEVICES` itself: a launcher sets LOCAL_RANK (checked
against the placement, `learner_cuda_index`), the fleet narrows CUDA_VISIBLE_DEVICES to an
engine's block, and a process the rule puts on the CPU sees no GPU (`CPU_RANK_ENV`).

The embedded engine (`rollout.backend=embedded`) always runs on the CPU, also beside GPU
learners (`engine_uses_gpu`): it holds no GPU, its weights arrive as shared-memory files
(colocated, one node) or through a gloo group (`ProcessGroupPlan.backend`), never as CUDA IPC
handles or NCCL broadcasts it could not receive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from dapo_mega.backends.megatron.layout import ParallelLayout
from dapo_mega.config import ConfigError, DapoConfig, EngineKind, RolloutConfig

#: How weights reach an engine.
CUDA_IPC = "cuda_ipc"
"""Colocated on GPUs: the learner rank on each engine TP rank's GPU hands over CUDA IPC handles."""
SHARED_MEMORY = "shared_memory"
"""Colocated on a CPU: one shared-memory file per bucket, read by the engine (same node)."""
DISTRIBUTED = "distributed"
"""A weight-update process group (NCCL on GPUs, gloo on CPUs) with each stage's source rank."""


@dataclass(frozen=True)
class Device:
    """One accelerator (or, with `gpu=None`, the CPU of a node)."""

    node: int
    gpu: Optional[int]

    def __str__(self) -> str:
        return f"node {self.node} " + ("cpu" if self.gpu is None else f"gpu {self.gpu}")


@dataclass(frozen=True)
class ClusterShape:
    """The machines a run gets. `from_config` reads the `cluster.*` fields."""

    num_nodes: int
    gpus_per_node: int
    mode: str
    """colocated or disaggregated."""
    engine_nodes: int
    """Nodes that run engines: all nodes colocated; the last `engine_nodes` disaggregated
    (0 with one node: learners and engines split that node's GPUs)."""
    learner_ranks: int
    """Learner processes of the job (one per GPU of the learner nodes on GPUs)."""
    use_gpu: bool = True
    node_addrs: Tuple[str, ...] = ()
    """Address of each node (index = node); empty: `node<i>` placeholders."""

    @property
    def learner_nodes(self) -> int:
        if self.mode == "colocated" or self.num_nodes == 1:
            return self.num_nodes
        return self.num_nodes - self.engine_nodes

    @property
    def first_engine_node(self) -> int:
        return 0 if self.mode == "colocated" or self.num_nodes == 1 else self.learner_nodes

    @classmethod
    def from_config(cls, cfg: DapoConfig, use_gpu: bool, num_nodes: Optional[int] = None,
                    engine_nodes: Optional[int] = None, node_addrs: Sequence[str] = (),
                    learner_ranks: Optional[int] = None) -> "ClusterShape":
        """The shape of `cfg.cluster`, or of a job that overrides its node counts (Slurm) or
        its learner world size (a running trainer passes torch.distributed's).

        Learner ranks: one per GPU of the learner nodes, except on a CPU and on one
        disaggregated GPU node, where `cluster.num_learner_processes` tells."""
        c = cfg.cluster
        nodes = num_nodes if num_nodes is not None else c.num_nodes
        if c.mode == "colocated":
            engines = nodes
        else:
            engines = engine_nodes if engine_nodes is not None else c.engine_nodes
            if nodes == 1:
                engines = 0
        learner_nodes = nodes if c.mode == "colocated" or nodes == 1 else nodes - engines
        if learner_ranks is not None:
            learners = learner_ranks
        elif use_gpu and (nodes > 1 or c.mode == "colocated"):
            learners = learner_nodes * c.gpus_per_node
        else:
            learners = c.num_learner_processes
        return cls(num_nodes=nodes, gpus_per_node=c.gpus_per_node, mode=c.mode, engine_nodes=engines,
                   learner_ranks=learners, use_gpu=use_gpu, node_addrs=tuple(node_addrs))

    def address(self, node: int) -> str:
        return self.node_addrs[node] if node < len(self.node_addrs) else f"node{node}"


@dataclass(frozen=True)
class LearnerPlacement:
    """One learner rank: where it runs and its coordinates in the parallel layout."""

    rank: int
    device: Device
    local_rank: int
    """Rank among the learner tasks of its node (LOCAL_RANK; the GPU it selects)."""
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int

    @property
    def is_weight_source(self) -> bool:
        """The rank of its pipeline stage that sends the stage's weights (tp0, cp0, dp0)."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.dp_rank == 0


@dataclass(frozen=True)
class EnginePlacement:
    """One engine server: its devices, its addresses and how weights reach it."""

    index: int
    node: int
    gpu_ids: Tuple[int, ...]
    """GPUs of the node, engine TP rank r on gpu_ids[r]; empty on a CPU."""
    bind_host: str
    """Address the server listens on."""
    announce_host: str
    """Address written into the engine registry (what learners connect to)."""
    transport: str
    """cuda_ipc, shared_memory or distributed (module constants)."""
    ipc_ranks: Tuple[int, ...] = ()
    """cuda_ipc: the learner rank on gpu_ids[r] for each engine TP rank r; ipc_ranks[0]
    gathers the per-rank payloads and posts them."""

    @property
    def devices(self) -> List[Device]:
        return [Device(self.node, g) for g in self.gpu_ids] or [Device(self.node, None)]

    @property
    def base_gpu_id(self) -> int:
        """SGLang `--base-gpu-id`: 0, because CUDA_VISIBLE_DEVICES already narrows the GPUs."""
        return 0

    def cuda_visible_devices(self, parent_visible: Optional[str] = None) -> str:
        """CUDA_VISIBLE_DEVICES of the engine process: its GPUs, mapped through the
        parent's own CUDA_VISIBLE_DEVICES when one is set (Slurm may set it, e.g. "4,5,6,7")."""
        return visible_devices(self.gpu_ids, parent_visible)


@dataclass(frozen=True)
class GroupMember:
    """One rank of a process group."""

    role: str
    """learner or engine."""
    index: int
    """Learner rank, or engine index."""
    group_rank: int
    device: Device
    engine_tp_rank: int = 0


@dataclass(frozen=True)
class ProcessGroupPlan:
    """A process group the weight sync forms."""

    name: str
    kind: str
    """weight_update (NCCL/gloo broadcast into engines) or ipc_handover (CUDA IPC gather)."""
    stage: int
    """Pipeline stage whose weights travel through it (-1: every stage, ipc_handover)."""
    members: Tuple[GroupMember, ...]

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def backend(self) -> str:
        """torch.distributed backend of the group: NCCL when every member is on a GPU, else
        gloo (a CPU member, e.g. the embedded engine beside GPU learners, cannot join NCCL)."""
        return "nccl" if self.members and all(m.device.gpu is not None for m in self.members) else "gloo"

    def duplicate_devices(self) -> List[Device]:
        """GPUs holding two ranks of this group (NCCL refuses them); CPUs never count."""
        seen: Dict[Device, int] = {}
        for m in self.members:
            if m.device.gpu is not None:
                seen[m.device] = seen.get(m.device, 0) + 1
        return [d for d, n in seen.items() if n > 1]


@dataclass(frozen=True)
class Placement:
    """Every learner rank, engine and weight-sync group of a run (see the module docstring)."""

    shape: ClusterShape
    learners: Tuple[LearnerPlacement, ...]
    engines: Tuple[EnginePlacement, ...]
    groups: Tuple[ProcessGroupPlan, ...]
    engine_tp_size: int

    @property
    def transport(self) -> str:
        """The weight transport of the run (every engine of a run has the same)."""
        kinds = {e.transport for e in self.engines}
        return kinds.pop() if len(kinds) == 1 else DISTRIBUTED

    def engines_on_node(self, node: int) -> List[EnginePlacement]:
        return [e for e in self.engines if e.node == node]

    def engine_nodes(self) -> List[int]:
        return sorted({e.node for e in self.engines})

    def learner(self, rank: int) -> LearnerPlacement:
        return self.learners[rank]

    def weight_sources(self) -> List[LearnerPlacement]:
        """The source rank of each pipeline stage, in stage order."""
        return sorted((r for r in self.learners if r.is_weight_source), key=lambda r: r.pp_rank)

    def weight_update_group(self, stage: int) -> Optional[ProcessGroupPlan]:
        for g in self.groups:
            if g.kind == "weight_update" and g.stage == stage:
                return g
        return None

    def problems(self) -> List[str]:
        """Every broken placement rule, as one sentence each (empty: the placement works)."""
        out: List[str] = []
        if self.shape.use_gpu:
            owners: Dict[Device, List[str]] = {}
            for r in self.learners:
                owners.setdefault(r.device, []).append(f"learner rank {r.rank}")
            for device, names in owners.items():
                if len(names) > 1:
                    out.append(f"{device} holds {', '.join(names)}")
            engine_owner: Dict[Device, int] = {}
            for e in self.engines:
                for d in e.devices:
                    if d.gpu is None:  # the embedded engine beside GPU learners: the node's CPU
                        continue
                    if d in engine_owner:
                        out.append(f"{d} is shared by engines {engine_owner[d]} and {e.index}")
                    engine_owner[d] = e.index
                    if d.gpu is not None and not 0 <= d.gpu < self.shape.gpus_per_node:
                        out.append(f"engine {e.index} uses {d}, beyond gpus_per_node={self.shape.gpus_per_node}")
                if e.transport == CUDA_IPC and len(e.ipc_ranks) != len(e.gpu_ids):
                    out.append(f"engine {e.index} is colocated but not every one of its GPUs hosts a learner rank")
        for g in self.groups:
            for d in g.duplicate_devices():
                out.append(f"process group {g.name} holds two ranks on {d} (NCCL: Duplicate GPU detected)")
        for e in self.engines:
            if self.shape.num_nodes == 1 and e.announce_host != e.bind_host:
                out.append(f"engine {e.index} binds {e.bind_host} but announces {e.announce_host} on a one-node job")
        return out

    def check(self) -> "Placement":
        """Raise ValueError listing every problem; returns self when there is none."""
        problems = self.problems()
        if problems:
            raise ValueError("placement: " + "; ".join(problems))
        return self


# ------------------------------------------------------------------------------ helpers
def visible_devices(gpu_ids: Sequence[int], parent_visible: Optional[str] = None) -> str:
    """`CUDA_VISIBLE_DEVICES` for a child using `gpu_ids` (indices as the parent sees them)."""
    if not parent_visible:
        return ",".join(str(g) for g in gpu_ids)
    parent = [p.strip() for p in parent_visible.split(",") if p.strip()]
    if any(g >= len(parent) for g in gpu_ids):
        raise ValueError(f"GPUs {list(gpu_ids)} beyond the {len(parent)} visible to this process "
                         f"(CUDA_VISIBLE_DEVICES={parent_visible})")
    return ",".join(parent[g] for g in gpu_ids)


def learner_cuda_index(learner: LearnerPlacement, env: Mapping[str, str]) -> int:
    """The CUDA device index this learner process selects: the placement's GPU of its node,
    as the process numbers it (its position in CUDA_VISIBLE_DEVICES; 0 when its launcher
    bound it to one GPU). A launcher whose LOCAL_RANK disagrees with the placement put
    ranks on other nodes or GPUs than the weight sync expects, and is refused."""
    if learner.device.gpu is None:
        raise ValueError(f"learner rank {learner.rank} has no GPU in this placement")
    local = env.get("LOCAL_RANK")
    if local is not None and int(local) != learner.local_rank:
        raise ValueError(f"learner rank {learner.rank}: the launcher set LOCAL_RANK={local}, the placement has it "
                         f"as local rank {learner.local_rank} ({learner.device}); ranks must fill nodes in order "
                         "(Slurm's block distribution, srun --distribution=block)")
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return learner.device.gpu
    if len(visible) == 1:
        return 0
    if not all(v.isdigit() for v in visible) and learner.device.gpu < len(visible):
        return learner.device.gpu  # UUIDs: listed in the node's order
    if str(learner.device.gpu) not in visible:
        raise ValueError(f"learner rank {learner.rank} is placed on GPU {learner.device.gpu} of its node, which "
                         f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} hides")
    return visible.index(str(learner.device.gpu))


def engine_uses_gpu(backend: str, use_gpu: bool) -> bool:
    """Whether an engine of rollout `backend` runs on GPUs: SGLang where the run has GPUs; the
    embedded engine never (a CPU engine, also beside GPU learners)."""
    return use_gpu and backend == EngineKind.SGLANG


def engines_per_node(num_engines: int, engine_nodes: int) -> int:
    """Engines are spread evenly: node k hosts indices [k·per, (k+1)·per) ∩ [0, num_engines)."""
    if engine_nodes < 1:
        raise ValueError("engine_nodes must be >= 1")
    return math.ceil(num_engines / engine_nodes)


def _engine_hosts(shape: ClusterShape, node: int, host: str) -> Tuple[str, str]:
    """(bind, announce): a one-node job binds `rollout.host` (loopback by default) and
    announces the same address; otherwise it binds and announces the node's address."""
    if shape.num_nodes == 1:
        return host, host
    address = shape.address(node)
    return address, address


# ------------------------------------------------------------------------------ the device rule of a node
CPU = "cpu"
"""A process on the CPU: gloo, megatron-core's local spec, no GPU visible (`CPU_RANK_ENV`)."""
CUDA = "cuda"
"""A process on its own GPU(s) of the node, by `gpu_block`."""

CPU_RANK_ENV: Mapping[str, str] = {"CUDA_VISIBLE_DEVICES": ""}
"""The environment of a process the rule puts on the CPU on a node that has GPUs: it sees
none, so every `torch.cuda.is_available()` of megatron-core and of this package takes the
CPU path (gloo, the local spec, the CPU substitutions): the path the CPU tests run."""


class DeviceRuleError(ConfigError):
    """More tasks than the node's GPUs hold; one line naming the counts and the fix."""


def gpu_block(slot: int, gpus_per_task: int, first_gpu: int = 0) -> Tuple[int, ...]:
    """GPUs of the `slot`-th task of a node: [first_gpu + slot·g, first_gpu + (slot+1)·g)."""
    return tuple(range(first_gpu + slot * gpus_per_task, first_gpu + (slot + 1) * gpus_per_task))


def node_gpu_blocks(tasks: int, gpus_per_task: int, gpus_on_node: int, who: str, fix: str) -> List[Tuple[int, ...]]:
    """The GPUs of each of `tasks` tasks of one node (`gpu_block`), all distinct; raises
    DeviceRuleError when tasks · gpus_per_task exceeds `gpus_on_node` (pure)."""
    need = tasks * gpus_per_task
    if need > gpus_on_node:
        raise DeviceRuleError(f"{who} need {need} GPUs of one node, which has {gpus_on_node}. Fix: {fix}")
    return [gpu_block(k, gpus_per_task) for k in range(tasks)]


def rank_cuda_index(rank: int, ranks_on_node: int, device: str, gpus_on_node: int, who: str, fix: str
                    ) -> Optional[int]:
    """The GPU of rank `rank` of `ranks_on_node` processes a command starts on its node (one GPU
    each): None on the CPU (`device` cpu), else `gpu_block(rank, 1)`; refuses more ranks than GPUs."""
    if device == CPU:
        return None
    if device != CUDA:
        raise ConfigError(f"{who}: device {device!r} is unknown. Fix: cpu or cuda")
    return node_gpu_blocks(ranks_on_node, 1, gpus_on_node, f"{who}: {ranks_on_node} ranks, one GPU each,", fix)[rank][0]


def conversion_world_size(tp: int, pp: int, ep: int = 1) -> int:
    """Ranks a conversion runs on: TP x PP, and data-parallel copies where EP needs more ranks
    than TP has (expert TP 1: a stage's TP x DP ranks hold EP x expert-DP). Conversion, verify
    and the launch pipeline's conversion stages (their CPUs) all count with it."""
    return tp * pp * (ep // math.gcd(tp, ep))


def conversion_cuda_index(rank: int, ranks_on_node: int, device: str, gpus_on_node: int) -> Optional[int]:
    """The GPU of conversion rank `rank` of a node (`tools/convert_checkpoint.py`, tp·pp
    ranks): None on the CPU (`device` cpu, the default), else the rank's own GPU; refuses
    more ranks than the node has GPUs."""
    return rank_cuda_index(rank, ranks_on_node, device, gpus_on_node, "conversion --device cuda (--tp x --pp)",
                           f"--device cpu (the default; the checkpoint is the same), or --tp x --pp <= {gpus_on_node}")


def node_engine_gpus(rollout: RolloutConfig, gpus_on_node: int, who: str) -> List[Tuple[int, ...]]:
    """The GPUs of each of the `rollout.num_engines` engines a command starts on its own node
    (`dapo-mega eval`, `dapo-mega audit`): engine i on `gpu_block(i, tp·dp)`, none shared;
    refuses more engines than fit."""
    per = rollout.engine_tp_size * rollout.engine_dp_size
    fit = engines_fitting_node(rollout, gpus_on_node)
    fix = (f"rollout.num_engines={fit}" if per <= gpus_on_node else
           f"rollout.engine_tp_size <= {gpus_on_node}, or run it where a node has {per} GPUs")
    return node_gpu_blocks(rollout.num_engines, per, gpus_on_node,
                           f"{who}: rollout.num_engines={rollout.num_engines} engines of {per} GPUs "
                           f"(rollout.engine_tp_size={rollout.engine_tp_size})", fix)


def engines_fitting_node(rollout: RolloutConfig, gpus_on_node: int) -> int:
    """Engines of `rollout.engine_tp_size · engine_dp_size` GPUs that one node holds (>= 1)."""
    return max(1, gpus_on_node // (rollout.engine_tp_size * rollout.engine_dp_size))


# ------------------------------------------------------------------------------ the function
def place(cfg: DapoConfig, shape: ClusterShape) -> Placement:
    """Devices of every learner rank and engine, and the weight-sync groups (pure)."""
    m, r = cfg.megatron, cfg.rollout
    world = shape.learner_ranks
    one_node = shape.num_nodes == 1

    # learners: one task per GPU, nodes filled in order
    per_node = world if one_node else max(1, math.ceil(world / max(1, shape.learner_nodes)))
    learners = []
    layout = ParallelLayout.from_config(m, world)
    for rank in range(world):
        node, local = divmod(rank, per_node)
        t, c, d, p = layout.coordinates_of(rank)
        gpu = gpu_block(local, 1)[0] if shape.use_gpu else None
        learners.append(LearnerPlacement(rank, Device(node, gpu), local, t, c, d, p))
    by_device = {lp.device: lp.rank for lp in learners}

    # engines
    engine_gpus = r.engine_tp_size * r.engine_dp_size
    colocated = shape.mode == "colocated"
    if one_node and not colocated:
        engine_node_list, first_gpu = [0], world  # learners first, engines after them on the node
    else:
        engine_node_list = list(range(shape.first_engine_node, shape.first_engine_node + max(1, shape.engine_nodes)))
        first_gpu = 0
    per_engine_node = engines_per_node(r.num_engines, len(engine_node_list))
    engines = []
    on_gpu = engine_uses_gpu(r.backend, shape.use_gpu)
    for index in range(r.num_engines):
        slot, local = divmod(index, per_engine_node)
        node = engine_node_list[slot]
        ids = gpu_block(local, engine_gpus, first_gpu) if on_gpu else ()
        if colocated and on_gpu:
            transport = CUDA_IPC
            holders = tuple(by_device[Device(node, g)] for g in ids if Device(node, g) in by_device)
        else:
            transport = SHARED_MEMORY if colocated and one_node else DISTRIBUTED
            holders = ()
        bind, announce = _engine_hosts(shape, node, r.host)
        engines.append(EnginePlacement(index, node, ids, bind, announce, transport, holders))

    # groups
    groups: List[ProcessGroupPlan] = []
    distributed = [e for e in engines if e.transport == DISTRIBUTED]
    sources = sorted((lp for lp in learners if lp.is_weight_source), key=lambda lp: lp.pp_rank)
    if distributed:
        for src in sources:
            members = [GroupMember("learner", src.rank, 0, src.device)]
            for e in distributed:
                for tp_rank in range(r.engine_tp_size):
                    device = Device(e.node, e.gpu_ids[tp_rank] if e.gpu_ids else None)
                    rank = weight_update_rank_offset(e.index, r.engine_tp_size) + tp_rank
                    members.append(GroupMember("engine", e.index, rank, device, tp_rank))
            groups.append(ProcessGroupPlan(f"dapo_weight_sync_pp{src.pp_rank}", "weight_update", src.pp_rank,
                                           tuple(members)))
    for e in engines:
        if e.transport == CUDA_IPC and e.ipc_ranks:
            members = tuple(GroupMember("learner", rank, i, learners[rank].device, i)
                            for i, rank in enumerate(e.ipc_ranks))
            groups.append(ProcessGroupPlan(f"dapo_ipc_engine{e.index}", "ipc_handover", -1, members))
    return Placement(shape, tuple(learners), tuple(engines), tuple(groups), r.engine_tp_size)


def weight_update_rank_offset(engine_index: int, engine_tp_size: int) -> int:
    """Group rank of engine `engine_index`'s TP rank 0 in a weight-update group (`rank_offset`)."""
    return 1 + engine_index * engine_tp_size


def weight_update_world_size(num_engines: int, engine_tp_size: int) -> int:
    """Source rank + every engine TP rank (engine DP must be 1: SGLang asserts it)."""
    return 1 + num_engines * engine_tp_size


NODE_ADDRS_ENV = "DAPO_MEGA_NODE_ADDRS"
"""'n1=10.0.0.1,n2=10.0.0.2': every node of a Slurm job, exported by slurm/lib.sh."""


def trainer_placement(cfg: DapoConfig, learner_ranks: int, use_gpu: bool, env: Mapping[str, str]) -> Placement:
    """The placement a running trainer sees: the Slurm job's nodes (DAPO_MEGA_NODE_ADDRS, in
    the environment the launcher passes to learners) or, outside Slurm, one node — the
    trainer then starts the engines itself, on that node's GPUs (`Placement.engines[i].gpu_ids`)."""
    nodes = [item.split("=", 1) for item in env.get(NODE_ADDRS_ENV, "").split(",") if "=" in item]
    num_nodes = max(1, len(nodes))
    engine_nodes = num_nodes if cfg.cluster.mode == "colocated" else (cfg.cluster.engine_nodes or 1)
    shape = ClusterShape.from_config(cfg, use_gpu, num_nodes=num_nodes, engine_nodes=min(engine_nodes, num_nodes),
                                     node_addrs=[addr.strip() for _, addr in nodes], learner_ranks=learner_ranks)
    return place(cfg, shape)
