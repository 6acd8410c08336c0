"""Run a function in N gloo processes for tests (torch.multiprocessing spawn, free port).

    results = run_distributed(fn, world_size=2, args=(x,), timeout_s=120)

`fn(rank, world_size, *args)` runs in every process with torch.distributed initialised
(gloo, 127.0.0.1, a free port, env:// variables set so code under test may re-read them).
Each process's return value (picklable) comes back as `results[rank]`. An exception in any
process fails the caller with that process's traceback; a process still running after
`timeout_s` is killed and the call raises TimeoutError. Threads per process are limited
so N processes share the cores without oversubscription.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from typing import Any, Callable, List, Sequence

import torch.multiprocessing as mp


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: Sequence[Any], queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle, not the queue's ForkingPickler: tensors go by value instead of through
        # shared memory, which breaks when the sender exits before the parent reads.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, args: Sequence[Any] = (), timeout_s: float = 180.0) -> List[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned gloo processes; return results by rank.

    `fn` must be importable (a module-level function of a test module).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world_size, port, fn, tuple(args), queue), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results: List[Any] = [None] * world_size
    received = 0
    deadline = time.monotonic() + timeout_s
    try:
        while received < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed test did not finish within {timeout_s:.0f} s")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: check the processes are still alive
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a distributed test process died with exit code {dead[0].exitcode}")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
            received += 1
    finally:
        for proc in procs:
            proc.join(timeout=5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return results
