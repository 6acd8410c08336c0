"""A trainer started by hand (one process, no launcher) initialises torch.distributed on a
port nobody can take from it first (driver/learner_ranks.py `init_world_env`)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import socket
import torch.distributed as dist
from dapo_mega import distributed
from dapo_mega.driver import learner_ranks

held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen()
taken = held.getsockname()[1]
# every port found free is taken by another process before the trainer binds it
distributed.free_port = learner_ranks.__dict__["free_port"] = lambda host="127.0.0.1": taken
assert learner_ranks.init_world_env() == 1
dist.init_process_group("gloo")
print("initialised", dist.get_world_size())
"""


def test_a_single_trainer_process_binds_no_port_found_free_before():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "initialised 1" in out.stdout, out.stderr[-2000:]
