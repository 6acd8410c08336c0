"""The python tool's sandbox (issue #39 item 4, `dapo_mega/environments/sandbox.py`): model-written
programs that loop forever, allocate without bound, fork without bound, open a socket to a
listener on 127.0.0.1, read a file outside their directory or an API key from the environment,
or print without end each come back within their limits as text the model sees, and the
listener, the file and the key are untouched. The limits are scaled down (seconds, not the
recipe's 10 s), as the run's ratios are kept: wall > CPU, the output bound far below what is
printed. Whatever isolation the kernel gives (namespaces and Landlock here; audit hooks where it
gives none), the outcomes are the same; `isolation` names which held (its levels and the
refusals: test_sandbox_isolation.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dapo_mega.config import load_config
from dapo_mega.environments.sandbox import STATUSES, Sandbox, SandboxLimits, run_code

LIMITS = SandboxLimits(wall_s=4.0, cpu_s=1.0, memory_mb=256, output_bytes=2048, processes=16)


def _leftovers(marker: str):
    """Processes still running a program that contains `marker` (their working directory is gone too)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") or \
                    marker in os.readlink(f"/proc/{pid}/cwd"):
                found.append(pid)
        except OSError:
            continue
    return found


def test_a_program_runs_and_its_output_and_traceback_are_what_the_model_sees():
    ok = run_code("print(sum(range(101)))", LIMITS)
    assert (ok.status, ok.exit_code, ok.model_text()) == ("ok", 0, "5050")
    bad = run_code("x = 1\ny = x / 0\n", LIMITS)
    assert bad.status == "error" and bad.exit_code == 1
    text = bad.model_text()
    assert text.endswith("ZeroDivisionError: division by zero") and 'File "main.py", line 2' in text
    assert "sandbox_boot" not in text  # the model's own frames only
    assert set(bad.isolation) == {"level", "namespaces", "landlock_abi", "process_bound", "in_python"}
    # a syntax error too (the python-tool ablation's model wrote `print(169)</in991)`): before,
    # compile ran outside the model's frame and the boot script's host path came back
    syntax = run_code("print(169)</in991)\n", LIMITS)
    text = syntax.model_text()
    assert syntax.status == "error" and "SyntaxError: " in text.splitlines()[-1], text
    assert 'File "main.py", line 1' in text and "sandbox_boot" not in text and "/work" not in text, text


def test_a_loop_forever_stops_at_its_cpu_limit_and_a_sleep_at_the_wall_time():
    # the wall time far above the CPU time: on a busy 2-core machine a spin gets a fifth of a core
    spin = run_code("while True:\n    pass\n", SandboxLimits(**{**LIMITS.__dict__, "wall_s": 20.0}))
    assert spin.status == "cpu_limit" and "[stopped: CPU time limit]" in spin.model_text()
    start = time.monotonic()
    sleep = run_code("import time\ntime.sleep(60)\n", LIMITS)
    assert sleep.status == "timeout" and "[timed out after" in sleep.model_text()
    assert time.monotonic() - start < LIMITS.wall_s + 3


def test_numpy_runs_at_the_recipes_process_limit_on_a_many_core_node(monkeypatch):
    """Issue #46: the process limit counts threads, and OpenBLAS starts one per core when numpy is
    imported, so on the recipe's 112-core nodes every program that imported numpy died at the
    limit of 16. OpenBLAS counts the cores this machine lets it run on (a twin's 112 cannot make
    it start more), so the stand-in node also runs at the limit lowered to what the sandbox itself
    takes (its namespace's first process and the program), as the issue reproduced it: before the
    libraries were held to one thread, OpenBLAS's first thread failed there."""
    pytest.importorskip("numpy")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("on one core OpenBLAS starts no thread")
    monkeypatch.setenv("DAPO_MEGA_NODE_CPUS", "112")  # the recipe's node, as its twin claims it
    recipe = load_config(["+experiment=dapo_retool_qwen2.5_32b"]).rollout.environment_kwargs
    limits = SandboxLimits(**{k: v for k, v in recipe.items() if k in SandboxLimits.__dataclass_fields__})
    code = "import numpy as np\na = np.arange(40000.0).reshape(200, 200) / 40000\nprint(round(float(np.trace(a @ a)), 6))"
    import numpy as np

    a = np.arange(40000.0).reshape(200, 200) / 40000
    expected = str(round(float(np.trace(a @ a)), 6))
    for processes in (limits.processes, 2):
        result = run_code(code, SandboxLimits(**{**limits.__dict__, "processes": processes}))
        assert (result.status, result.model_text()) == ("ok", expected), (processes, result.model_text()[-400:])


def test_unbounded_allocation_is_a_memory_error_the_model_sees():
    result = run_code("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n", LIMITS)
    assert result.status == "memory" and "MemoryError" in result.model_text()


def test_a_fork_bomb_is_bounded_and_leaves_no_process_behind():
    marker = "forkbomb-7f3a"
    code = (f"# {marker}\nimport os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n"
            "            os.setsid()  # a child that leaves the process group\n    except OSError:\n"
            "        time.sleep(0.01)\n")
    start = time.monotonic()
    result = run_code(code, LIMITS)
    assert result.status in ("timeout", "error", "cpu_limit"), result
    assert time.monotonic() - start < LIMITS.wall_s + 3
    deadline = time.monotonic() + 5
    while _leftovers("dapo-sandbox-") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _leftovers("dapo-sandbox-") == []


@contextlib.contextmanager
def loopback_listener(seconds: float):
    """A listener on 127.0.0.1 accepting for `seconds`: yields (its port, the connections it
    accepted); closed on exit."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    accepted = []

    def accept():
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                accepted.append(server.accept())
            except socket.timeout:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
        thread.join()
    finally:
        server.close()


def test_no_connection_reaches_a_listener_on_loopback():
    with loopback_listener(LIMITS.wall_s + 2) as (port, accepted):
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "s.sendall(b'exfiltrated')\nprint('connected')\n")
        result = run_code(code, LIMITS)
    assert result.status == "error" and "connected" not in result.stdout, result
    assert accepted == []


def test_files_outside_the_directory_and_the_parents_secrets_are_out_of_reach(tmp_path, monkeypatch):
    secret = tmp_path / "run_state.json"
    secret.write_text("TOPSECRET-9c1")
    before = secret.stat()
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-KEY-4d2")
    monkeypatch.setenv("HF_TOKEN", "hf_TOKEN_4d2")
    programs = {
        "read": f"print(open({str(secret)!r}).read())",
        "write": f"open({str(secret)!r}, 'w').write('overwritten')",
        "environment": "import os\nprint(os.environ.get('OPENAI_API_KEY'), os.environ.get('HF_TOKEN'))",
        "parent's environ": "import os\nprint(open(f'/proc/{os.getppid()}/environ', 'rb').read())",
        "home": "import os\nprint(os.listdir(os.path.expanduser('~root')))",
        "shell": f"import subprocess\nprint(subprocess.run(['cat', {str(secret)!r}], capture_output=True).stdout)",
    }
    for name, code in programs.items():
        result = run_code(code, LIMITS)
        text = result.model_text()
        assert "TOPSECRET" not in text and "sk-test" not in text and "hf_TOKEN" not in text, (name, text)
    assert secret.read_text() == "TOPSECRET-9c1" and secret.stat().st_mtime_ns == before.st_mtime_ns
    # the code's own directory is its to use
    own = run_code("open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())", LIMITS)
    assert own.status == "ok" and own.model_text() == "kept"


def test_printing_without_end_stops_at_the_output_bound():
    start = time.monotonic()
    result = run_code("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", LIMITS)
    assert result.status == "output_limit" and time.monotonic() - start < LIMITS.wall_s
    text = result.model_text(LIMITS.output_bytes)
    assert len(text) < LIMITS.output_bytes + 100 and text.endswith("[stopped: output limit]")


def test_concurrent_runs_are_bounded():
    sandbox = Sandbox(LIMITS, max_concurrent=2)
    running, peak, lock = [0], [0], threading.Lock()
    original = sandbox._slots

    class Counting:
        def __enter__(self):
            original.acquire()
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])

        def __exit__(self, *exc):
            with lock:
                running[0] -= 1
            original.release()

    sandbox._slots = Counting()
    results = []
    threads = [threading.Thread(target=lambda: results.append(sandbox.run("import time\ntime.sleep(0.3)")))
               for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status for r in results] == ["ok"] * 5 and peak[0] == 2


def test_dapo_mega_sandbox_prints_what_the_model_would_see(tmp_path):
    program = tmp_path / "tool_call.py"
    program.write_text("print(6 * 7)\nraise ValueError('bad input')\n")
    out = subprocess.run([sys.executable, "-m", "dapo_mega.cli", "sandbox", str(program), "--wall-s", "4"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr  # the program failing is the model's outcome, not the sandbox's
    assert out.stdout.startswith("42\n") and "ValueError: bad input" in out.stdout
    assert "[sandbox] error, exit 1" in out.stderr
    missing = subprocess.run([sys.executable, "-m", "dapo_mega.cli", "sandbox", str(tmp_path / "none.py")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "cannot read" in missing.stderr
    assert set(STATUSES) >= {"ok", "error", "timeout", "cpu_limit", "memory", "output_limit"}


@pytest.mark.parametrize("blocked", ["namespaces", "landlock"])
def test_without_the_kernels_isolation_the_audit_hooks_hold(blocked, monkeypatch, tmp_path):
    """Where the kernel offers no namespaces (not root, no user namespaces) or no Landlock, the
    boot's audit hooks keep the sockets (UDP too: Landlock holds TCP only), the file (from another
    directory as well) and the fork out of reach in Python, and the level says so."""
    from dapo_mega.environments import sandbox

    boot = tmp_path / "boot.py"
    source = sandbox.BOOT.read_text()
    if blocked == "namespaces":
        source = source.replace("def new_namespaces():\n", "def new_namespaces():\n    return 'none'\n")
    else:
        source = source.replace("abi = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)", "abi = 0")
    boot.write_text(source)
    monkeypatch.setattr(sandbox, "BOOT", boot)
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-77")
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.setblocking(False)
    probe = run_code("print('alive')", LIMITS)
    assert probe.status == "ok", probe
    held = probe.isolation
    assert held["level"] != "full" and "processes" in held["in_python"], held
    assert "network" in held["in_python"] if blocked == "namespaces" else "files" in held["in_python"], held
    for code in (f"print(open({str(secret)!r}).read())",
                 f"import os\nos.chdir({str(tmp_path)!r})\nprint(open('secret.txt').read())",
                 f"open({str(tmp_path / 'planted.txt')!r}, 'w').write('x')",
                 "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
                 "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                 f"s.sendto(b'exfiltrated', ('127.0.0.1', {listener.getsockname()[1]}))",
                 # a process outside the interpreter's hooks: refused unless the kernel holds everything
                 f"import subprocess\nout = subprocess.run(['cat', {str(secret)!r}], capture_output=True)\n"
                 "print(out.stdout, out.stderr)\nraise SystemExit(1)"):
        result = run_code(code, LIMITS)
        assert result.status == "error" and "TOPSECRET" not in result.model_text(), (code, result)
    with pytest.raises(BlockingIOError):
        listener.recv(64)
    listener.close()
    assert not (tmp_path / "planted.txt").exists()
