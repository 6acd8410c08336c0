"""The sandbox says what it got (issue #46): what held depends on the host, so each run reports
its level (none, limits, full) and its layers, the level goes into run.json and the step's
metrics, `rollout.environment_kwargs.isolation` requires a level (the shipped recipe: full),
and a host that gives less is refused before the run starts, naming the fix. Hosts this machine
is not are stood for by the probe's report (`check_isolation` is pure); the non-root path (user
namespaces) runs here as the user nobody where root may switch to it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

from dapo_mega.config import ConfigError, load_config
from dapo_mega.environments import sandbox
from dapo_mega.environments.base import build_environment, environment_report, take_environment_metrics
from dapo_mega.environments.python_tool import PythonTool
from dapo_mega.environments.sandbox import (
    LEVELS,
    Sandbox,
    SandboxLimits,
    check_isolation,
    probe_isolation,
)
from dapo_mega.environments.sandbox_boot import isolation_level
from dapo_mega.plan.preflight import check_environment
from dapo_mega.run_files.identity import RUN_FILE, add_to_run_file

LIMITS = SandboxLimits(wall_s=4.0, cpu_s=2.0, memory_mb=256, output_bytes=2048, processes=16)
REPO = Path(__file__).resolve().parents[2]
FIELD = "rollout.environment_kwargs.isolation"


def host(level, namespaces="pid+net", landlock_abi=7, process_bound="cgroup", uid=0, in_python=()):
    """The report probe_isolation would give on a host with these layers."""
    return {"level": level, "namespaces": namespaces, "landlock_abi": landlock_abi, "process_bound": process_bound,
            "in_python": list(in_python), "uid": uid, "host": "node-7"}


def test_the_level_is_what_the_kernel_held():
    assert LEVELS == ("none", "limits", "full")
    assert isolation_level("pid+net", 7, "cgroup") == "full"
    assert isolation_level("user+pid+net", 1, "rlimit") == "full"  # a non-root job with user namespaces
    assert isolation_level("none", 7, "rlimit") == "limits"  # no namespaces: UDP, kill, a daemon
    assert isolation_level("pid+net", 0, "cgroup") == "limits"  # no Landlock: files in Python only
    assert isolation_level("pid+net", 7, "none") == "none"  # root without a pids cgroup: no kernel bound


def test_a_required_level_the_host_lacks_is_refused_naming_the_fix():
    check_isolation("full", host("full"))
    check_isolation("limits", host("full"))
    check_isolation("none", host("none", process_bound="none"))
    cases = {
        # a non-root job without user namespaces: the UDP, kill and daemon
        "unprivileged user namespaces": host("limits", namespaces="none", process_bound="rlimit", uid=1000,
                                             in_python=["network", "processes"]),
        "CAP_SYS_ADMIN": host("limits", namespaces="none", in_python=["network", "processes"]),  # root, no unshare
        "a kernel with Landlock": host("limits", landlock_abi=0, in_python=["files", "processes"]),
        "a pids cgroup": host("none", process_bound="none", in_python=["processes"]),
    }
    for fix, report in cases.items():
        with pytest.raises(ConfigError) as err:
            check_isolation("full", report)
        text = str(err.value)
        assert text.startswith(f"{FIELD}=full: the sandbox on node-7 gets isolation {report['level']}"), text
        assert fix in text.split("Fix: ", 1)[1], text
        assert text.endswith(f"{FIELD}={report['level']}"), text
    with pytest.raises(ConfigError, match=r"the sandbox on node-7 gets isolation none \(nothing in the kernel "):
        check_isolation("limits", host("none", process_bound="none"))
    with pytest.raises(ConfigError, match=rf"^{FIELD}='strict': one of none, limits, full"):
        check_isolation("strict", host("full"))
    with pytest.raises(ConfigError, match=rf"^{FIELD}: the sandbox cannot run code on node-7 \(sandbox_error"):
        check_isolation("none", {**host("none"), "error": "sandbox_error: no python"})


def test_the_environment_refuses_at_construction_what_the_host_lacks(monkeypatch):
    """The preflight's check_environment builds the environment: on a host that gives limits, a
    required full stops the start there; the level it gives is accepted."""
    monkeypatch.setattr("dapo_mega.environments.python_tool.probe_isolation",
                        lambda python, limits: host("limits", namespaces="none", process_bound="rlimit", uid=1000))
    with pytest.raises(ConfigError, match=rf"^{FIELD}=full: .*Fix: enable unprivileged user namespaces"):
        build_environment("python", {"isolation": "full"})
    assert isinstance(build_environment("python", {"isolation": "limits"}), PythonTool)
    with pytest.raises(ConfigError, match=r"^rollout.environment_kwargs.threads=3: .*processes=3"):
        build_environment("python", {"threads": 3, "processes": 3})


def test_the_recipe_requires_full_isolation_and_starts_where_the_host_gives_it():
    cfg = load_config(["+experiment=dapo_retool_qwen2.5_32b"])
    assert cfg.rollout.environment_kwargs["isolation"] == "full"
    if probe_isolation()["level"] == "full":  # this machine and CI (root: namespaces, Landlock, a pids cgroup)
        check_environment(cfg)
    else:
        with pytest.raises(ConfigError, match=rf"^{FIELD}=full: the sandbox on .* Fix: "):
            check_environment(cfg)


def test_the_report_goes_into_run_json_and_the_runs_into_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("DAPO_MEGA_NODE_CPUS", "112")  # the twin of a 112-core node
    tool = PythonTool(LIMITS, max_concurrent=2)
    report = environment_report(tool)["sandbox"]
    assert report["level"] in LEVELS and report["required"] == "none" and report["node_cpus"] == 112
    assert report["level"] == isolation_level(report["namespaces"], report["landlock_abi"], report["process_bound"])
    assert report["limits"]["processes"] == 16 and report["limits"]["threads"] == 1 and report["max_concurrent"] == 2
    assert report["uid"] == os.getuid() and report["host"] == socket.gethostname()
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "r-1", "run_name": "r"}))
    add_to_run_file(tmp_path, environment=environment_report(tool))
    run = json.loads((tmp_path / RUN_FILE).read_text())
    assert run["run_id"] == "r-1" and run["environment"]["sandbox"] == report
    tool.step("<code>print(1)</code>")
    tool.step("<code>print(2)</code>")
    level = report["level"]
    assert take_environment_metrics(tool) == {f"rollout/sandbox_runs/{level}": 2.0,
                                              "rollout/sandbox_isolation": float(LEVELS.index(level)),
                                              "rollout/sandbox_runs_at_once": 1.0}  # one after the other
    assert take_environment_metrics(tool) == {} and take_environment_metrics(None) == {}
    assert environment_report(object()) == {}  # a class with reset and step only


def test_the_metrics_say_how_many_ran_at_once_up_to_max_concurrent():
    """Five calls at once into a sandbox of three slots: three run together, never more (the
    retool twin reads this metric at the recipe's max_concurrent)."""
    from concurrent.futures import ThreadPoolExecutor

    box = Sandbox(LIMITS, max_concurrent=3)
    with ThreadPoolExecutor(5) as pool:
        results = list(pool.map(box.run, ["import time\ntime.sleep(0.6)\nprint('ok')"] * 5))
    assert [r.status for r in results] == ["ok"] * 5, results
    assert box.take_metrics()["rollout/sandbox_runs_at_once"] == 3.0
    assert "rollout/sandbox_runs_at_once" not in box.take_metrics()  # nothing ran since


def test_a_run_below_the_required_level_does_not_run_its_code(tmp_path, monkeypatch):
    """A host whose namespaces fail at run time (the probe said full): the code does not run, the
    model reads that the sandbox failed, and the run is counted as sandbox_error."""
    boot = tmp_path / "boot.py"
    boot.write_text(sandbox.BOOT.read_text().replace("def new_namespaces():\n",
                                                     "def new_namespaces():\n    return 'none'\n"))
    monkeypatch.setattr(sandbox, "BOOT", boot)
    marker = tmp_path / "ran.txt"
    box = Sandbox(LIMITS, isolation="full")
    result = box.run(f"open({str(marker)!r}, 'w').write('ran')\nprint('ran')")
    assert result.status == "sandbox_error" and result.isolation["refused"] == "full", result
    assert result.isolation["level"] in ("limits", "none") and "ran" not in result.stdout and not marker.exists()
    assert result.model_text().endswith("[the sandbox failed to run the code]")
    assert box.take_metrics()[f"rollout/sandbox_runs/{result.isolation['level']}"] == 1.0


def _nobody_python():
    """A Python the user nobody may run (the venv's may live under root's home), of this version."""
    if os.getuid() != 0 or not shutil.which("setpriv"):
        return None
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for path in (f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", path, "-c", "1"],
                               capture_output=True)
        if probe.returncode == 0:
            return path
    return None


def test_a_non_root_job_gets_full_isolation_from_user_namespaces():
    """Issue #46: without user namespaces a non-root job's program sent UDP out, killed another
    process of its user and left a daemon behind. As the user nobody, the sandbox makes its PID and
    network namespaces inside a user namespace: the datagram arrives nowhere, the user's other
    process lives on, and the daemon dies with the run."""
    python = _nobody_python()
    if python is None:
        pytest.skip("needs root, setpriv and a system Python the user nobody may run")
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.setblocking(False)
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    victim = subprocess.Popen(nobody + ["sleep", "60"])
    marker = "nobody-daemon-5e1"
    program = textwrap.dedent(f"""\
        import os, signal, socket, subprocess, sys
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.sendto(b'exfiltrated', ('127.0.0.1', {listener.getsockname()[1]}))
            print('sent')
        except OSError as exc:
            print('udp', exc.errno)
        try:
            os.kill({victim.pid}, signal.SIGKILL)
            print('killed')
        except OSError as exc:
            print('kill', exc.errno)
        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', '{marker}'], start_new_session=True)
        print('daemon')
        """)
    driver = textwrap.dedent(f"""\
        import json, sys
        sys.path[:0] = [{str(REPO)!r}, {sysconfig.get_paths()['purelib']!r}, {sysconfig.get_paths()['platlib']!r}]
        from dapo_mega.environments.sandbox import SandboxLimits, run_code
        result = run_code({program!r}, SandboxLimits(wall_s=10, cpu_s=5, memory_mb=512), isolation="full")
        print(json.dumps({{"status": result.status, "text": result.model_text(), "isolation": result.isolation}}))
        """)
    try:
        out = subprocess.run(nobody + [python, "-c", driver], cwd="/", capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.splitlines()[-1])
        assert result["isolation"]["namespaces"] == "user+pid+net", result
        assert result["isolation"]["process_bound"] == "rlimit" and result["isolation"]["level"] == "full", result
        assert result["status"] == "ok" and "sent" not in result["text"] and "killed" not in result["text"], result
        assert "daemon" in result["text"], result  # full isolation lets the code start processes
        with pytest.raises(BlockingIOError):
            listener.recv(64)
        assert victim.poll() is None  # the user's other process lives
        deadline = time.monotonic() + 5
        while _running(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(marker)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        listener.close()


def _running(marker: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                return True
        except OSError:
            continue
    return False
