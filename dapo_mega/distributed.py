"""Collective helpers that work alike under gloo (CPU), NCCL (GPU) and in one process.

    barrier(group)                       every rank of the group waits for the others
    broadcast_object(obj, src, group)    rank `src`'s object on every rank (pickled)
    host_group(ranks)                    a gloo group: what the driver hands the learners travels
                                         on the host, never through a GPU
    send_tensor / receive_tensor         one rank's 1-D CPU tensor of any length to another
    broadcast_tensor(t, src, dtype, g)   rank `src`'s 1-D CPU tensor of any length on every rank
    any_rank_true(flag, group)           True on every rank when any rank passed True
    all_reduce_sum(values, group)        element-wise sum of a list of floats over the group
    free_port(host)                      a TCP port for a rendezvous (or an engine) to bind
    learner_process_env(env)             the environment a learner rank starts with (OMP threads,
                                         NCCL's error handling named)

A collective moves tensors on the device its backend serves: NCCL refuses CPU tensors
("No backend type associated with device type cpu") and gloo serves only CPU ones. The one
rule, `collective_device_type(backend)`, is a pure function of the backend name, tested on
the CPU; every helper allocates its tensors where it says. A process group with several
backends (`"cpu:gloo,cuda:nccl"`) takes CPU tensors.

Every helper is a no-op (returns its input) when torch.distributed is not initialised or
the group has one rank, so single-process runs and unit tests call them unconditionally.
`src` is a global rank, as in torch.distributed.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_DEVICE_OF_BACKEND = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu", "ucc": "cpu", "xccl": "xpu", "hccl": "npu"}


def collective_device_type(backend: str) -> str:
    """The device type ("cpu", "cuda", ...) of tensors a collective on `backend` accepts.

    `backend` is what `torch.distributed.get_backend(group)` returns: one name ("nccl",
    "gloo") or a per-device list ("cpu:gloo,cuda:nccl"), where CPU tensors win when the CPU
    has a backend (no copy to the GPU for a flag).
    """
    name = str(backend).lower().strip()
    if ":" in name:
        per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        if "cpu" in per_device:
            return "cpu"
        if len(per_device) == 1:
            return next(iter(per_device))
        raise ValueError(f"process-group backend {backend!r}: no CPU backend and several devices")
    if name not in _DEVICE_OF_BACKEND:
        raise ValueError(f"process-group backend {backend!r}: unknown; known: {sorted(_DEVICE_OF_BACKEND)}")
    return _DEVICE_OF_BACKEND[name]


def is_active(group: Optional[ProcessGroup] = None) -> bool:
    """torch.distributed is initialised and the group has more than one rank."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in `group` (0 without torch.distributed)."""
    dist = torch.distributed
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def world_size(group: Optional[ProcessGroup] = None) -> int:
    """Ranks in `group` (1 without torch.distributed)."""
    dist = torch.distributed
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def collective_device(group: Optional[ProcessGroup] = None) -> torch.device:
    """Where to allocate a tensor for a collective on `group` (the current CUDA device for NCCL)."""
    kind = collective_device_type(torch.distributed.get_backend(group))
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def barrier(group: Optional[ProcessGroup] = None) -> None:
    """Wait for every rank of `group`."""
    if is_active(group):
        torch.distributed.barrier(group=group)


def broadcast_object(obj: object, src: int = 0, group: Optional[ProcessGroup] = None) -> Any:
    """Rank `src`'s `obj` on every rank of `group` (others pass anything, e.g. None).

    Pickled: use it inside a trusted group only (the learner ranks of one job).
    """
    if not is_active(group):
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src, group=group)
    return box[0]


def host_group(ranks: Optional[Sequence[int]] = None) -> Optional[ProcessGroup]:
    """A gloo group of global `ranks` (default: every rank): its collectives move CPU tensors,
    so what travels over it never touches a GPU (under NCCL a pickled object is copied to the
    device on every rank). None without torch.distributed. Collective: every rank of the world
    calls it, with the same `ranks`, in the same order (`torch.distributed.new_group`); a rank
    outside `ranks` gets a handle it must not use."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(ranks=sorted(ranks) if ranks is not None else None, backend="gloo")


TENSOR_PIECE_BYTES = 1 << 30
"""A tensor of any length crosses in pieces of at most this many bytes (one send each)."""


def _pieces(tensor: torch.Tensor) -> List[torch.Tensor]:
    """Contiguous views of a 1-D tensor, at most TENSOR_PIECE_BYTES each (none when empty)."""
    step = max(1, TENSOR_PIECE_BYTES // tensor.element_size())
    return [tensor[k:k + step] for k in range(0, tensor.numel(), step)]


def send_tensor(tensor: torch.Tensor, dst: int, group: Optional[ProcessGroup] = None) -> None:
    """A 1-D CPU tensor to global rank `dst` (which calls `receive_tensor`): its length, then its
    elements in pieces (`TENSOR_PIECE_BYTES`). Point to point: use a gloo group (`host_group`)."""
    torch.distributed.send(torch.tensor([tensor.numel()], dtype=torch.int64), dst=dst, group=group)
    for piece in _pieces(tensor.contiguous()):
        torch.distributed.send(piece, dst=dst, group=group)


def receive_tensor(src: int, dtype: torch.dtype, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """The 1-D CPU tensor of `dtype` that global rank `src` sends with `send_tensor`."""
    length = torch.zeros(1, dtype=torch.int64)
    torch.distributed.recv(length, src=src, group=group)
    out = torch.empty(int(length.item()), dtype=dtype)
    for piece in _pieces(out):
        torch.distributed.recv(piece, src=src, group=group)
    return out


def broadcast_tensor(tensor: Optional[torch.Tensor], src: int, dtype: torch.dtype,
                     group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Global rank `src`'s 1-D CPU tensor of `dtype` on every rank of `group` (the others pass
    None): its length first, then its elements in pieces. Collective over `group` (gloo)."""
    if not is_active(group):
        return tensor
    mine = torch.distributed.get_rank() == src
    length = torch.tensor([tensor.numel() if mine else 0], dtype=torch.int64)
    torch.distributed.broadcast(length, src=src, group=group)
    out = tensor.contiguous() if mine else torch.empty(int(length.item()), dtype=dtype)
    for piece in _pieces(out):
        torch.distributed.broadcast(piece, src=src, group=group)
    return out


def any_rank_true(flag: bool, group: Optional[ProcessGroup] = None) -> bool:
    """True on every rank when `flag` is True on at least one rank of `group`."""
    if not is_active(group):
        return bool(flag)
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int64, device=collective_device(group))
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(tensor.item())


def merge_dicts(mine: Optional[Mapping[str, Any]], group: Optional[ProcessGroup] = None) -> Dict[str, Any]:
    """Every rank's dict merged (later ranks win on a shared key), on every rank (collective;
    this rank's copy alone outside torch.distributed or with one rank)."""
    if not is_active(group):
        return dict(mine or {})
    every: List[Optional[Mapping[str, Any]]] = [None] * world_size(group)
    torch.distributed.all_gather_object(every, dict(mine or {}), group=group)
    return {k: v for part in every for k, v in (part or {}).items()}


def all_reduce_sum(values: Sequence[float], group: Optional[ProcessGroup] = None) -> List[float]:
    """Element-wise sum over the ranks of `group` (float64, so token counts stay exact)."""
    if not is_active(group):
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=collective_device(group))
    torch.distributed.all_reduce(tensor, group=group)
    return tensor.tolist()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now on `host` (the OS picks it). The package's one
    copy: rendezvous ports (MASTER_PORT, weight-update groups) and engine ports alike."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""What ProcessGroupNCCL's watchdog does on a timeout or an asynchronous NCCL error, read by
each group's constructor (torch 2.13 `ProcessGroupNCCL.cpp`): 0 nothing, 1 abort the
communicators and end the process, 2 abort them only, 3 (torch's default) end the process
without aborting them."""
LEARNER_NCCL_ERROR_HANDLING = "3"
"""The learner's groups (TP, PP, DP) keep torch's default: a collective that times out or a
peer that dies ends the rank, Slurm's --kill-on-bad-exit the job, and the next link of the
chain resumes. The weight-update group is built with 0 instead
(`transport.init_custom_process_group`); named in every learner's environment from its start
so that switch replaces a value and never grows the environment while threads read it."""


def learner_process_env(env: Mapping[str, str]) -> Dict[str, str]:
    """`env` with what every learner rank starts with unless the user set it: OMP_NUM_THREADS=1
    (as torchrun does: several ranks share a node's cores) and NCCL's error handling
    (`LEARNER_NCCL_ERROR_HANDLING`)."""
    out = dict(env)
    out.setdefault("OMP_NUM_THREADS", "1")
    out.setdefault(NCCL_ERROR_HANDLING_ENV, LEARNER_NCCL_ERROR_HANDLING)
    return out
