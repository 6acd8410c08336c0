"""The Slurm engines role's watch: an engine that exits is restarted at its port, a bounded
number of times, so a job outlives an engine.

    watch = EngineWatch(fleet, cfg.rollout, on_healthy=announce)
    while True:
        status = watch.check()          # None: every engine runs (some perhaps restarted)
        if status is not None:
            return status               # an engine past its restarts: the task's exit status
        time.sleep(0.25)

Why at its port: the trainer knows an engine by its URL (the registry file it read at start,
the engine book's dead list). A restarted engine that answers at that URL is found by the
engine book's `probe_dead` before the next weight sync, gets that sync's weights, and only
then serves rollouts (`driver/policy_sync.py`). One that exits before the trainer noticed the
loss (during the learner's step) no longer holds the weight-update group: the next sync names
it lost and treats it the same way (`weights/sync.py` `EngineLostError`).

Each restart is logged with the engine's exit status and the tail of its log; an engine that
exits more than `max_restarts` times in one job (or whose restart does not start) ends the
role with the status of its last exit, and the sbatch script then ends the job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

from dapo_mega import log
from dapo_mega.engines.fleet import MAX_PORT_RETRIES
from dapo_mega.engines.process import EngineProcess, EngineStartError

if TYPE_CHECKING:
    from dapo_mega.config import RolloutConfig

logger = log.get(__name__)


def exit_status(rc: Optional[int]) -> int:
    """The task's exit status for a process that ended with `rc` (128 + signal, as a shell
    reports it; a clean exit of an engine that should run is still a failure: 1)."""
    if rc is None:
        return 1
    if rc < 0:
        return 128 + (-rc)
    return rc if rc != 0 else 1


def describe_exit(rc: Optional[int]) -> str:
    """'signal 9' or 'status 3'."""
    if rc is None:
        return "an unknown status"
    return f"signal {-rc}" if rc < 0 else f"status {rc}"


@dataclass
class RestartBudget:
    """Restarts left to each engine of one engines role (a pure rule, tested alone): at most
    `max_restarts` per engine, counted over the last `window_s` seconds (0: the whole job)."""

    max_restarts: int
    window_s: float = 0.0
    clock: Callable[[], float] = time.monotonic
    used: Dict[int, List[float]] = field(default_factory=dict)
    """Engine index -> when each of its counted restarts was taken."""

    def take(self, index: int) -> bool:
        """Spend one restart of engine `index`; False when it has none left."""
        now = self.clock()
        times = [t for t in self.used.get(index, []) if not self.window_s or now - t < self.window_s]
        self.used[index] = times
        if len(times) >= self.max_restarts:
            return False
        times.append(now)
        return True

    def spent(self, index: int) -> int:
        return len(self.used.get(index, []))

    @property
    def scope(self) -> str:
        """Where the restarts are counted, for the role's log."""
        return f"in the last {self.window_s:g} s" if self.window_s else "in this job"

    @classmethod
    def from_config(cls, rollout: "RolloutConfig") -> "RestartBudget":
        """The budget the rollout section sets (rollout.engine_restarts, .engine_restart_window_s)."""
        return cls(rollout.engine_restarts, rollout.engine_restart_window_s)


class EngineWatch:
    """Watches the engines a fleet started and restarts those that exit (module docstring)."""

    def __init__(self, fleet, rollout: "RolloutConfig", on_healthy: Optional[Callable[[EngineProcess], None]] = None,
                 say: Optional[Callable[[str], None]] = None):
        """`fleet`: the `engines.fleet.EngineFleet` that started them; `rollout`: the run's
        rollout section (its restart budget, `RestartBudget.from_config`). `on_healthy`: called
        with each restarted engine once it answers /health (the role announces it again).
        `say`: a line of the role's log (default: this module's logger, on every rank)."""
        self.fleet = fleet
        self.budget = RestartBudget.from_config(rollout)
        self.on_healthy = on_healthy
        self.say = say or (lambda message: logger.warning(message, extra=log.EVERY_RANK))
        self.restarts: List[int] = []
        """Engine indices restarted, in order (one entry per restart)."""

    def check(self) -> Optional[int]:
        """Restart every engine found exited; None when all run again, else the exit status
        the role ends with (an engine past its restarts, or one whose restart failed)."""
        for engine in self.fleet.dead():
            status = self._restart(engine)
            if status is not None:
                return status
        return None

    def _restart(self, engine: EngineProcess) -> Optional[int]:
        rc = engine.proc.returncode
        while True:
            tail = engine.log_tail(20)
            if not self.budget.take(engine.index):
                self.say(f"engine {engine.index} ({engine.url}, pid {engine.pid}) exited with {describe_exit(rc)}; it "
                         f"was restarted {self.budget.spent(engine.index)} time(s) {self.budget.scope}, the most "
                         f"rollout.engine_restarts={self.budget.max_restarts} allows: ending the engines role "
                         f"(and the job). Last lines of {engine.log_path}:\n{tail}")
                return exit_status(rc)
            self.say(f"engine {engine.index} ({engine.url}, pid {engine.pid}) exited with {describe_exit(rc)}; "
                     f"restarting it at its port {engine.port} (restart {self.budget.spent(engine.index)} of "
                     f"{self.budget.max_restarts}, rollout.engine_restarts). Last lines of {engine.log_path}:\n{tail}")
            engine = self.fleet.spawn(engine.index, engine.gpu_ids, engine.base_gpu_id, port=engine.port)
            engine.port_retries = MAX_PORT_RETRIES  # its URL is what the trainer knows: never another port
            try:
                self.fleet.wait_healthy([engine])
            except EngineStartError as exc:
                self.say(f"engine {engine.index}: its restart did not start: {exc}")
                rc = engine.proc.poll()
                if rc is None:  # not healthy in time: stop it before the next try takes its port
                    engine.kill()
                    rc = engine.proc.returncode
                continue
            self.restarts.append(engine.index)
            self.say(f"engine {engine.index} restarted (pid {engine.pid}) at {engine.url}; the trainer syncs the "
                     "current weights into it before it serves")
            if self.on_healthy is not None:
                self.on_healthy(engine)
            return None
