"""Colocated CPU sync in SGLang's own format (`WeightSyncer(cpu_tensor_format="sglang")`)
into two engines, twice, with the same parameter storages each time (as a learner's).

Each engine's scheduler is stood in for by a long-lived process that unpickles what the
syncer posts the way SGLang's does (base64, then torch's reductions over `file_system`
shared memory) and answers with the tensor's sum. With one payload posted to both engines,
the second sync failed in the engine: "unable to open shared memory object" (torch gives a
pickled storage one reference that its unpickler takes over; two unpicklers dropped the
sender's own and the file was unlinked) — found by tests/faults/test_faults_engines_sglang.py,
where it took the surviving real SGLang engine down.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dapo_mega.engines.sglang.client import EngineClient
from dapo_mega.weights.sync import WeightSyncer

SCHEDULER = r"""
import base64, pickle, sys
import torch
import torch.multiprocessing.reductions
torch.multiprocessing.set_sharing_strategy("file_system")
for line in sys.stdin:
    try:
        named = pickle.loads(base64.b64decode(line.strip()))
        print("ok " + " ".join(f"{n}={float(t.sum())}" for n, t in named), flush=True)
        del named
    except Exception as exc:
        print(f"error {type(exc).__name__}: {exc}", flush=True)
"""


@pytest.mark.parametrize("engine_tp_size", [1, 2])
def test_each_engine_and_tp_rank_gets_its_own_pickle(monkeypatch, engine_tp_size):
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    ranks = {(u, r): subprocess.Popen([sys.executable, "-c", SCHEDULER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
             for u in urls for r in range(engine_tp_size)}
    posted = []

    async def update_weights_from_tensor(self, payloads, load_format=None, weight_version=None, flush_cache=True):
        assert len(payloads) == engine_tp_size and load_format is None
        for r, payload in enumerate(payloads):
            proc = ranks[(self.url, r)]
            proc.stdin.write(payload + "\n")
            proc.stdin.flush()
            posted.append((self.url, r, proc.stdout.readline().strip()))
        return {"success": True}

    monkeypatch.setattr(EngineClient, "update_weights_from_tensor", update_weights_from_tensor)
    weight = torch.ones(64, 8)  # one storage, synced twice, changed in place between (an optimizer step)
    syncer = WeightSyncer(urls, mode="colocated", cpu_tensor_format="sglang", engine_tp_size=engine_tp_size)
    try:
        syncer.sync([("w", weight)], "1", pause=False)
        weight.mul_(3.0)
        syncer.sync([("w", weight)], "2", pause=False)
    finally:
        syncer.close()
        for proc in ranks.values():
            proc.stdin.close()
            proc.wait(timeout=30)
    expected = [f"ok w={64 * 8 * f}" for f in (1.0, 3.0) for _ in urls for _ in range(engine_tp_size)]
    assert [line for _, _, line in posted] == expected, posted
    assert sorted({(u, r) for u, r, _ in posted}) == sorted(ranks)
