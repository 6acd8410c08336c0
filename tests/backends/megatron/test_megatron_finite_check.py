"""The non-finite gradient check reads the host once per update, not once per parameter
(`bool(isfinite(grad).all())` per parameter would be a device-to-host sync each, hundreds
per update at 32B). Host reads are counted
with a TorchFunctionMode (on a GPU each is a sync); the answer must not change.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dapo_mega.backends.megatron.learner import MegatronLearner, all_finite

HOST_READS = {"__bool__", "item", "__float__", "__int__", "__index__", "tolist", "numpy"}


class CountHostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += getattr(func, "__name__", "") in HOST_READS
        return func(*args, **(kwargs or {}))


def learner_with_grads(grads):
    """What `_grads_finite` reads of a learner: its DDP chunks' params' main_grad, and the
    all-reduce (one rank here)."""
    chunk = torch.nn.Module()
    for i, grad in enumerate(grads):
        param = torch.nn.Parameter(torch.zeros(grad.shape, dtype=grad.dtype))
        if grad.numel() or i % 2:  # an empty grad, or a parameter with none
            param.main_grad = grad
        chunk.register_parameter(f"p{i}", param)
    return SimpleNamespace(ddp_chunks=[chunk], _all_reduce_sum=lambda values: values)


def grads(bad=None, at=0, n=200):
    out = [torch.randn(3, 5) if i % 3 else torch.randn(7).bfloat16() for i in range(n)]
    out.insert(n // 2, torch.empty(0))
    if bad is not None:
        out[at].view(-1)[-1] = bad
    return out


@pytest.mark.parametrize("bad, at", [(None, 0), (float("nan"), 199), (float("inf"), 0), (float("-inf"), 57),
                                     (float("nan"), 1)])  # 1: a bfloat16 grad
def test_one_host_read_and_the_same_answer(bad, at):
    gs = grads(bad, at)
    expect = all(bool(torch.isfinite(g).all()) for g in gs)
    assert expect == (bad is None)
    learner = learner_with_grads(gs)
    with CountHostReads() as counter:
        got = MegatronLearner._grads_finite(learner)
    assert got == expect
    assert counter.reads <= 1, f"{counter.reads} host reads for {len(gs)} gradients"


def test_all_finite_edges():
    assert all_finite([]) and all_finite([torch.empty(0)])
    assert all_finite([torch.tensor([3e38, -3e38])])  # huge but finite: a 2-norm would overflow
    assert not all_finite([torch.ones(2), torch.tensor([float("nan")])])
