"""Run a conversion function in N local processes joined by a gloo process group.

`convert_checkpoint.py import/export/verify --tp N --pp M` on a machine without a
launcher spawns N·M processes here (one per model-parallel rank, CPU, gloo on
127.0.0.1 at a free port). Under torchrun/srun the tool is already one rank of a job and
does not spawn (see `convert.run_on_ranks`).
"""

from __future__ import annotations

import io
import os
import time
import traceback
from typing import Any, Callable, List, Sequence, TypeVar

T = TypeVar("T")
"""What the function run on each spawned rank returns."""


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., object], args: Sequence[object], queue) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
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
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes; results by rank.

    The environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE) is set so `fn` initialises
    torch.distributed with env://. The first failing rank's error is raised as
    SpawnedRankError; every process is joined or killed before returning.
    """
    import torch.multiprocessing as mp

    from dapo_mega.distributed import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, tuple(args), queue),
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
    return results
