"""CUDA IPC payloads for `/update_weights_from_tensor`, checked on a CPU.

SGLang 0.5.23's TP rank r unpickles only `serialized_named_tensors[r]` (tp_worker
`deserialize_own_rank`), so the request carries one payload per engine TP rank, each built
from tensors on that rank's own GPU; and both sides patch torch's reductions to name a GPU
by UUID (utils/patch_torch.py), because device indices differ between processes whose
CUDA_VISIBLE_DEVICES differ.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from dapo_mega.wire import transport


def _bucket(scale: float):
    return [("model.layers.0.mlp.up_proj.weight", torch.full((4, 2), scale)),
            ("model.norm.weight", torch.full((2,), scale))]


def test_one_payload_per_engine_tp_rank_from_that_ranks_tensors():
    per_rank = [_bucket(0.0), _bucket(1.0), _bucket(2.0), _bucket(3.0)]
    payloads = transport.build_tp_payloads(per_rank, serialize=lambda items: items)
    assert len(payloads) == 4
    for r, payload in enumerate(payloads):
        assert [n for n, _ in payload] == [n for n, _ in per_rank[0]]
        assert all(t is u for (_, t), (_, u) in zip(payload, per_rank[r])), "rank r gets rank r's own tensors"


def test_payloads_refuse_mismatched_ranks_and_shared_devices():
    with pytest.raises(ValueError, match="TP rank 1 would get other tensors"):
        transport.build_tp_payloads([_bucket(0.0), _bucket(1.0)[:1]], serialize=lambda items: items)
    with pytest.raises(ValueError, match="share a device"):
        transport.build_tp_payloads([_bucket(0.0), _bucket(1.0)], devices=["cpu", "cpu"], serialize=lambda i: i)
    with pytest.raises(ValueError, match="TP rank 1 is on meta"):
        transport.build_tp_payloads([_bucket(0.0), _bucket(1.0)], devices=["cpu", "meta"], serialize=lambda i: i)
    with pytest.raises(ValueError, match="no engine TP rank"):
        transport.build_tp_payloads([])


def test_device_travels_by_uuid_between_processes_with_different_visible_devices():
    learner_sees = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]  # CUDA_VISIBLE_DEVICES unset: 4 GPUs
    engine_sees = ["GPU-c", "GPU-d"]  # the engine's CUDA_VISIBLE_DEVICES=2,3
    uuid = transport.device_to_uuid(2, uuid_of=lambda i: learner_sees[i])
    assert uuid == "GPU-c"
    assert transport.device_from_uuid(uuid, uuids=engine_sees) == 0  # learner's GPU 2 is the engine's GPU 0
    assert transport.device_from_uuid(1, uuids=engine_sees) == 1  # unpatched senders still work
    with pytest.raises(ValueError, match="no visible CUDA device has uuid GPU-a"):
        transport.device_from_uuid("GPU-a", uuids=engine_sees)


def test_device_argument_position_matches_torch():
    from torch.multiprocessing import reductions

    params = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    original = getattr(reductions, "_rebuild_cuda_tensor_original", None)
    if original is not None:
        params = list(inspect.signature(original).parameters)
    assert params[transport.REDUCE_TENSOR_ARG_DEVICE_INDEX] == "storage_device"


def test_patched_reductions_map_devices_and_leave_cpu_tensors_alone(monkeypatch):
    from torch.multiprocessing import reductions

    saved = {k: getattr(reductions, k) for k in ("reduce_tensor", "rebuild_cuda_tensor")}
    had_patch = hasattr(reductions, "_reduce_tensor_original")
    try:
        if had_patch:  # someone (SGLang or an earlier test) patched already: the same attribute names
            reductions.reduce_tensor = reductions._reduce_tensor_original
            reductions.rebuild_cuda_tensor = reductions._rebuild_cuda_tensor_original
            del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
        transport.patch_torch_reductions()
        patched = reductions.rebuild_cuda_tensor
        transport.patch_torch_reductions()  # idempotent
        assert reductions.rebuild_cuda_tensor is patched
        fn, args = reductions.reduce_tensor(torch.ones(3))
        assert fn is not patched  # CPU tensors are pickled as before
        seen = []
        monkeypatch.setattr(reductions, "_rebuild_cuda_tensor_original", lambda *a: seen.append(a) or "tensor")
        monkeypatch.setattr(transport, "device_from_uuid", lambda d: {"GPU-c": 0}[d] if isinstance(d, str) else d)
        args = ["cls", (2,), (1,), 0, "storage", torch.float32, "GPU-c", b"handle"]
        assert patched(*args) == "tensor" and seen[0][6] == 0 and seen[0][7] == b"handle"
    finally:
        monkeypatch.undo()
        for k, v in saved.items():
            setattr(reductions, k, v)
        if not had_patch:
            for k in ("_reduce_tensor_original", "_rebuild_cuda_tensor_original"):
                if hasattr(reductions, k):
                    delattr(reductions, k)
        reductions.init_reductions()
