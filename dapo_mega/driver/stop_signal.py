"""A signal that asks the run to stop: a checkpoint at the end of the current step, then exit.

SIGUSR1 is Slurm's warning ahead of the time limit (`#SBATCH --signal=B:USR1@<seconds>`, sent
to the batch script, which forwards it to the learner step: `slurm/lib.sh`); SIGTERM is a
preemption or a `scancel`. Either one, on any learner rank, is recorded here, and the driver's
record decides for every rank at the end of the step (`roles.stop_reason`: one broadcast), so
all ranks save the same step and leave. A second SIGTERM ends the process at once (the
default action), for a user who does not want to wait for the step; once the checkpoint is
saved (`begin_close`, then a barrier of the ranks) SIGTERM is ignored by the operating system:
srun's `--kill-on-bad-exit` sends it to the ranks still closing when the first one exits 75,
and they finish with 75 too. The ignore is SIG_IGN, not a Python handler: Python resets its own
handlers to the default action late in interpreter shutdown, where a SIGTERM would still kill.

The trainer exits with EXIT_STOPPED, which says "checkpointed, not finished: run again to
resume" to the batch script and to a job chain (`slurm/chain.sh`, launch/pipeline.py: the next
link resumes). Handlers are installed from the main thread only (Python's rule) and restored
when the loop ends.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Dict

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
EXIT_STOPPED = 75
"""The trainer's exit status after a stop signal (EX_TEMPFAIL: saved, run again to resume)."""
WALL_TIME = "wall_time"
"""`stop_reason` when the run stops to fit `trainer.wall_time_minutes` (exit 0, as before)."""


class StopSignals:
    """Records the first of STOP_SIGNALS this process receives; `received` is its name."""

    def __init__(self) -> None:
        self.received = ""
        """"SIGUSR1" / "SIGTERM" once one arrived, else ""."""
        self.closing = False
        """Set by `begin_close` once the stop's checkpoint is saved."""
        self._previous: Dict[int, object] = {}

    def install(self) -> "StopSignals":
        """Catch STOP_SIGNALS from now on (a no-op off the main thread, where Python cannot)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        """The handlers from before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def begin_close(self) -> None:
        """The stop's checkpoint is saved: from now on SIGTERM cannot interrupt the close (SIG_IGN
        outlasts the interpreter's shutdown) and a late SIGUSR1 is only logged; `restore` no longer
        undoes it. Main thread only, like `install`."""
        self.closing = True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.closing:
            os.write(2, f"[trainer] {name} while closing after the checkpoint: finishing the close\n".encode())
            return
        if self.received and signum == signal.SIGTERM:  # asked twice: stop now, without the checkpoint
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.received = self.received or name
        # os.write: no lock is taken in a signal handler (the logger's could be held by this thread)
        os.write(2, f"[trainer] {name} received: saving a checkpoint at the end of this step, then stopping "
                    f"(exit {EXIT_STOPPED}; SIGTERM again stops at once)\n".encode())


def stop_message(reason: str, step: int, total_steps: int) -> str:
    """The driver's line when the loop stops early on a signal (the wall-time line is the trainer's)."""
    return (f"[trainer] stopped after step {step} of {total_steps} on {reason}: checkpoint step {step} saved; "
            f"exit {EXIT_STOPPED}, run again (the next job of the chain) to resume")
