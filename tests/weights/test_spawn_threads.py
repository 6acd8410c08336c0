"""Conversion ranks size their torch threads from the CPUs they may run on (weights/spawn.py).

A Slurm stage with --cpus-per-task=16 on a 224-core node: `os.cpu_count()` says 224, so each of
16 ranks started 14 threads on what is one CPU each; the affinity says 16."""

from __future__ import annotations

import os

import pytest

from dapo_mega.weights.spawn import spawn_gloo, torch_threads_per_rank, usable_cpus


def _threads_and_cpus(rank: int, world_size: int) -> tuple:
    import torch

    return torch.get_num_threads(), len(os.sched_getaffinity(0))


def test_the_rule_is_an_even_share_of_the_cpus_given():
    assert [torch_threads_per_rank(cpus, world) for cpus, world in
            ((16, 16), (224, 16), (1, 16), (16, 1), (17, 4), (8, 0))] == [1, 14, 1, 16, 4, 8]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a CPU affinity of two CPUs or more to narrow")
def test_spawned_ranks_take_their_threads_from_the_affinity_not_the_machine():
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(saved)})  # what srun --cpus-per-task=1 leaves on a bigger machine
    try:
        assert usable_cpus() == 1
        results = spawn_gloo(_threads_and_cpus, 1)  # the children inherit the affinity
    finally:
        os.sched_setaffinity(0, saved)
    assert results == [(1, 1)]
