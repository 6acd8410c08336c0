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
Python otherwise; `isolation` says which held). Here the parent bounds the wall time and the
output: past either the whole process group is killed (the code is PID 1 of its own PID
namespace where it has one, so nothing it started survives). Whatever the code does, the
result is text the model sees and a status the trainer counts, never an exception;
`Sandbox.max_concurrent` bounds how many run at once. `dapo-mega sandbox FILE` runs a file
exactly so and prints what the model would see.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

BOOT = Path(__file__).with_name("sandbox_boot.py")
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1"}
"""The whole environment of the code (HOME and TMPDIR: its working directory)."""
STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory", "output_limit", "crash", "sandbox_error")


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


@dataclass
class SandboxResult:
    status: str
    """One of STATUSES."""
    exit_code: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool = False
    isolation: Dict[str, str] = field(default_factory=dict)

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
    """Runs code under `limits`, at most `max_concurrent` at a time (threads may share one)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), max_concurrent: int = 4, python: str = sys.executable,
                 base_dir: Optional[str] = None):
        self.limits, self.python, self.base_dir = limits, python, base_dir
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def run(self, code: str) -> SandboxResult:
        with self._slots:
            return run_code(code, self.limits, self.python, self.base_dir)


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
             base_dir: Optional[str] = None) -> SandboxResult:
    """Run `code` once under `limits` (module docstring); never raises for what the code does."""
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
               "cgroup_procs": str(group / "cgroup.procs") if group else ""}
        env = {**SAFE_ENV, "HOME": workdir, "TMPDIR": workdir}
        proc = subprocess.Popen([python, "-I", str(BOOT), json.dumps(cfg)], cwd=workdir, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, pass_fds=(status_w,))
        os.close(status_w)
        status_w = -1
        out, err, stopped = _collect(proc, limits, start)
        isolation = _read_status(status_r)
        exit_code = proc.returncode
        stdout = out.decode("utf-8", "replace")
        stderr = err.decode("utf-8", "replace")
        result = SandboxResult(_classify(exit_code, stderr, stopped), exit_code, stdout, stderr,
                               time.monotonic() - start, isolation=isolation)
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


def _read_status(fd: int) -> Dict[str, str]:
    try:
        line = os.read(fd, 4096).decode().splitlines()
        return json.loads(line[0]) if line else {}
    except (OSError, ValueError):
        return {}


def main(argv: Optional[List[str]] = None) -> int:
    """`dapo-mega sandbox FILE [--wall-s S] [--cpu-s S] [--memory-mb M] [--output-bytes B]
    [--processes N] [--json]`: run FILE as a rollout's python tool would and print what the model
    would see; exit 0 unless the sandbox itself failed."""
    import argparse

    parser = argparse.ArgumentParser(prog="dapo-mega sandbox", description=main.__doc__.split("\n")[0])
    parser.add_argument("file")
    defaults = SandboxLimits()
    for name in ("wall_s", "cpu_s", "memory_mb", "output_bytes", "processes"):
        parser.add_argument("--" + name.replace("_", "-"), type=type(getattr(defaults, name)),
                            default=getattr(defaults, name))
    parser.add_argument("--json", action="store_true", help="the whole result as JSON")
    args = parser.parse_args(argv)
    try:
        code = Path(args.file).read_text()
    except OSError as exc:
        print(f"dapo-mega sandbox: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    limits = SandboxLimits(wall_s=args.wall_s, cpu_s=args.cpu_s, memory_mb=args.memory_mb,
                           output_bytes=args.output_bytes, processes=args.processes)
    result = run_code(code, limits)
    if args.json:
        print(json.dumps({**asdict(result), "model_text": result.model_text(limits.output_bytes)}, indent=2))
    else:
        print(result.model_text(limits.output_bytes))
        print(f"[sandbox] {result.status}, exit {result.exit_code}, {result.wall_s:.2f} s, isolation "
              f"{json.dumps(result.isolation)}", file=sys.stderr)
    return 1 if result.status == "sandbox_error" else 0
