"""The weight syncer's side of SGLang's update protocol, without a GPU.

NCCL broadcasts GPU tensors only, and SGLang receives into a buffer on its own device, so the
flat bucket the learner broadcasts must live on the parameters' device. Parameters on the
`meta` device stand in for a GPU: the old CPU buffer cannot even be filled from them. The
update session is checked against real SGLang in test_conformance.py.
"""

import pytest
import torch

from dapo_mega.weights import sync as sync_module
from dapo_mega.weights.sync import WeightSyncer


class _DoneWork:
    def is_completed(self):
        return True

    def wait(self):
        return True


def _accept_posts(syncer, log=None):
    """The engines' replies, without engines: every bucket's POST succeeds (and is logged)."""
    for client in syncer.clients:
        async def update(names, *args, **kwargs):
            if log is not None:
                log.append(("post", names[0]))
            return {"success": True}
        client.update_weights_from_distributed = update


def test_flat_broadcast_buffer_is_on_the_parameters_device(monkeypatch):
    sent = []

    def fake_broadcast(tensor, src, group=None, async_op=False):
        sent.append(tensor)
        return _DoneWork()

    monkeypatch.setattr(sync_module.torch.distributed, "broadcast", fake_broadcast)
    # NCCL broadcasts the parameters' own device (meta stands in for a GPU here)
    syncer = WeightSyncer(["http://127.0.0.1:9"], mode="distributed", backend="nccl", timeout_s=5)
    try:
        syncer.group, syncer.group_name = object(), "g"
        _accept_posts(syncer)
        bucket = [("a.weight", torch.empty(4, 8, device="meta")), ("b.weight", torch.empty(3, device="meta",
                                                                                            dtype=torch.bfloat16))]
        syncer.sync(iter(bucket), None, pause=False)
        cpu_bucket = [("a.weight", torch.ones(2, 2))]
        syncer.sync(iter(cpu_bucket), None, pause=False)
    finally:
        syncer.close()
    assert sent[0].device.type == "meta" and sent[0].dtype == torch.uint8 and sent[0].numel() == 4 * 8 * 4 + 3 * 2
    assert sent[1].device.type == "cpu" and torch.equal(sent[1].view(torch.float32), torch.ones(4))


def test_gloo_group_broadcasts_a_host_copy_of_gpu_parameters(monkeypatch):
    """A gloo group (the embedded CPU engine beside GPU learners) broadcasts host memory:
    the bucket is flattened on the CPU whatever device the parameters live on (meta stands
    in for a GPU; its host copy reads as zeros)."""
    sent = []
    monkeypatch.setattr(sync_module.torch.distributed, "broadcast",
                        lambda tensor, src, group=None, async_op=False: sent.append(tensor) or _DoneWork())
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if self.is_meta and torch.device(target).type == "cpu":
            return torch.zeros(self.shape, dtype=self.dtype)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    syncer = WeightSyncer(["http://127.0.0.1:9"], mode="distributed", backend="gloo", timeout_s=5)
    try:
        syncer.group, syncer.group_name = object(), "g"
        _accept_posts(syncer)
        syncer.sync(iter([("a.weight", torch.empty(4, 8, device="meta"))]), None, pause=False)
    finally:
        syncer.close()
    assert sent[0].device.type == "cpu" and sent[0].numel() == 4 * 8 * 4 and not sent[0].any()


class _SlowWork:
    """A broadcast in flight until it is polled twice; checks its buffer was not touched meanwhile."""

    def __init__(self, tensor, log, key):
        self.tensor, self.snapshot, self.log, self.key, self.polls = tensor, tensor.clone(), log, key, 0

    def is_completed(self):
        self.polls += 1
        if self.polls < 2:
            return False
        assert torch.equal(self.tensor, self.snapshot), f"buffer of bucket {self.key} changed while in flight"
        self.log.append(("done", self.key))
        return True

    def wait(self):
        return True


def test_next_bucket_is_flattened_while_the_current_one_is_broadcast(monkeypatch):
    """Pipelining: bucket k+1 is flattened (into the other buffer) before broadcast k completes;
    POST k+1 only after it has (SGLang serves update requests in arrival order); every
    broadcast carries exactly its own bucket's bytes."""
    log, sent = [], []

    def fake_broadcast(tensor, src, group=None, async_op=False):
        key = len(sent)
        sent.append(tensor.clone())
        log.append(("bcast", key))
        return _SlowWork(tensor, log, key)

    monkeypatch.setattr(sync_module.torch.distributed, "broadcast", fake_broadcast)
    tensors = [(f"t{i}", torch.full((8,), float(i))) for i in range(5)]  # 32 bytes each: one per bucket
    syncer = WeightSyncer(["http://127.0.0.1:9"], mode="distributed", bucket_mb=40 / (1 << 20), timeout_s=5)
    flatten = syncer._flatten

    def logged_flatten(bucket, slot):
        log.append(("flatten", bucket[0][0]))
        return flatten(bucket, slot)

    try:
        syncer.group, syncer.group_name = object(), "g"
        _accept_posts(syncer, log)
        syncer._flatten = logged_flatten
        stats = syncer.sync(iter(tensors), "7", pause=False)
    finally:
        syncer.close()
    assert stats.num_buckets == 5 and stats.bytes == 5 * 32
    for i, flat in enumerate(sent):
        assert torch.equal(flat.view(torch.float32), tensors[i][1])
    order = [e for e in log if e[0] != "post"]
    for k in range(1, 5):
        assert order.index(("flatten", f"t{k}")) < order.index(("done", k - 1)) < order.index(("bcast", k))
        assert log.index(("done", k - 1)) < log.index(("post", f"t{k}"))


def _fake_session(syncer, log, fail_pause=False):
    """Pause/flush/begin/end/continue of every engine, logged; the pause takes a while."""
    import asyncio

    for client in syncer.clients:
        async def pause_generation(mode):
            await asyncio.sleep(0.05)
            if fail_pause:
                raise RuntimeError("pause refused")
            log.append(("pause",))

        async def step(name):
            log.append((name,))

        client.pause_generation = pause_generation
        client.flush_cache = lambda: step("flush")
        client.begin_weight_update = lambda: step("begin")
        client.end_weight_update = lambda: step("end")
        client.continue_generation = lambda: step("continue")


def test_pause_overlaps_the_first_bucket_but_nothing_is_sent_before_it(monkeypatch):
    log = []

    def fake_broadcast(tensor, src, group=None, async_op=False):
        log.append(("bcast",))
        return _DoneWork()

    monkeypatch.setattr(sync_module.torch.distributed, "broadcast", fake_broadcast)
    tensors = [(f"t{i}", torch.full((8,), float(i))) for i in range(3)]
    syncer = WeightSyncer(["http://127.0.0.1:9"], mode="distributed", bucket_mb=40 / (1 << 20), timeout_s=5)
    try:
        syncer.group, syncer.group_name = object(), "g"
        _accept_posts(syncer, log)
        _fake_session(syncer, log)
        syncer.sync(iter(tensors), "1")
        names = [e[0] for e in log]
        assert names[:3] == ["pause", "flush", "begin"] and names[-2:] == ["end", "continue"]
        assert names.count("post") == 3 and names.count("bcast") == 3

        log.clear()
        _fake_session(syncer, log, fail_pause=True)
        with pytest.raises(Exception, match="pause refused"):
            syncer.sync(iter(tensors), "2")
        assert log == []  # no bucket sent, and engines this sync did not pause are not continued
    finally:
        syncer.close()
