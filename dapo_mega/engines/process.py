"""One engine process and the operating-system plumbing of the fleet (`fleet.py`): one
/health probe, whether the answer came from the engine's own process (`serves_its_port`),
stopping a process (SIGTERM, then SIGKILL), an engine's log tail, the registry file an
engine is announced in.

These are the only copies in the package: the trainer, the Slurm launcher, evaluation, the
benchmarks and the tests all reach them through the fleet or import them from here
(`free_port` lives in `dapo_mega.distributed`, with the other rendezvous helpers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Set

from dapo_mega import log
from dapo_mega.distributed import free_port
from dapo_mega.engines.sglang.endpoint import EngineEndpoint
from dapo_mega.run_files.checkpoints import write_text_atomic

if TYPE_CHECKING:
    from dapo_mega.config import RolloutConfig

__all__ = ["EngineProcess", "EngineStartError", "announce_engine", "announce_learners_ready", "wait_for_learners", "engine_incarnations", "free_port", "is_healthy", "listening_inodes",
           "log_tail", "lost_port_race", "resume_process", "socket_inodes", "stop_process"]

logger = log.get(__name__)

HEALTH_PROBE_TIMEOUT_S = 5.0
"""Per-request timeout of one /health probe (SGLang answers after ~1 s of work)."""


def is_healthy(endpoint: EngineEndpoint, timeout_s: float = HEALTH_PROBE_TIMEOUT_S) -> bool:
    """One GET /health: True on 200 within `timeout_s`."""
    request = urllib.request.Request(endpoint.url + "/health", headers=endpoint.headers())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s` (at once when 0); waits until it is reaped."""
    if proc.poll() is None:
        proc.terminate() if grace_s > 0 else proc.kill()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def log_tail(path: Optional[Path], lines: int = 30, offset: int = 0) -> str:
    """The last `lines` lines of a log, from byte `offset` on (what one process wrote)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except (OSError, TypeError):
        return "(no log)"


BIND_FAILED = "error while attempting to bind"
"""uvicorn's words (SGLang's HTTP server) when its port is taken."""


def lost_port_race(log_text: str) -> bool:
    """The engine died because its port (free when picked) was taken before it bound it."""
    text = log_text.lower()
    return "address already in use" in text or "errno 98" in text


def listening_inodes(port: int) -> Set[int]:
    """Inodes of the sockets listening on TCP `port` in this network namespace (none where
    /proc/net cannot be read: not Linux)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:  # sl local_address rem_address st ... inode: st 0A is LISTEN
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(f[9]))
    return found


def socket_inodes(pid: int) -> Set[int]:
    """Inodes of the sockets open in `pid` and its descendants (SGLang serves HTTP from its
    main process; a wrapper would serve from a child)."""
    inodes, todo, seen = set(), [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                link = os.readlink(f"/proc/{p}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
            for tid in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
        except OSError:  # exited meanwhile, or no /proc
            continue
    return inodes


def announce_engine(registry: Path, index: int, record: dict) -> Path:
    """Write `engine-<index>.json` whole (`run_files.checkpoints.write_text_atomic`): readers never see half a file."""
    registry.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(registry / f"engine-{index}.json", json.dumps(record), durable=False)


def engine_incarnations(rollout: "RolloutConfig") -> Dict[str, str]:
    """Engine url -> the process the engines role last announced at it ("pid P at T", from
    `engine-<i>.json` in `rollout.engine_registry`): a restart at the same address announces a
    new one. {} without a registry (engines started here, or attached by URL)."""
    if not rollout.engine_registry:
        return {}
    found = {}
    for path in Path(rollout.engine_registry).glob("engine-*.json"):
        try:
            record = json.loads(path.read_text())
            found[str(record["url"]).rstrip("/")] = f"pid {record['pid']} at {record['time']}"
        except (OSError, ValueError, KeyError):  # being replaced, or not an engine's record
            continue
    return found


class EngineStartError(RuntimeError):
    """An engine exited, or did not become healthy, at start; the message names its log."""


@dataclass
class EngineProcess:
    """One engine process the fleet started."""

    index: int
    """Engine index within the run (its log is engine-<index>.log)."""
    endpoint: EngineEndpoint
    proc: subprocess.Popen
    log_path: Path
    argv: List[str]
    env: Dict[str, str]
    """Variables set for this engine on top of the fleet's environment."""
    port: int
    gpu_ids: List[int] = field(default_factory=list)
    base_gpu_id: Optional[int] = None
    port_retries: int = 0
    log_offset: int = 0
    """Size of the log (appended to across restarts) when this process started."""

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; `kill(0)` is SIGKILL at once (a crash)."""
        resume_process(self.proc)
        stop_process(self.proc, grace_s)

    def log_tail(self, lines: int = 30) -> str:
        """The end of what this process (not an earlier start of the engine) wrote to its log."""
        return log_tail(self.log_path, lines, self.log_offset)

    def answers_health(self) -> bool:
        """/health answers 200 from this process's own socket. When another process answers at
        its port (it took the port, picked free, before this one bound it), this one is stopped
        and its log says the port was lost (`lost_port_race` reads that): False."""
        if not is_healthy(self.endpoint):
            return False
        if self.serves_its_port():
            return True
        self.kill(grace_s=5.0)
        with self.log_path.open("a") as log:
            log.write(f"[fleet] port {self.port}: address already in use: another process answers /health there\n")
        return False

    def serves_its_port(self) -> bool:
        """Whether the socket listening on its port belongs to this process (or a child): a
        port picked free can be taken by another server before the engine binds it, and that
        server's /health answer must not pass for the engine's. True where it cannot be told."""
        listening = listening_inodes(self.port)
        if not listening:  # no /proc/net, or another network namespace: it cannot be told here
            return True
        return bool(listening & socket_inodes(self.pid))




def resume_process(proc: subprocess.Popen) -> None:
    """SIGCONT: an engine stopped with SIGSTOP (a fault test, a debugger) cannot act on SIGTERM."""
    try:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


LEARNERS_READY_FILE = "learners-ready.json"
"""Written in the engine registry by the driver once the learners hold their model and
optimizer state (`announce_learners_ready`); cleared with the registry by `prepare`."""


def announce_learners_ready(registry: Path) -> None:
    """The learners are initialised: colocated engines may now start and size their KV pool
    from the memory the learners left free (SGLang measures free memory when it starts)."""
    registry.mkdir(parents=True, exist_ok=True)
    write_text_atomic(registry / LEARNERS_READY_FILE, json.dumps({"time": time.time()}))


def wait_for_learners(registry: Path, timeout_s: float) -> None:
    """Colocated engines start after the learners initialise (`announce_learners_ready`):
    started together, SGLang would size its KV pool from whatever the learners had allocated
    by then, and its TP ranks' memory-balance check can fail. Bounded by `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    logger.info(f"[fleet] waiting for the learners to initialise ({registry / LEARNERS_READY_FILE})",
                extra=log.EVERY_RANK)
    while not (registry / LEARNERS_READY_FILE).exists():
        if time.monotonic() > deadline:
            raise EngineStartError(f"the learners did not initialise within {timeout_s:.0f} s "
                                   f"(cluster.driver_stall_timeout_s); see the learner logs")
        time.sleep(0.5)
