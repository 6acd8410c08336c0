"""The weight syncer's side of SGLang's update protocol, without a GPU (issue 12, defect 2).

NCCL broadcasts GPU tensors only, and SGLang receives into a buffer on its own device, so the
flat bucket the learner broadcasts must live on the parameters' device. Parameters on the
`meta` device stand in for a GPU: the old CPU buffer cannot even be filled from them. The
update session (defect 1) is checked against real SGLang in test_conformance.py.
"""

import torch

from dapo_mega.weights import sync as sync_module
from dapo_mega.weights.sync import WeightSyncer


class _DoneWork:
    def is_completed(self):
        return True

    def wait(self):
        return True


def test_flat_broadcast_buffer_is_on_the_parameters_device(monkeypatch):
    sent = []

    def fake_broadcast(tensor, src, group=None, async_op=False):
        sent.append(tensor)
        return _DoneWork()

    monkeypatch.setattr(sync_module.torch.distributed, "broadcast", fake_broadcast)
    syncer = WeightSyncer(["http://127.0.0.1:9"], mode="distributed", timeout_s=5)
    try:
        syncer.group, syncer.group_name = object(), "g"  # the engines' replies are not awaited here
        bucket = [("a.weight", torch.empty(4, 8, device="meta")), ("b.weight", torch.empty(3, device="meta",
                                                                                            dtype=torch.bfloat16))]
        syncer._send_bucket_distributed(bucket, None)
        cpu_bucket = [("a.weight", torch.ones(2, 2))]
        syncer._send_bucket_distributed(cpu_bucket, None)
    finally:
        syncer.close()
    assert sent[0].device.type == "meta" and sent[0].dtype == torch.uint8 and sent[0].numel() == 4 * 8 * 4 + 3 * 2
    assert sent[1].device.type == "cpu" and torch.equal(sent[1].view(torch.float32), torch.ones(4))
