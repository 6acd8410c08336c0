"""Running model-written Python: the sandbox of the `python` tool (issue #39 item 4).

    result = Sandbox(SandboxLimits(wall_s=10)).run("print(2 ** 100)")
    result.status        # "ok", or what went wrong: error, timeout, cpu_limit, memory, output_limit, crash
    result.model_text()  # what goes back into the model's context

Code a model wrote is the first untrusted input that comes from the model itself. Each run
gets a fresh working directory (`main.py` holds the code), its own process group, a minimal
environment (no API keys, tokens or home: `SAFE_ENV`), and `sandbox_boot.py` takes away, before
the code runs, what it must not have: CPU time, memory, file size and process count are
bounded; the network and every file outside the working directory and the Python installation
are out of reach (Linux namespaces and Landlock where the kernel allows them, audit hooks in
Python otherwise). Here the parent bounds the wall time and the output: past either the whole
process group is killed (the code is PID 1 of its own PID namespace where it has one, so
nothing it started survives). Whatever the code does, the result is text the model sees and a
status the trainer counts, never an exception; `Sandbox.max_concurrent` bounds how many run at
once. `dapo-mega sandbox FILE` runs a file exactly so and prints what the model would see.

The numerical libraries start one thread each (`THREAD_ENV`): the process limit counts
threads, and OpenBLAS alone starts one per core, so on a 112-core node every `import numpy`
died at the limit of 16.

What held depends on the host (root or not, user namespaces, Landlock, a pids cgroup), so the
sandbox says what it got: each result's `isolation` report names its level (`LEVELS`: none,
limits, full, as `sandbox_boot.py` defines them) and the layers; `probe_isolation` asks the
host once; `check_isolation` refuses a required level the host lacks, naming the fix; a run
below the required level does not run its code (status `sandbox_error`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from dapo_mega.config import ConfigError
from dapo_mega.environments.sandbox_boot import LEVELS, REFUSED_EXIT
from dapo_mega.node import node_cpus

BOOT = Path(__file__).with_name("sandbox_boot.py")
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1"}
"""The whole environment of the code (HOME and TMPDIR: its working directory)."""
DEFAULT_MAX_CONCURRENT = 4
"""Runs at once on the driver when the environment's kwargs give no max_concurrent (the python
tool's, and the rollout's tool threads: rollout/settings.py DEFAULT_TOOL_SLOTS)."""
STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory", "output_limit", "crash", "sandbox_error")
THREAD_ENV = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "NUMEXPR_MAX_THREADS", "NUMBA_NUM_THREADS",
              "RAYON_NUM_THREADS", "POLARS_MAX_THREADS")
"""The thread counts of the numerical libraries a program may import (numpy's OpenBLAS, MKL, BLIS,
Accelerate, OpenMP and so torch's intra-op pool, numexpr, numba, Rust's rayon and polars); left
unset, each starts one thread per core of the node."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 1024
    """Address space of each process (RLIMIT_AS): Python itself needs ~50 MB."""
    output_bytes: int = 8192
    """Output the model sees (stdout, then stderr's tail); a run that prints 64 times this is stopped."""
    processes: int = 16
    file_bytes: int = 16 * 1024 * 1024
    open_files: int = 64
    threads: int = 1
    """Threads each numerical library may start (`THREAD_ENV`); each counts against `processes`."""


def library_threads_env(threads: int) -> Dict[str, str]:
    """The environment that holds every library of `THREAD_ENV` to `threads` threads."""
    return {**{name: str(threads) for name in THREAD_ENV}, "TOKENIZERS_PARALLELISM": "false"}


def check_limits(limits: SandboxLimits, cpus: int, prefix: str = "rollout.environment_kwargs") -> None:
    """ConfigError naming the field when `threads` does not fit: at least 1, no more than the
    node's `cpus` (`node.node_cpus`) and fewer than `processes` (the program itself is one)."""
    if not 1 <= limits.threads <= cpus or limits.threads >= limits.processes:
        raise ConfigError(f"{prefix}.threads={limits.threads}: the numerical libraries' threads of one run must be "
                          f"at least 1, at most the node's {cpus} cores and fewer than {prefix}.processes="
                          f"{limits.processes} (threads count as processes). Fix: {prefix}.threads=1")


@dataclass
class SandboxResult:
    status: str
    """One of STATUSES."""
    exit_code: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool = False
    isolation: Dict[str, Any] = field(default_factory=dict)
    """What held (sandbox_boot's report): level, namespaces, landlock_abi, process_bound, in_python
    (what only audit hooks held), and `refused` (the required level) when the code did not run."""

    def model_text(self, limit: int = SandboxLimits.output_bytes) -> str:
        """stdout, stderr's tail when there is any, and a line naming what stopped the run."""
        text = self.stdout
        if self.stderr.strip():
            room = max(limit - len(text), limit // 4)
            text += ("\n" if text and not text.endswith("\n") else "") + self.stderr[-room:]
        truncated = self.truncated or len(text) > limit
        text = text[:limit]
        notes = {"timeout": f"timed out after {self.wall_s:.1f} s", "cpu_limit": "stopped: CPU time limit",
                 "memory": "stopped: memory limit", "output_limit": "stopped: output limit",
                 "crash": f"crashed (exit {self.exit_code})", "sandbox_error": "the sandbox failed to run the code"}
        lines = [text.rstrip("\n")] if text.strip() else []
        if truncated:
            lines.append("[output truncated]")
        if self.status in notes:
            lines.append(f"[{notes[self.status]}]")
        return "\n".join(lines)


class Sandbox:
    """Runs code under `limits`, at most `max_concurrent` at a time (threads may share one); a run
    below the `isolation` level (LEVELS) does not run its code. It counts its runs by level and
    the most that ran at once (`take_metrics`)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), max_concurrent: int = DEFAULT_MAX_CONCURRENT, python: str = sys.executable,
                 base_dir: Optional[str] = None, isolation: str = "none"):
        self.limits, self.python, self.base_dir, self.isolation = limits, python, base_dir, isolation
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._lock = threading.Lock()
        self._runs: Dict[str, int] = {}
        self._running = self._peak = 0

    def run(self, code: str) -> SandboxResult:
        with self._slots:
            with self._lock:
                self._running += 1
                self._peak = max(self._peak, self._running)
            try:
                result = run_code(code, self.limits, self.python, self.base_dir, self.isolation)
            finally:
                with self._lock:
                    self._running -= 1
        with self._lock:
            level = result.isolation.get("level", "unknown")
            self._runs[level] = self._runs.get(level, 0) + 1
        return result

    def take_metrics(self) -> Dict[str, float]:
        """The runs since the last call by isolation level (`rollout/sandbox_runs/<level>`), the
        lowest level among them as its index in LEVELS (`rollout/sandbox_isolation`: 2 is full) and
        the most that ran at once (`rollout/sandbox_runs_at_once`, at most max_concurrent: what the
        plan's clock assumes of a round's tools)."""
        with self._lock:
            runs, self._runs = self._runs, {}
            peak, self._peak = self._peak, self._running
        out = {f"rollout/sandbox_runs/{level}": float(n) for level, n in sorted(runs.items())}
        if runs:
            out["rollout/sandbox_isolation"] = float(min(LEVELS.index(x) if x in LEVELS else -1 for x in runs))
            out["rollout/sandbox_runs_at_once"] = float(peak)
        return out

    def report(self) -> Dict[str, Any]:
        """What this host gives the sandbox (`probe_isolation`), what it requires and its limits:
        what run.json keeps of a run's sandbox."""
        return {**probe_isolation(self.python, self.limits), "required": self.isolation,
                "limits": asdict(self.limits), "max_concurrent": self.max_concurrent, "node_cpus": node_cpus()}


@lru_cache(maxsize=None)
def probe_isolation(python: str = sys.executable, limits: SandboxLimits = SandboxLimits()) -> Dict[str, Any]:
    """The isolation a run gets on this host (one empty program, once per process, ~0.1 s),
    with who asked (`uid`: the fixes differ for root) and the host's name; `error` instead of
    the layers when the sandbox cannot run code at all."""
    result = run_code("pass", replace(limits, wall_s=max(limits.wall_s, 10.0), cpu_s=max(limits.cpu_s, 5.0)), python)
    report: Dict[str, Any] = {"level": "none", **result.isolation}
    if result.status != "ok":
        report["error"] = f"{result.status}: {(result.stderr or result.stdout).strip()[-300:]}"
    return {**report, "uid": os.getuid(), "host": socket.gethostname()}


ISOLATION_FIXES = {
    "namespaces": {True: "give the driver CAP_SYS_ADMIN (a container run with --cap-add SYS_ADMIN and a seccomp "
                         "profile that allows unshare)",
                   False: "enable unprivileged user namespaces (sysctl user.max_user_namespaces=15000; on Debian "
                          "kernels kernel.unprivileged_userns_clone=1; on Ubuntu >= 23.10 "
                          "kernel.apparmor_restrict_unprivileged_userns=0), or run the driver as root"},
    "landlock": "a kernel with Landlock (Linux >= 5.13 built with CONFIG_SECURITY_LANDLOCK=y and `landlock` in "
                "the lsm= boot parameter: see /sys/kernel/security/lsm)",
    "process_bound": "a pids cgroup the driver may write (cgroup v2 with +pids in the parent's "
                     "cgroup.subtree_control, or v1's pids hierarchy), or run the driver as a non-root user "
                     "(RLIMIT_NPROC bounds its runs)",
}
"""How to get each layer a level needs, by what the probe found missing (namespaces: by whether it ran as root)."""


def check_isolation(required: str, report: Mapping[str, Any], field_name: str = "rollout.environment_kwargs.isolation"
                    ) -> None:
    """ConfigError naming `field_name`, what the host lacks and the fix, when the host's isolation
    (`report`: probe_isolation's) is below `required` (one of LEVELS). Pure: a test gives it the
    report of the host it stands for."""
    if required not in LEVELS:
        raise ConfigError(f"{field_name}={required!r}: one of {', '.join(LEVELS)}. Fix: {field_name}=full for a run "
                          "that trains on model-written code (none only where the host gives no more)")
    if report.get("error"):
        raise ConfigError(f"{field_name}: the sandbox cannot run code on {report.get('host', 'this host')} "
                          f"({report['error']}). Fix: run `dapo-mega sandbox FILE` there to see why")
    level = report.get("level", "none")
    if LEVELS.index(level if level in LEVELS else "none") >= LEVELS.index(required):
        return
    missing = []
    if required == "full" and report.get("namespaces", "none") == "none":
        missing.append(("no PID and network namespaces", ISOLATION_FIXES["namespaces"][report.get("uid") == 0]))
    if required == "full" and not report.get("landlock_abi"):
        missing.append(("no Landlock", ISOLATION_FIXES["landlock"]))
    if report.get("process_bound", "none") == "none":
        missing.append(("nothing in the kernel bounds its processes", ISOLATION_FIXES["process_bound"]))
    what = "; ".join(m for m, _ in missing)
    raise ConfigError(
        f"{field_name}={required}: the sandbox on {report.get('host', 'this host')} gets isolation {level} ({what}), "
        f"so model-written code could reach what only Python's audit hooks hold "
        f"({', '.join(report.get('in_python', [])) or 'nothing'}). Fix: {'; '.join(f for _, f in missing)}; or, "
        f"knowing what it leaves open, {field_name}={level}")


def read_roots(python: str = sys.executable) -> List[str]:
    """What the code may read and execute: the Python installation and the system's libraries."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(os.path.realpath(python)))}
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    system = ["/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/usr/share/zoneinfo",
              "/etc/ld.so.cache", "/etc/localtime", "/dev/null", "/dev/urandom", "/dev/zero"]
    return sorted(p for p in prefixes | paths | set(system) if p and os.path.exists(p))


def _pids_cgroup_root() -> Optional[Path]:
    """The cgroup v2 root when it offers the pids controller, else v1's pids hierarchy, else None."""
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/pids")
    try:
        if (v2 / "cgroup.controllers").exists():
            return v2 if "pids" in (v2 / "cgroup.subtree_control").read_text().split() else None
        return v1 if (v1 / "cgroup.procs").exists() else None
    except OSError:
        return None


def _make_cgroup(processes: int) -> Optional[Path]:
    """A pids cgroup for one run (pids.max = `processes`), or None where none can be made."""
    root = _pids_cgroup_root()
    if root is None:
        return None
    group = root / f"dapo-mega-sandbox-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
    try:
        group.mkdir()
    except OSError:
        return None
    try:
        (group / "pids.max").write_text(str(processes))
        return group
    except OSError:
        _remove_cgroup(group)
        return None


def _remove_cgroup(group: Optional[Path]) -> None:
    if group is None:
        return
    for _ in range(50):  # the kernel empties it as the killed processes exit
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.02)


def _classify(code: Optional[int], stderr: str, stopped: str) -> str:
    if stopped:
        return stopped
    if code == 0:
        return "ok"
    if code is not None and code in (128 + signal.SIGXCPU, -signal.SIGXCPU, 128 + signal.SIGKILL, -signal.SIGKILL):
        return "cpu_limit"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if last.startswith("MemoryError") or "Cannot allocate memory" in last:
        return "memory"
    if code is not None and (code < 0 or code > 128):
        return "crash"
    return "error"


def run_code(code: str, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable,
             base_dir: Optional[str] = None, isolation: str = "none") -> SandboxResult:
    """Run `code` once under `limits` (module docstring), unless the run's isolation is below
    `isolation` (a level of LEVELS: the code does not run, status sandbox_error); never raises
    for what the code does."""
    start = time.monotonic()
    try:
        workdir = tempfile.mkdtemp(prefix="dapo-sandbox-", dir=base_dir)
    except OSError as exc:
        return SandboxResult("sandbox_error", None, "", f"no working directory: {exc}", 0.0)
    group = _make_cgroup(limits.processes)
    status_r, status_w = os.pipe()
    try:
        Path(workdir, "main.py").write_text(code)
        cfg = {**asdict(limits), "workdir": workdir, "read_roots": read_roots(python), "status_fd": status_w,
               "cgroup_procs": str(group / "cgroup.procs") if group else "", "isolation": isolation}
        env = {**SAFE_ENV, **library_threads_env(limits.threads), "HOME": workdir, "TMPDIR": workdir}
        proc = subprocess.Popen([python, "-I", str(BOOT), json.dumps(cfg)], cwd=workdir, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, pass_fds=(status_w,))
        os.close(status_w)
        status_w = -1
        out, err, stopped = _collect(proc, limits, start)
        held = _read_status(status_r)
        exit_code = proc.returncode
        stdout = out.decode("utf-8", "replace")
        stderr = err.decode("utf-8", "replace")
        if held.get("refused") and exit_code == REFUSED_EXIT:
            return SandboxResult("sandbox_error", exit_code, "", f"the sandbox got isolation {held['level']}, "
                                 f"below the required {held['refused']}: the code did not run",
                                 time.monotonic() - start, isolation=held)
        result = SandboxResult(_classify(exit_code, stderr, stopped), exit_code, stdout, stderr,
                               time.monotonic() - start, isolation=held)
        result.truncated = stopped == "output_limit" or len(stdout) + len(stderr) > limits.output_bytes
        return result
    except OSError as exc:
        return SandboxResult("sandbox_error", None, "", f"the sandbox could not start: {exc}", time.monotonic() - start)
    finally:
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)
        _remove_cgroup(group)
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc: subprocess.Popen, limits: SandboxLimits, start: float):
    """(stdout, stderr, stop reason) of `proc`, killing its group past the wall time or the
    output bound (64 x output_bytes read in all). Kept: stdout's head, stderr's tail (where a
    traceback ends)."""
    import selectors

    cap, total, stopped = 64 * limits.output_bytes, 0, ""
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        while sel.get_map() and not stopped:
            left = limits.wall_s - (time.monotonic() - start)
            if left <= 0:
                stopped = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                data = os.read(key.fileobj.fileno(), 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                total += len(data)
                if key.fileobj is proc.stdout:
                    out += data[: max(0, 2 * limits.output_bytes - len(out))]
                else:
                    err += data
                    del err[: max(0, len(err) - 4 * limits.output_bytes)]
                if total > cap:
                    stopped = "output_limit"
                    break
    _kill_group(proc)
    return bytes(out), bytes(err), stopped


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _read_status(fd: int) -> Dict[str, Any]:
    try:
        line = os.read(fd, 4096).decode().splitlines()
        return json.loads(line[0]) if line else {}
    except (OSError, ValueError):
        return {}


def main(argv: Optional[List[str]] = None) -> int:
    """`dapo-mega sandbox FILE [--wall-s S] [--cpu-s S] [--memory-mb M] [--output-bytes B]
    [--processes N] [--threads N] [--isolation LEVEL] [--json]`: run FILE as a rollout's python tool
    would and print what the model would see; exit 0 unless the sandbox itself failed."""
    import argparse

    parser = argparse.ArgumentParser(prog="dapo-mega sandbox", description=main.__doc__.split("\n")[0])
    parser.add_argument("file")
    defaults = SandboxLimits()
    for name in ("wall_s", "cpu_s", "memory_mb", "output_bytes", "processes", "threads"):
        parser.add_argument("--" + name.replace("_", "-"), type=type(getattr(defaults, name)),
                            default=getattr(defaults, name))
    parser.add_argument("--isolation", choices=LEVELS, default="none", help="the level a run needs to run the code")
    parser.add_argument("--json", action="store_true", help="the whole result as JSON")
    args = parser.parse_args(argv)
    try:
        code = Path(args.file).read_text()
    except OSError as exc:
        print(f"dapo-mega sandbox: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    limits = SandboxLimits(wall_s=args.wall_s, cpu_s=args.cpu_s, memory_mb=args.memory_mb,
                           output_bytes=args.output_bytes, processes=args.processes, threads=args.threads)
    result = run_code(code, limits, isolation=args.isolation)
    if args.json:
        print(json.dumps({**asdict(result), "model_text": result.model_text(limits.output_bytes)}, indent=2))
    else:
        print(result.model_text(limits.output_bytes))
        print(f"[sandbox] {result.status}, exit {result.exit_code}, {result.wall_s:.2f} s, isolation "
              f"{json.dumps(result.isolation)}", file=sys.stderr)
    return 1 if result.status == "sandbox_error" else 0
