"""Run a function in N gloo processes for tests.

    results = run_distributed(fn, world_size=2, args=(x,), timeout_s=120)

`fn(rank, world_size, *args)` runs in every process with the env:// variables set (code
under test initialises torch.distributed from them, as `ParallelLayout.initialize` does).
A thin wrapper of the package's own `dapo_mega.weights.spawn.spawn_gloo`, which the
conversion tool uses too; `fn` must be importable (a module-level function of a test module).
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

from dapo_mega.weights.spawn import spawn_gloo


def run_distributed(fn: Callable, world_size: int, args: Sequence[Any] = (), timeout_s: float = 180.0) -> List[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned gloo processes; results by rank."""
    return spawn_gloo(fn, world_size, args=args, timeout_s=timeout_s)
