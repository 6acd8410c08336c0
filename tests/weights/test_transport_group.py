"""`transport.init_custom_process_group` (the learner's side of a weight-update group) under
torchrun: torch's `tcp://` rendezvous makes every rank a client there
(TORCHELASTIC_USE_AGENT_STORE=True), so the learner, rank 0 of the group, must host the
store itself or the engines wait out the timeout.

A group still referenced by a module global is freed only at interpreter shutdown, after
torch's native teardown has begun; CI once saw the store's host abort there ("terminate
called without an active exception", exit -6) after a good broadcast. The trainer and the
engine free their groups while running (`WeightSyncer.destroy_group`, the server's
`destroy_group`), and so does this test.

The group is built with NCCL's watchdog told to leave it alone (TORCH_NCCL_ASYNC_ERROR_HANDLING=0,
torch's `_abort_process_group` note), and the process's own setting is back afterwards."""

import os
import subprocess
import sys

from dapo_mega.distributed import free_port

MEMBER = """
import sys
from datetime import timedelta
import torch
from dapo_mega.wire import transport

def member(rank, port):  # the group is a local, freed on return, as WeightSyncer.destroy_group frees it
    pg = transport.init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, rank, "dapo_weight_sync_pp0",
                                             timeout=timedelta(seconds=20))
    t = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    torch.distributed.broadcast(t, src=0, group=pg)
    print("got", t.tolist(), flush=True)
    transport.destroy_custom_process_group(pg)

member(int(sys.argv[1]), int(sys.argv[2]))
"""


def test_group_forms_when_the_learner_rank_runs_under_torchrun():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # rank 0: a learner rank started by torchrun; rank 1: an engine, started outside it
    learner = subprocess.Popen([sys.executable, "-c", MEMBER, "0", str(port)], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**env, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    engine = subprocess.Popen([sys.executable, "-c", MEMBER, "1", str(port)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    outs = [p.communicate(timeout=120)[0] for p in (learner, engine)]
    assert [p.returncode for p in (learner, engine)] == [0, 0], outs
    assert all("got [0.0, 1.0, 2.0, 3.0]" in out for out in outs), outs


def test_the_group_is_built_with_nccl_error_handling_off_and_the_learners_back(monkeypatch):
    from torch.distributed import distributed_c10d

    from dapo_mega.wire import transport

    seen = []
    build = distributed_c10d._new_process_group_helper

    def watched(*args, **kwargs):  # the real constructor, with the value it reads recorded
        seen.append(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
        return build(*args, **kwargs)

    monkeypatch.setattr(distributed_c10d, "_new_process_group_helper", watched)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the learner's (distributed.learner_process_env)
    pg = transport.init_custom_process_group("gloo", f"tcp://127.0.0.1:{free_port()}", 1, 0, "dapo_weight_sync_t")
    transport.destroy_custom_process_group(pg)
    assert seen == ["0"] and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
