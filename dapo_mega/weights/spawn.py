"""Run a function in N local processes joined by one process group (conversion, tests, benchmarks).

`convert_checkpoint.py import/export/verify --tp N --pp M` spawns N·M processes here (one
per model-parallel rank, rendezvous on 127.0.0.1 at a free port). Where they run is the
caller's choice through the device rule (`backends.placement`): `device="cpu"` (the
default, `spawn_gloo`) starts each process with the GPUs hidden (`placement.CPU_RANK_ENV`),
so it runs gloo and megatron-core's CPU path even on a GPU node; `device="cuda"` leaves
them visible, and each rank selects its own GPU (`placement.conversion_cuda_index`). This
module sets RANK / WORLD_SIZE / MASTER_* for env://, never LOCAL_RANK: no device is chosen
here. Under torchrun/srun with torch.distributed already up the tool runs on those ranks
instead (see `convert.run_on_ranks`).
"""

from __future__ import annotations

import io
import os
import time
import traceback
from typing import Any, Callable, List, Mapping, Optional, Sequence, Set, TypeVar

from dapo_mega.backends.placement import CPU, CPU_RANK_ENV, CUDA

AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
"""env:// on every rank connects to a store hosted by the parent (torch's agent-store
convention, as torchrun's agent does), so no rank binds the port itself."""

T = TypeVar("T")
"""What the function run on each spawned rank returns."""


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity (what Slurm's --cpus-per-task, taskset or a
    cgroup cpuset leave it), not the machine's count (`os.cpu_count()` on a 224-core node
    with a 16-CPU allocation would start 14 threads per rank on one CPU each)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS)
        return os.cpu_count() or 1


def torch_threads_per_rank(cpus: int, world_size: int) -> int:
    """Torch threads of each of `world_size` ranks sharing `cpus` CPUs: an even share, at least one."""
    return max(1, cpus // max(1, world_size))


PRELOAD = ("torch", "transformers", "dapo_mega.backends.megatron.learner", "dapo_mega.weights.convert",
           "dapo_mega.weights.verify")
"""What the fork server imports once, before it forks the ranks (multiprocessing's forkserver):
each rank starts with torch, megatron-core and transformers loaded instead of importing them
itself, ~7 s of a core per rank on a 2-core CPU (a verify rank spent 7.7 of its 10.1 s in
imports). The server lives as long as this process, so a second spawn imports nothing either.
It never touches a GPU (importing torch does not initialise CUDA); each rank's environment and CPU
affinity are this process's at the spawn (`_worker`), not the server's."""


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., object], args: Sequence[object], queue,
            env: Mapping[str, str], cpus: Optional[Set[int]]) -> None:
    # a forked rank inherits the server's environment and CPU affinity: the caller's at the spawn, as spawn would
    os.environ.clear()
    os.environ.update(env)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      **AGENT_STORE_ENV)
    torch.set_num_threads(torch_threads_per_rank(usable_cpus(), world_size))
    try:
        # Tensors in a multiprocessing queue travel as shared-memory handles that need the
        # sender alive; this process exits right after, so send plain bytes instead.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException as exc:  # the parent re-raises with this rank's traceback
        queue.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _load_result(payload: bytes) -> Any:
    import torch

    # Our own child's return value (any picklable object), hence weights_only=False.
    return torch.load(io.BytesIO(payload), weights_only=False)


class SpawnedRankError(RuntimeError):
    """A spawned rank failed; `.message` is its exception text, `.traceback` the full one."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str):
        super().__init__(f"rank {rank}: {exc_type}: {message}\n--- traceback of rank {rank} ---\n{tb}")
        self.rank, self.exc_type, self.message, self.traceback = rank, exc_type, message, tb


def spawn_gloo(fn: Callable[..., T], world_size: int, args: Sequence[object] = (),
               timeout_s: float = 3600.0) -> List[T]:
    """`spawn_ranks` on the CPU: gloo, no GPU visible to the processes."""
    return spawn_ranks(fn, world_size, args, device=CPU, timeout_s=timeout_s)


def spawn_ranks(fn: Callable[..., T], world_size: int, args: Sequence[object] = (), device: str = CPU,
                timeout_s: float = 3600.0) -> List[T]:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes; results by rank.

    The environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, `AGENT_STORE_ENV`) is set so `fn`
    initialises torch.distributed with env://, against a store this process hosts. `device`: cpu (each process sees no GPU) or cuda (each
    sees this process's GPUs and `fn` selects its own from the device rule). The first
    failing rank's error is raised as SpawnedRankError; every process is joined or killed
    before returning.
    """
    import torch
    import torch.multiprocessing as mp

    if device not in (CPU, CUDA):
        raise ValueError(f"spawn_ranks: device {device!r}; one of {CPU!r}, {CUDA!r}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts, at the first spawn
    queue = ctx.Queue()
    # the rendezvous store is hosted here, on a port the OS gives it while it is bound: a port
    # picked free and bound later by rank 0 can be taken meanwhile (EADDRINUSE, seen in CI)
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    env = {**os.environ, **(CPU_RANK_ENV if device == CPU else {})}
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, tuple(args), queue, env, cpus),
                         daemon=False)  # dist_checkpointing forks writer processes of its own
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: List[Any] = [None] * world_size
    received, deadline = 0, time.monotonic() + timeout_s
    try:
        while received < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"conversion ranks did not finish within {timeout_s:.0f} s")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: are the processes still alive?
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a conversion rank died with exit code {dead[0].exitcode}")
                continue
            if status == "error":
                raise SpawnedRankError(rank, *payload)
            results[rank] = _load_result(payload)
            received += 1
    finally:
        for proc in procs:
            proc.join(timeout=5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        del store
    return results
