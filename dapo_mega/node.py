"""What a process reads of its machine, in one place a twin can set.

A shipped recipe runs on 112-core GPU nodes; its twin runs the same switches on a 2-core CPU.
Everything that sizes itself by the node (the sandbox's process limits and the numerical
libraries' threads, the tool executor, the plan) reads the node here, and a twin sets what the node would be through environment
variables that every child process inherits:

    DAPO_MEGA_NODE_CPUS=112     the cores this process may use (default: its CPU affinity,
                                which Slurm's --cpus-per-task, taskset or a cgroup leave it)

Torch's own threads are not sized here: they follow the real affinity
(`weights/spawn.usable_cpus`), so a twin's 112 claimed cores never start 112 threads on 2.

Reading stays cheap and pure: `node_cpus(env)` takes the environment as an argument for
tests, and the process's own by default.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

NODE_CPUS_ENV = "DAPO_MEGA_NODE_CPUS"
"""The core count a twin gives its processes (a 112-core node on a 2-core CI machine)."""


def node_cpus(env: Optional[Mapping[str, str]] = None) -> int:
    """CPUs of the node as this process may use them: `DAPO_MEGA_NODE_CPUS` where a twin sets it, else its
    affinity (not the machine's count: `os.cpu_count()` on a 224-core node with a 16-CPU
    allocation would start 14 threads per rank on one CPU each)."""
    env = os.environ if env is None else env
    value = env.get(NODE_CPUS_ENV, "").strip()
    if value:
        try:
            cpus = int(value)
        except ValueError:
            raise ValueError(f"{NODE_CPUS_ENV}={value!r}: not a whole number of CPUs") from None
        if cpus < 1:
            raise ValueError(f"{NODE_CPUS_ENV}={value!r}: a node has at least one CPU")
        return cpus
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS)
        return os.cpu_count() or 1
