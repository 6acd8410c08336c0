"""dapo_mega/distributed.py: the backend -> device rule, and the helpers on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_distributed

from dapo_mega import distributed as D


@pytest.mark.parametrize("backend, device", [
    ("nccl", "cuda"),            # NCCL moves CUDA tensors only: a CPU flag there is refused
    ("gloo", "cpu"),
    ("GLOO", "cpu"),
    ("mpi", "cpu"),
    ("cpu:gloo,cuda:nccl", "cpu"),  # a group with both: CPU tensors go to gloo, no copy
    ("cuda:nccl", "cuda"),
])
def test_collective_device_type_of_backend(backend, device):
    assert D.collective_device_type(backend) == device


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="'smoke-signals'"):
        D.collective_device_type("smoke-signals")


def test_helpers_are_no_ops_in_one_process():
    assert not torch.distributed.is_initialized()
    D.barrier()
    assert D.broadcast_object({"a": 1}, src=0) == {"a": 1}
    assert D.any_rank_true(True) is True and D.any_rank_true(False) is False
    assert D.all_reduce_sum([1.5, 2]) == [1.5, 2.0]
    assert (D.rank(), D.world_size()) == (0, 1)


def _helpers_on_ranks(rank: int, world_size: int):
    torch.distributed.init_process_group("gloo")
    out = {"device": str(D.collective_device())}
    D.barrier()
    out["from_1"] = D.broadcast_object({"rank": rank, "tmp": f"/tmp/x-{rank}"} if rank == 1 else None, src=1)
    out["any_only_rank0"] = D.any_rank_true(rank == 0)
    out["any_none"] = D.any_rank_true(False)
    out["sums"] = D.all_reduce_sum([rank + 1, 0.5])
    sub = torch.distributed.new_group([1])  # a group this rank may not belong to is not touched
    out["sub_world"] = D.world_size(sub) if rank == 1 else None
    return out


def test_helpers_on_two_gloo_ranks():
    results = run_distributed(_helpers_on_ranks, world_size=2, timeout_s=120)
    for out in results:
        assert out["device"] == "cpu"
        assert out["from_1"] == {"rank": 1, "tmp": "/tmp/x-1"}
        assert out["any_only_rank0"] is True and out["any_none"] is False
        assert out["sums"] == [3.0, 1.0]
    assert results[1]["sub_world"] == 1
