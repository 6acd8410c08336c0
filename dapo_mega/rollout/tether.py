"""Run a command that ends with the process that started it.

    python -I -S tether.py PARENT_PID COMMAND [ARG ...]

The fleet starts every engine through this file, so an engine does not outlive a trainer
that is SIGKILLed or crashes (a plain child would keep serving, holding its port and its GPU
memory). It asks the kernel for SIGTERM when the thread that started it exits
(PR_SET_PDEATHSIG, which survives exec) and then replaces itself with COMMAND: the engine
keeps this process's pid, so the fleet stops, kills and pauses it as before. The fleet starts
engines from one thread that lives as long as the process (see `fleet.spawn`), because the
kernel ties the signal to the starting thread, not to its process.

Standard library only, and it imports nothing from the package: the trainer's interpreter
runs it by path, before the engine's own interpreter (`rollout.engine_python`, SGLang's venv
say) is exec'd. Where prctl does not exist (not Linux) it only execs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

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
