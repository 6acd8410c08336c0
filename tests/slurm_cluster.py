"""A real two-node Slurm cluster on this one machine, for the launch tests.

`LocalSlurmCluster(workdir).start()` writes its own slurm.conf, munge key and state
directories under `workdir` (nothing in /etc is touched), starts one `munged` on a private
socket, one `slurmctld` and two `slurmd` daemons posing as nodes n1 and n2, and waits
until `sinfo` shows both nodes idle. `stop()` ends exactly the daemons it started, by pid.
Client commands (`sbatch`, `squeue`, `scontrol`, `scancel`) find the cluster through the
`SLURM_CONF` in `env()`.

Packages: slurmctld, slurmd, slurm-client, munge (Debian, Slurm 22.05; `DEBIAN_PACKAGES`).
`ensure_installed()` installs them with apt-get (as root) when missing, one process at a time
(a file lock across the pytest workers), and returns a reason string when it cannot, so the
tests skip with that reason (under CI they fail with it: tests/ci_lane.py). `.ci/run` installs
them before pytest starts: `python tests/slurm_cluster.py install`.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "munged")
DEBIAN_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
"""What the suite installs from Debian (as root) when the binaries above are missing."""
INSTALL_LOCK = Path(tempfile.gettempdir()) / "dapo_mega_test_packages.lock"
"""Held by whoever installs: the pytest workers (and `.ci/run`) install one at a time."""
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE")


def missing_binaries(search_dirs: Optional[List[Path]] = None) -> List[str]:
    """The Slurm and munge binaries not found: in `search_dirs`, else on PATH or in /usr/sbin."""
    missing = []
    for name in SLURM_BINARIES:
        if search_dirs is not None:
            found = any(Path(d, name).exists() for d in search_dirs)
        else:
            found = shutil.which(name) is not None or Path("/usr/sbin", name).exists()
        if not found:
            missing.append(name)
    return missing


def ensure_installed(timeout_s: float = 600.0, *, search_dirs: Optional[List[Path]] = None,
                     apt_get: str = "apt-get", lock_path: Path = INSTALL_LOCK) -> Optional[str]:
    """Install Slurm + munge with apt-get if missing. Returns None when usable, else why not.

    Safe to call from several processes at once (two pytest workers): the installer holds
    `lock_path`, and a process that waited for it looks again before installing; apt-get itself
    waits for dpkg's lock (held by some other apt) instead of failing. Every wait is bounded by
    `timeout_s`."""
    if not missing_binaries(search_dirs):
        return None
    if os.geteuid() != 0:
        return f"Slurm binaries {missing_binaries(search_dirs)} missing and not root, cannot apt-get install them"
    if shutil.which(apt_get) is None:
        return f"Slurm binaries {missing_binaries(search_dirs)} missing and no {apt_get} on this machine"
    deadline = time.monotonic() + timeout_s
    with open(lock_path, "a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return f"another process held {lock_path} (installing Slurm) for over {timeout_s:.0f}s"
                time.sleep(0.2)
        try:
            if not missing_binaries(search_dirs):  # the process we waited for installed them
                return None
            return _apt_install(apt_get, max(1.0, deadline - time.monotonic()), search_dirs)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _apt_install(apt_get: str, timeout_s: float, search_dirs: Optional[List[Path]]) -> Optional[str]:
    wait = ["-o", f"DPkg::Lock::Timeout={int(timeout_s)}"]  # wait for dpkg's lock, do not fail on it
    cmd = [apt_get, *wait, "install", "-y", *DEBIAN_PACKAGES]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if result.returncode != 0:  # a fresh machine has no package lists yet
            subprocess.run([apt_get, *wait, "update"], capture_output=True, timeout=timeout_s, env=env)
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"apt-get install slurm failed: {exc}"
    if missing_binaries(search_dirs):
        return f"apt-get install slurm did not provide {missing_binaries(search_dirs)}: {result.stderr[-500:]}"
    return None


def _free_ports(count: int) -> List[int]:
    """`count` distinct free TCP ports on 127.0.0.1 (held together so they differ)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_consecutive_ports(count: int, tries: int = 50) -> int:
    """First of `count` consecutive free ports (slurmd's Port=a-b range needs consecutive)."""
    for _ in range(tries):
        base = _free_ports(1)[0]
        if base + count >= 65535:
            continue
        ok = True
        for port in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class LocalSlurmCluster:
    """Two slurmd "nodes" (n1, n2) + slurmctld + munged, all private to `workdir`."""

    def __init__(self, workdir: Path, cpus_per_node: int = 4, real_memory_mb: int = 10000):
        self.workdir = Path(workdir)
        self.cpus_per_node = cpus_per_node
        self.real_memory_mb = real_memory_mb
        self.hostname = socket.gethostname()
        self.procs: Dict[str, subprocess.Popen] = {}
        self.conf_path = self.workdir / "etc" / "slurm.conf"

    # --- lifecycle -------------------------------------------------------------------
    def env(self) -> Dict[str, str]:
        """Environment for client commands (and for the jobs they submit)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf_path)
        for key in list(env):  # a test run inside a Slurm job must not leak its job vars
            if key.startswith("SLURM_") and key != "SLURM_CONF":
                env.pop(key)
        return env

    def start(self, timeout_s: float = 60.0) -> "LocalSlurmCluster":
        w = self.workdir
        for sub in ("etc", "log", "state", "spool", "run", "munge"):
            (w / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(w / "munge", 0o700)
        for node in ("n1", "n2"):
            (w / "spool" / node).mkdir(exist_ok=True)
        self._start_munge()
        ctld_port = _free_ports(1)[0]
        slurmd_base = _free_consecutive_ports(2)
        self.conf_path.write_text(self._slurm_conf(ctld_port, slurmd_base))
        env = self.env()
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-f", str(self.conf_path)], env)
        for node in ("n1", "n2"):
            self._spawn(f"slurmd-{node}", [_sbin("slurmd"), "-D", "-N", node, "-f", str(self.conf_path)], env)
        self._wait_idle(timeout_s)
        return self

    def stop(self) -> None:
        """Stop the daemons this object started (by pid), slurmds first."""
        for name in sorted(self.procs, key=lambda n: (not n.startswith("slurmd"), n)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()

    def __enter__(self) -> "LocalSlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- jobs ------------------------------------------------------------------------
    def run(self, args: List[str], timeout_s: float = 30.0, check: bool = True,
            extra_env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        env = self.env()
        env.update(extra_env or {})
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result

    def sbatch(self, args: List[str], extra_env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None) -> int:
        """Submit; returns the job id."""
        env = self.env()
        env.update(extra_env or {})
        result = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                                timeout=30, env=env, cwd=str(cwd) if cwd else None)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {args} failed: {result.stderr}")
        return int(result.stdout.strip().split(";")[0].split("+")[0])

    def job_info(self, job_id: int) -> Dict[str, str]:
        """`scontrol show job` fields of the job (of component 0 for a heterogeneous job)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False).stdout
        line = out.strip().splitlines()[0] if out.strip() else ""
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def job_state(self, job_id: int) -> str:
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait_job(self, job_id: int, timeout_s: float, poll_s: float = 1.0) -> Dict[str, str]:
        """Wait until the job reaches a terminal state (bounded); returns its fields."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in TERMINAL_STATES:
                return info
            time.sleep(poll_s)
        self.run(["scancel", str(job_id)], check=False)
        raise TimeoutError(f"job {job_id} not finished after {timeout_s:.0f}s: {self.job_info(job_id)}\n"
                           f"{self.debug_tail()}")

    def wait_state(self, job_id: int, state: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            current = self.job_state(job_id)
            if current == state:
                return
            if current in TERMINAL_STATES:
                raise RuntimeError(f"job {job_id} ended ({current}) before reaching {state}")
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not {state} after {timeout_s:.0f}s")

    def debug_tail(self, lines: int = 30) -> str:
        chunks = []
        for log in sorted((self.workdir / "log").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            chunks.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(chunks)

    # --- internals -------------------------------------------------------------------
    def _spawn(self, name: str, cmd: List[str], env: Dict[str, str]) -> None:
        log = open(self.workdir / "log" / f"{name}.stdout", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        log.close()

    def _start_munge(self) -> None:
        """A private munged: own key, socket, pid and log (the system one is left alone)."""
        m = self.workdir / "munge"
        key = m / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o600)
        self.munge_socket = m / "munge.socket"
        cmd = [_sbin("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
               f"--key-file={key}", f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
               f"--seed-file={m / 'munged.seed'}"]
        self._spawn("munged", cmd, dict(os.environ))
        deadline = time.monotonic() + 15
        while not self.munge_socket.exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("munged did not start: " + (m / "munged.log").read_text(errors="replace")
                                   if (m / "munged.log").exists() else "munged did not start")
            time.sleep(0.1)

    def _slurm_conf(self, ctld_port: int, slurmd_base: int) -> str:
        w = self.workdir
        return "\n".join([
            "ClusterName=dapotest",
            f"SlurmctldHost={self.hostname}",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/backfill",
            # heterogeneous jobs are placed by the backfill pass: run it every second
            "SchedulerParameters=bf_interval=1,sched_interval=1",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            f"SlurmctldPidFile={w}/run/slurmctld.pid",
            f"SlurmdPidFile={w}/run/slurmd-%n.pid",
            f"SlurmdSpoolDir={w}/spool/%n",
            f"StateSaveLocation={w}/state",
            "SlurmUser=root",
            "ReturnToService=2",
            "MpiDefault=none",
            # each node poses with cpus_per_node CPUs, whatever the machine has (a recipe's twin
            # puts TP 2 x PP 2 learner ranks on one node: docs/twins.md); jobs still get one CPU a task
            "SlurmdParameters=config_overrides",
            "JobAcctGatherType=jobacct_gather/none",
            "KillWait=3",
            "MinJobAge=600",
            "InactiveLimit=0",
            f"SlurmctldLogFile={w}/log/slurmctld.log",
            f"SlurmdLogFile={w}/log/slurmd-%n.log",
            f"NodeName=n[1-2] NodeHostname={self.hostname} NodeAddr=127.0.0.1 "
            f"Port={slurmd_base}-{slurmd_base + 1} CPUs={self.cpus_per_node} "
            f"RealMemory={self.real_memory_mb} State=UNKNOWN",
            "PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            "",
        ])

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.debug_tail()}")
            result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout_s=10)
            last = result.stdout + result.stderr
            states = dict(line.split() for line in result.stdout.strip().splitlines() if len(line.split()) == 2)
            if states.get("n1") == "idle" and states.get("n2") == "idle":
                return
            time.sleep(0.5)
        raise TimeoutError(f"nodes not idle after {timeout_s:.0f}s: {last}\n{self.debug_tail()}")


def start_or_skip(workdir) -> "LocalSlurmCluster":
    """A started local cluster in `workdir`; where it cannot run here the test skips saying
    why, or fails with that reason under CI. The caller stops it."""
    from ci_lane import lane_unavailable

    if os.geteuid() != 0:
        lane_unavailable("the local Slurm cluster runs its daemons as root (SlurmUser=root); not root here")
    reason = ensure_installed()
    if reason:
        lane_unavailable(f"no local Slurm: {reason}")
    cluster = LocalSlurmCluster(workdir)
    try:
        cluster.start()
    except Exception as exc:  # the daemons could not come up on this machine
        cluster.stop()
        lane_unavailable(f"local Slurm cluster did not start: {exc}")
    return cluster


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit(f"usage: python {sys.argv[0]} install   (apt-get installs {' '.join(DEBIAN_PACKAGES)} if missing)")
    why_not = ensure_installed()
    if why_not:
        sys.exit(f"the test suite's Debian packages ({' '.join(DEBIAN_PACKAGES)}) are not installed: {why_not}")
    print(f"the test suite's Debian packages are installed: {' '.join(DEBIAN_PACKAGES)}")
