"""Child processes that end with the process that started them.

    proc = popen_tethered([python, "-m", "sglang.launch_server", ...], stdout=log, env=env)

runs `python -I -S tether.py THIS_PID COMMAND...`: this file, run as a script, asks the
kernel for SIGTERM when its parent exits (PR_SET_PDEATHSIG, which survives exec) and then
replaces itself with COMMAND, so the child keeps the pid `proc` names and is stopped, killed
and paused as before. Rollout engines (`engines/fleet.py`) and verifier workers
(`reward/scoring.py`) start this way: a trainer that is SIGKILLed or crashes leaves no engine
serving on its port and GPU, and no verifier worker spinning in a hung verifier.

The kernel sends the signal when the *thread* that forked the child exits, not its process,
so every tethered child is started by one thread that lives as long as the process
(`_Spawner`). Standard library only, and the script part imports nothing from the package:
the trainer's interpreter runs it by path before the child's own interpreter (an engine's
`rollout.engine_python`, SGLang's venv say) is exec'd. Where prctl does not exist (not
Linux) it only execs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Sequence

PR_SET_PDEATHSIG = 1
"""linux/prctl.h"""

PARENT_GONE_EXIT = 75
"""Exit status when the parent died before the tether was tied (EX_TEMPFAIL)."""


def tie_to_parent(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Ask for `sig` when the starting thread exits; False when the parent is already gone
    (this process was re-parented before the request took effect, so it would never come)."""
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = getattr(libc, "prctl", None)
    if prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    return os.getppid() == parent_pid


class _Spawner:
    """The one thread of this process that starts tethered children (see the module docstring).
    A forked child starts its own on first use (the parent's thread does not exist there)."""

    def __init__(self) -> None:
        self._pid = -1
        self._jobs: SimpleQueue = SimpleQueue()
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._jobs = os.getpid(), SimpleQueue()
                threading.Thread(target=self._serve, args=(self._jobs,), name="tethered-spawner", daemon=True).start()
            jobs = self._jobs
        done: Future = Future()
        jobs.put(([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), *argv], kwargs, done))
        return done.result()

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1

    @staticmethod
    def _serve(jobs: SimpleQueue) -> None:
        while True:
            argv, kwargs, done = jobs.get()
            try:
                done.set_result(subprocess.Popen(argv, **kwargs))
            except BaseException as e:  # handed to the caller, who raises it
                done.set_exception(e)


_SPAWNER = _Spawner()


def popen_tethered(argv: Sequence[str], **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(argv, **kwargs)`, but the child gets SIGTERM when this process dies."""
    return _SPAWNER.popen(argv, **kwargs)


def main(argv: list) -> int:
    if len(argv) < 3 or not argv[1].isdigit():
        print("usage: tether.py PARENT_PID COMMAND [ARG ...]", file=sys.stderr)
        return 2
    if not tie_to_parent(int(argv[1])):
        print(f"tether: parent {argv[1]} exited before {argv[2]} started; not starting it", file=sys.stderr)
        return PARENT_GONE_EXIT
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as e:
        print(f"tether: cannot run {argv[2]}: {e}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv))
