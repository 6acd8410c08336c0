"""The colocated GPU hand-over's bytes, made and read on a CPU.

A learner rank makes engine TP rank r's payload from views of its bucket buffer
(`handover.cuda_ipc_payload`): the views pickled with torch's reductions, patched to name the
GPU by UUID (`transport.patch_torch_reductions`). SGLang 0.5.23's TP rank r reads payload r
with `SafeUnpickler`, which admits two names for the CUDA rebuild function
(`torch.multiprocessing.reductions.rebuild_cuda_tensor`, and its own patch's
`sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`), and maps the UUID back to its
own device index. The patch used to install a local closure: pickling any CUDA tensor raised
"Can't pickle local object", and the first colocated sync of every GPU run stopped there.

No GPU here: `gpus` makes torch's own `reduce_tensor` take a CPU tensor's storage for one on
learner GPU i (`_share_cuda_` answers with a handle naming the learner rank), so what is
pickled is the pair torch builds for a CUDA storage. On the SGLang side (the SGLang CPU
venv) torch's CUDA rebuild is only resolved by name and stood in for by a recorder;
everything before it — the tokenizer's payload normalisation, tp_worker
`deserialize_own_rank`, SafeUnpickler, SGLang's UUID-to-index mapping — is SGLang's own.
"""

from __future__ import annotations

import itertools
import json
import pickle
import subprocess
from types import SimpleNamespace
from typing import Dict, List

import pytest
import torch
from sglang_venv import sglang_python_or_skip

from dapo_mega.backends.placement import ClusterShape, place
from dapo_mega.config import load_config
from dapo_mega.engines.sglang.client import EngineClient
from dapo_mega.weights.handover import HandoverPlan, cuda_ipc_payload
from dapo_mega.weights.sync import WeightSyncer, WeightSyncError
from dapo_mega.wire import transport

TORCH_REBUILD = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
NODE_UUIDS = [f"GPU-node3-{i}" for i in range(8)]  # the learners see the node's 8 GPUs


class FakeCudaStorage:
    """What torch's `reduce_tensor` reads of a CUDA storage: its device and `_share_cuda_`."""

    def __init__(self, rank: int, index: int, real, ref_counts):
        self.device = torch.device("cuda", index)
        self.rank, self.index, self.real, self.ref_counts = rank, index, real, ref_counts

    def _share_cuda_(self):
        # as torch does, each share takes a slot of its own in the sender's reference counter
        handle = f"ipc:rank{self.rank}:{self.real.data_ptr()}".encode()
        return self.index, handle, self.real.nbytes(), 0, b"refcount", next(self.ref_counts), b"event", True


class Gpus:
    """`on(rank, index)`: tensors pickled from now on live on GPU `index` of learner `rank`."""

    def __init__(self, monkeypatch):
        self.rank, self.index, self.ref_counts = 0, 0, itertools.count()
        real_typed_storage = torch.Tensor._typed_storage

        def typed_storage(tensor):
            storage = real_typed_storage(tensor)
            storage._untyped_storage = FakeCudaStorage(self.rank, self.index, storage._untyped_storage,
                                                      self.ref_counts)
            return storage

        from torch.multiprocessing import reductions

        monkeypatch.setattr(torch.Tensor, "_typed_storage", typed_storage)
        monkeypatch.setattr(reductions, "shared_cache", {})  # it would keep weak refs to the fakes
        monkeypatch.setattr(reductions, "StorageWeakRef", lambda storage: None)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=NODE_UUIDS[i]))

    def on(self, rank: int, index: int) -> "Gpus":
        self.rank, self.index = rank, index
        return self


@pytest.fixture
def reductions_patched_here():
    """`transport.patch_torch_reductions` applied afresh, torch's reductions restored after."""
    from torch.multiprocessing import reductions

    names = ("reduce_tensor", "rebuild_cuda_tensor", "_reduce_tensor_original", "_rebuild_cuda_tensor_original")
    saved = {k: getattr(reductions, k) for k in names if hasattr(reductions, k)}
    if "_reduce_tensor_original" in saved:  # patched already (an earlier test): start from torch's own
        reductions.reduce_tensor = saved["_reduce_tensor_original"]
        reductions.rebuild_cuda_tensor = saved["_rebuild_cuda_tensor_original"]
        del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
    transport.patch_torch_reductions()
    try:
        yield
    finally:
        for k in names:
            if k in saved:
                setattr(reductions, k, saved[k])
            elif hasattr(reductions, k):
                delattr(reductions, k)
        reductions.init_reductions()


def bucket_views() -> List:
    """Named views of one flat bucket buffer, as `handover_learner_weights` hands them over."""
    names = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    dtypes, shapes = [torch.bfloat16, torch.float32], [[4, 2], [2]]
    metas, nbytes = transport.bucket_layout(names, dtypes, shapes)
    return transport.unflatten_bucket(torch.zeros(nbytes, dtype=torch.uint8), metas)


def engine_requests(experiment: List[str], engine: int, gpus: Gpus) -> List[str]:
    """The `serialized_named_tensors` engine `engine` gets in one bucket: every learner rank
    makes its payloads on its own GPU (`HandoverPlan.make_payloads`), the poster orders them."""
    cfg = load_config(experiment)
    placement = place(cfg, ClusterShape.from_config(cfg, use_gpu=True))
    ipc = {e.index: e.ipc_ranks for e in placement.engines}
    gathered: Dict[int, dict] = {}
    for rank in ipc[engine]:
        gpus.on(rank, placement.learner(rank).device.gpu)
        gathered[rank], _ = HandoverPlan.for_rank(rank, ipc).make_payloads(bucket_views(), cuda_ipc_payload)
    return HandoverPlan.for_rank(ipc[engine][0], ipc).request_payloads(gathered, engine)


class RecordingUnpickler(pickle.Unpickler):
    """Reads a payload as SGLang would, but records the globals it names and what the CUDA
    rebuild function would be called with (it is not called)."""

    def __init__(self, data: bytes):
        import io

        super().__init__(io.BytesIO(data))
        self.globals: List = []

    def find_class(self, module, name):
        self.globals.append((module, name))
        if (module, name) == TORCH_REBUILD:
            return lambda *args: {"device": args[transport.REDUCE_TENSOR_ARG_DEVICE_INDEX], "handle": args[7],
                                  "offset": args[3], "shape": list(args[1]), "dtype": str(args[5])}
        return super().find_class(module, name)


def test_cuda_payload_names_torchs_rebuild_and_the_gpu_by_uuid(monkeypatch, reductions_patched_here):
    Gpus(monkeypatch).on(rank=29, index=5)
    import base64

    payload, _ = cuda_ipc_payload(bucket_views())  # failed here: "Can't pickle local object"
    reader = RecordingUnpickler(base64.b64decode(payload))
    named = reader.load()
    assert [n for n, _ in named] == ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    assert {(m, n) for m, n in reader.globals if "rebuild_cuda" in n} == {TORCH_REBUILD}
    assert not [g for g in reader.globals if g[0].startswith("dapo_mega")]
    # the sending side names the GPU by UUID: the engine's index of learner GPU 5 is another
    assert [t["device"] for _, t in named] == ["GPU-node3-5", "GPU-node3-5"]
    assert [t["offset"] for _, t in named] == [0, 16 // 4]  # element offsets in the one buffer
    assert all(t["handle"].startswith(b"ipc:rank29:") for _, t in named)


@pytest.mark.parametrize("experiment, engine, ranks", [
    (["+experiment=dapo_qwen2.5_32b"], 7, (28, 29, 30, 31)),  # TP-4 engines on GPUs 4-7 of node 3
    (["+experiment=dapo_qwen2.5_32b", "rollout.engine_tp_size=2"], 3, (10, 11)),  # TP-2 on node 1 GPUs 2-3
])
def test_engine_tp_rank_r_gets_the_payload_made_on_its_gpu(monkeypatch, reductions_patched_here,
                                                           experiment, engine, ranks):
    import base64

    payloads = engine_requests(experiment, engine, Gpus(monkeypatch))
    assert len(payloads) == len(ranks) and len(set(payloads)) == len(ranks)  # one pickle per TP rank
    for tp_rank, (payload, rank) in enumerate(zip(payloads, ranks)):
        named = RecordingUnpickler(base64.b64decode(payload)).load()
        assert all(t["handle"].startswith(f"ipc:rank{rank}:".encode()) for _, t in named), (tp_rank, rank)


def test_one_process_sync_pickles_for_each_engine(monkeypatch, reductions_patched_here):
    """`WeightSyncer`'s own CUDA branch (one process, TP-1 engines): each engine gets a
    pickle of its own. It posted one to every engine."""
    Gpus(monkeypatch).on(rank=0, index=0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    posted = {}

    async def update_weights_from_tensor(self, payloads, load_format=None, weight_version=None, flush_cache=True):
        posted[self.url] = payloads
        return {"success": True}

    monkeypatch.setattr(EngineClient, "update_weights_from_tensor", update_weights_from_tensor)
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    syncer = WeightSyncer(urls, mode="colocated", cpu_tensor_format="sglang")
    try:
        syncer.sync([("model.norm.weight", torch.ones(2))], "1", pause=False)
    finally:
        syncer.close()
    assert sorted(posted) == urls and all(len(p) == 1 for p in posted.values())
    assert posted[urls[0]] != posted[urls[1]], "one pickle posted to both engines"
    tp2 = WeightSyncer(urls, mode="colocated", engine_tp_size=2, cpu_tensor_format="sglang")
    try:
        with pytest.raises(WeightSyncError, match="use weights.handover"):
            tp2.sync([("model.norm.weight", torch.ones(2))], "1", pause=False)
    finally:
        tp2.close()


SGLANG_TP_RANKS = r"""
import json, sys
from types import SimpleNamespace
import torch
from torch.multiprocessing import reductions
from sglang.srt.managers import tp_worker
from sglang.srt.utils import common
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

request = json.load(sys.stdin)
uuids = request["engine_uuids"]  # the engine's CUDA_VISIBLE_DEVICES, in its order
torch.cuda.device_count = lambda: len(uuids)
torch.cuda.get_device_properties = lambda i: SimpleNamespace(uuid=uuids[i])
monkey_patch_torch_reductions()  # what the engine's TP workers run (deserialize_own_rank does too)
reductions._rebuild_cuda_tensor_original = lambda *a: {"device": a[6], "handle": a[7].decode(), "offset": a[3]}
resolved = []
find_class = common.SafeUnpickler.find_class
def recording_find_class(self, module, name):
    found = find_class(self, module, name)  # raises "Blocked unsafe global" for what it refuses
    resolved.append([module, name, getattr(found, "__module__", None), getattr(found, "__name__", None)])
    return found
common.SafeUnpickler.find_class = recording_find_class

payloads = common.normalize_serialized_named_tensor_payloads(request["payloads"])  # the tokenizer's step
out = []
for tp_rank in range(len(payloads)):
    tp_worker.get_parallel = lambda: SimpleNamespace(tp_rank=tp_rank)
    named = tp_worker.BaseTpWorker.deserialize_own_rank(None, payloads)
    out.append({"tensors": [[n, t] for n, t in named], "resolved": resolved[:]})
    resolved.clear()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.sglang
def test_sglang_tp_workers_read_the_handover_and_find_their_gpu(monkeypatch, reductions_patched_here):
    python = sglang_python_or_skip()
    payloads = engine_requests(["+experiment=dapo_qwen2.5_32b"], 7, Gpus(monkeypatch))
    engine_uuids = NODE_UUIDS[4:8]  # engine 7: CUDA_VISIBLE_DEVICES=4,5,6,7, its GPU 0 is the node's 4
    proc = subprocess.run([str(python), "-c", SGLANG_TP_RANKS], capture_output=True, text=True, timeout=300,
                          input=json.dumps({"engine_uuids": engine_uuids, "payloads": payloads}))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    ranks = json.loads(lines[0].removeprefix("RESULT "))
    assert len(ranks) == 4
    for tp_rank, got in enumerate(ranks):
        rebuilds = {(m, n) for m, n, _, _ in got["resolved"] if "rebuild_cuda" in n}
        assert rebuilds == {TORCH_REBUILD}, got["resolved"]
        # resolved to SGLang's patched rebuild, the one that maps a UUID to the engine's index
        assert {(fm, fn) for m, n, fm, fn in got["resolved"] if (m, n) == TORCH_REBUILD} == {
            ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")}
        assert [n for n, _ in got["tensors"]] == ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
        # TP rank r: the engine's own GPU r, memory the learner rank on that GPU handed over
        assert [t["device"] for _, t in got["tensors"]] == [tp_rank, tp_rank], (tp_rank, got)
        assert all(t["handle"].startswith(f"ipc:rank{28 + tp_rank}:") for _, t in got["tensors"])
