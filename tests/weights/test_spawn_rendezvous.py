"""Ranks spawned for conversion meet at a store their parent hosts (weights/spawn.py).

Rank 0 used to bind MASTER_PORT itself, a port the parent had only found free: another
test worker took it meanwhile and the conversion failed with EADDRINUSE (seen in CI).
"""

from __future__ import annotations

import errno
import os
import socket

import torch

from dapo_mega.weights.spawn import spawn_gloo


def _bind_master_port_then_all_reduce(rank: int, world_size: int) -> tuple:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
            held = False
        except OSError as exc:
            held = exc.errno == errno.EADDRINUSE
    torch.distributed.init_process_group("gloo")
    t = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(t)
    return held, float(t)


def test_ranks_meet_at_a_port_held_from_before_they_start():
    results = spawn_gloo(_bind_master_port_then_all_reduce, 2)
    assert results == [(True, 3.0), (True, 3.0)]  # the port was never free for anyone to take
