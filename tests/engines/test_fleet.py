"""The engine fleet: start embedded engines, attach to them by URL and through a registry,
health, kill, restart; a failing engine's error names its log; the SGLang command line and
environment on a machine without a GPU; `dapo-mega eval` starts the configured backend.

SGLang itself is not needed: a stand-in interpreter records the argv and environment the
fleet would run SGLang with (`-m sglang.launch_server ...`) and serves nothing.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import (
    MAX_PORT_RETRIES,
    EngineEndpoint,
    EngineFleet,
    EngineStartError,
    announce_engine,
    endpoint_of,
    free_port,
    is_healthy,
)
from dapo_mega.engines.sglang.commands import build_engine_command

REPO = Path(__file__).resolve().parents[2]
API_KEY = "fleet-key"
RECORDER = """#!{python}
import json, os, sys
if sys.argv[1:2] == ["-c"]:  # asked whether it finds sglang (preflight.python_has_sglang): it poses as one that does
    sys.exit(0)
with open({out!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
print("stand-in engine: recorded argv, serving nothing", flush=True)
sys.exit(3)
"""


def stand_in(tmp_path: Path, body: str, name: str = "python") -> Path:
    path = tmp_path / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def recorder(tmp_path: Path) -> tuple:
    out = tmp_path / "recorded.jsonl"
    return stand_in(tmp_path, RECORDER.format(python=sys.executable, out=str(out))), out


def model_info(endpoint: EngineEndpoint) -> dict:
    req = urllib.request.Request(endpoint.url + "/model_info", headers=endpoint.headers())
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models(3)


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    rollout = RolloutConfig(api_key=API_KEY, request_timeout_s=77.0, health_timeout_s=120.0)
    with EngineFleet(rollout, str(model_dir), tmp_path_factory.mktemp("logs"), num_threads=1,
                     weight_version="4") as f:
        f.start(2)
        yield f


def test_started_engines_run_the_shared_command_and_answer(fleet, model_dir):
    assert [e.index for e in fleet.engines] == [0, 1]
    for e in fleet.engines:
        expected = build_engine_command(fleet.rollout, str(model_dir), e.port, weight_version="4",
                                        python=sys.executable) + ["--num-threads", "1"]
        assert e.argv == expected
        assert e.env["OMP_NUM_THREADS"] == "1" and e.env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU engine sees no GPU
        assert e.log_path.name == f"engine-{e.index}.log" and e.log_path.exists()
        assert e.endpoint == EngineEndpoint(f"http://127.0.0.1:{e.port}", API_KEY, 77.0)
        assert is_healthy(e.endpoint)
        assert str(model_info(e.endpoint)["weight_version"]) == "4"
    with pytest.raises(urllib.error.HTTPError) as err:  # the key is required, and the endpoint carries it
        model_info(EngineEndpoint(fleet.engines[0].url))
    assert err.value.code == 401


def test_attach_by_url_and_by_registry(fleet, tmp_path):
    urls = [e.url for e in fleet.engines]
    attached = EngineFleet.attach(urls, fleet.rollout)
    assert attached.endpoints == fleet.endpoints == [endpoint_of(u, fleet.rollout) for u in urls]
    attached.close()  # attached engines belong to someone else: closing leaves them running
    assert all(e.alive() for e in fleet.engines)

    registry = tmp_path / "engines"
    announce_engine(registry, 10, {"url": urls[1]})  # index order, not file-name order
    announce_engine(registry, 2, {"url": urls[0]})
    assert [e.url for e in EngineFleet.from_registry(registry, fleet.rollout, count=2).endpoints] == urls

    impatient = RolloutConfig(api_key=API_KEY, health_timeout_s=1.0)
    with pytest.raises(EngineStartError, match="2 of 3 engines announced"):
        EngineFleet.from_registry(registry, impatient, count=3)
    with pytest.raises(EngineStartError, match="not healthy"):
        EngineFleet.attach([urls[0], "http://127.0.0.1:9"], impatient)


def test_kill_and_restart_one_engine(fleet):
    first = fleet.engines[1]
    fleet.kill(1)
    assert not first.alive() and fleet.dead() == [first] and not is_healthy(first.endpoint, timeout_s=2)
    assert is_healthy(fleet.engines[0].endpoint)  # the other one is untouched
    endpoint = fleet.restart(1, weight_version="5")
    again = fleet.get(1)
    assert again is not first and again.alive() and fleet.dead() == []
    assert endpoint == again.endpoint and endpoint in fleet.endpoints and is_healthy(endpoint)
    assert str(model_info(endpoint)["weight_version"]) == "5"


def test_a_failing_engine_names_its_log(tmp_path):
    python, recorded = recorder(tmp_path)
    rollout = RolloutConfig(engine_python=str(python), health_timeout_s=60.0)
    fleet = EngineFleet(rollout, "/no/model", tmp_path / "logs")
    with pytest.raises(EngineStartError) as err:
        fleet.start(1)
    message = str(err.value)
    assert str(tmp_path / "logs" / "engine-0.log") in message and "exited with code 3" in message
    assert "stand-in engine: recorded argv" in message  # the log's tail is quoted
    assert json.loads(recorded.read_text().splitlines()[0])["argv"][:2] == ["-m", "dapo_mega.engines.embedded.server"]


def first_start_loses_its_port(tmp_path: Path, on_first_start: str) -> Path:
    """A stand-in interpreter whose first start runs `on_first_start` (indented code: what an
    engine that lost its port does) and whose later starts run the real engine."""
    marker = tmp_path / "first-start-done"
    return stand_in(tmp_path, f"""#!{sys.executable}
import os, sys, time
if not os.path.exists({str(marker)!r}):
    open({str(marker)!r}, "w").close()
{on_first_start.strip(chr(10))}
os.execv({sys.executable!r}, [{sys.executable!r}] + sys.argv[1:])
""")


def test_an_engine_that_lost_its_port_is_started_again(tmp_path, model_dir):
    """The port picked free was taken before the engine bound it: it starts again on another."""
    python = first_start_loses_its_port(tmp_path, """
    print("OSError: [Errno 98] error while attempting to bind: address already in use", flush=True)
    sys.exit(1)""")
    rollout = RolloutConfig(engine_python=str(python), health_timeout_s=120.0)
    with EngineFleet(rollout, str(model_dir), tmp_path / "logs", num_threads=1) as fleet:
        engine = fleet.spawn(0)
        first_port = engine.port
        fleet.wait_healthy()
        again = fleet.get(0)
        # At least once: a port picked free can be taken again by a neighbour's server (a CI run
        # under -n 2 saw the real engine lose its second port too, and start on a third).
        assert again.port_retries >= 1 and again.port != first_port and is_healthy(again.endpoint)


def test_an_engine_that_lost_its_port_and_hangs_is_started_again(tmp_path, model_dir):
    """SGLang's server, its port taken, logged uvicorn's bind error and then hung in its shutdown
    (a Slurm job of the full suite): the fleet stops it and starts it on another port instead
    of waiting out health_timeout_s."""
    python = first_start_loses_its_port(tmp_path, """
    print("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 41907): "
          "address already in use", flush=True)
    print("INFO:     Waiting for application shutdown.", flush=True)
    time.sleep(600)""")
    rollout = RolloutConfig(engine_python=str(python), health_timeout_s=90.0)
    with EngineFleet(rollout, str(model_dir), tmp_path / "logs", num_threads=1) as fleet:
        first = fleet.spawn(0)
        fleet.wait_healthy()
        again = fleet.get(0)
        assert first.proc.poll() is not None  # the hung one was stopped
        assert again.port_retries >= 1 and again.port != first.port and is_healthy(again.endpoint)


def test_a_port_another_server_answers_on_is_not_taken_for_the_engine(tmp_path, model_dir, monkeypatch):
    """Between picking a free port and binding it, another process (here: an HTTP server in this
    test process, answering /health 200) takes it. Its answer must not pass for the engine's
    (in the full suite a trainer then sent its weights to another test's engine): the engine is
    stopped and started on another port, and only its own process's answer counts."""
    import http.server
    import threading

    from dapo_mega.distributed import free_port
    from dapo_mega.engines.process import listening_inodes, socket_inodes

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    foreign = http.server.HTTPServer(("127.0.0.1", 0), Health)
    taken = foreign.server_address[1]
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    ports = iter([taken])
    monkeypatch.setattr("dapo_mega.engines.fleet.free_port", lambda host=None: next(ports, None) or free_port())
    try:
        assert listening_inodes(taken) & socket_inodes(os.getpid())  # the rule sees who listens
        with EngineFleet(RolloutConfig(health_timeout_s=120.0), str(model_dir), tmp_path / "logs",
                         num_threads=1) as fleet:
            first = fleet.spawn(0)
            assert first.port == taken
            fleet.wait_healthy()
            again = fleet.get(0)
            assert first.proc.poll() is not None and again is not first
            assert again.port_retries == 1 and again.port != taken and again.serves_its_port()
            assert "another process answers /health there" in (tmp_path / "logs" / "engine-0.log").read_text()
    finally:
        foreign.shutdown()


def test_port_races_are_retried_a_bounded_number_of_times_and_nothing_else_is(tmp_path):
    starts = tmp_path / "starts"
    python = stand_in(tmp_path, f"""#!{sys.executable}
import os, sys
open({str(starts)!r}, "a").write("x")
print(os.environ["ENGINE_DEATH"], flush=True)
sys.exit(1)
""")
    taken = "OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 45747): address already in use"
    cases = [(RolloutConfig(engine_python=str(python)), taken, 1 + MAX_PORT_RETRIES),  # bounded
             (RolloutConfig(engine_python=str(python), base_port=free_port()), taken, 1),  # a fixed port: the user's
             (RolloutConfig(engine_python=str(python)), "RuntimeError: CUDA error: out of memory", 1)]  # a real death
    for rollout, death, expected_starts in cases:
        starts.write_text("")
        fleet = EngineFleet(rollout, "/m", tmp_path / "logs", extra_env={"ENGINE_DEATH": death})
        with pytest.raises(EngineStartError, match="exited with code 1"):
            fleet.start(1)
        assert len(starts.read_text()) == expected_starts, death


def test_sglang_command_and_environment_per_machine(tmp_path):
    python = tmp_path / "sglang-venv-python"
    rollout = RolloutConfig(backend="sglang", engine_python=str(python), extra_server_args=["--max-total-tokens", "64"])
    cpu = EngineFleet(rollout, "/m", tmp_path, device="cpu")
    argv = cpu.command(30001)
    assert argv[:3] == [str(python), "-m", "sglang.launch_server"]
    assert argv[argv.index("--device") + 1] == "cpu" and "--num-threads" not in argv
    assert argv[argv.index("--model-path") + 1] == "/m" and argv[argv.index("--port") + 1] == "30001"
    assert argv[argv.index("--max-total-tokens") + 1] == "64"
    env = cpu.child_env(0, parent_env={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "OMP_NUM_THREADS" not in env
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"  # the user's kept
    assert "GLIBC_TUNABLES" not in cpu.child_env(0, parent_env={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})

    gpu = EngineFleet(rollout, "/m", tmp_path, device="cuda")
    argv = gpu.command(30002, base_gpu_id=0)
    assert "--device" not in argv and argv[argv.index("--base-gpu-id") + 1] == "0"
    env = gpu.child_env(3, gpu_ids=[4, 5])
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5" and "SGLANG_USE_CPU_ENGINE" not in env and "GLIBC_TUNABLES" not in env
    assert env["DAPO_MEGA_ENGINE_INDEX"] == "3"


def test_eval_starts_the_configured_backend(tmp_path, model_dir):
    python, recorded = recorder(tmp_path)
    cmd = [sys.executable, "-m", "dapo_mega.cli", "eval", f"eval.checkpoint={model_dir}", "eval.max_problems=2",
           "rollout.backend=sglang", f"rollout.engine_python={python}", "cluster.device=cpu",
           "rollout.health_timeout_s=60", f"trainer.output_dir={tmp_path / 'out'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()
    assert error[0].startswith("dapo-mega: engine error: engine 0") and "engine-0.log" in error[0]
    assert error[-1] == "stand-in engine: recorded argv, serving nothing"  # the end of its log
    run = json.loads(recorded.read_text().splitlines()[0])
    argv = run["argv"]
    assert argv[:2] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == str(model_dir)
    assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert run["env"]["SGLANG_USE_CPU_ENGINE"] == "1"


def test_health_probe_waits_for_a_health_check_that_takes_over_a_second():
    """SGLang's /health runs a one-token generation and sleeps 1 s before
    answering; a probe with a 1-second timeout never saw it healthy. A stand-in server answers
    /health after 1.5 s: the fleet's probe must still say healthy."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class SlowHealth(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            time.sleep(1.5)
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowHealth)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = EngineEndpoint(f"http://127.0.0.1:{server.server_address[1]}")
        assert is_healthy(endpoint)
        assert not is_healthy(endpoint, timeout_s=1.0)  # what the old 1-second probe saw
    finally:
        server.shutdown()
        server.server_close()


def test_engine_threads_leave_a_cpu_to_the_trainer():
    from dapo_mega.engines.fleet import cpu_threads_per_engine

    assert cpu_threads_per_engine(2, 1) == 1       # this machine: the driver scores on the other core
    assert cpu_threads_per_engine(16, 1) == 15
    assert cpu_threads_per_engine(16, 3) == 5
    assert cpu_threads_per_engine(1, 4) == 1       # never zero


TRAINER_THAT_STARTS_AN_ENGINE = """
import json, sys, threading, time
from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import EngineFleet

backend, python, model, logs = sys.argv[1:5]
extra = ["--max-total-tokens", "4096"] if backend == "sglang" else []
rollout = RolloutConfig(backend=backend, engine_python=python, health_timeout_s=300.0, extra_server_args=extra)
fleet = EngineFleet(rollout, model, logs, num_threads=1, device="cpu")
starter = threading.Thread(target=fleet.start, args=(1,))
starter.start()
starter.join()  # the thread that asked for the engine has ended
print(json.dumps({"engine": fleet.engines[0].pid}), flush=True)
time.sleep(600)
"""


def _running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("backend", ["embedded", pytest.param("sglang", marks=pytest.mark.sglang)])
def test_engines_end_with_a_sigkilled_trainer(tmp_path, model_dir, backend):
    """A trainer SIGKILLed (or crashed) takes its engines with it: each was started through
    tether.py, so the kernel sends it SIGTERM when the trainer's process is gone. The engine was
    asked for from a thread that ended before the kill (the kernel ties the signal to the
    starting thread, so the fleet starts engines from one thread that lives as long as the
    process); it must still be serving then. Every process of the engine (SGLang's scheduler
    and detokenizer too) must be gone within a bounded wait after the trainer is."""
    import time

    import psutil

    if backend == "sglang":
        from sglang_venv import sglang_python_or_skip

        python = str(sglang_python_or_skip())
    else:
        python = sys.executable
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_THAT_STARTS_AN_ENGINE)
    out_path = tmp_path / "trainer.out"
    with open(out_path, "w") as out:
        trainer = subprocess.Popen([sys.executable, str(script), backend, python, str(model_dir), str(tmp_path / "logs")],
                                   stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                   env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    engine_processes = []
    try:
        deadline = time.monotonic() + 300
        while not out_path.read_text().startswith("{") and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert out_path.read_text().startswith("{"), out_path.read_text()[-3000:]
        engine = psutil.Process(json.loads(out_path.read_text().splitlines()[0])["engine"])
        engine_processes = [engine, *engine.children(recursive=True)]
        time.sleep(1.0)
        assert all(_running(p) for p in engine_processes), "the engine ended with the thread that started it"
        assert engine.ppid() == trainer.pid and is_healthy(EngineEndpoint(
            f"http://127.0.0.1:{engine.cmdline()[engine.cmdline().index('--port') + 1]}"))

        trainer.kill()
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(_running(p) for p in engine_processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [f"{p.pid} ({' '.join(p.cmdline()[:3])})" for p in engine_processes if _running(p)]
        assert not left, f"engine processes outlived the SIGKILLed trainer: {left}"
    finally:
        for p in engine_processes:
            if _running(p):
                p.kill()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_tether_refuses_to_start_a_command_whose_parent_is_gone(tmp_path):
    from dapo_mega import tether

    made = tmp_path / "made"
    run = [sys.executable, "-I", "-S", str(tether.__file__)]
    # pid 1 is not our parent: the parent the fleet named is gone, so the command must not start
    gone = subprocess.run(run + ["1", "touch", str(made)], capture_output=True, text=True, timeout=30)
    assert gone.returncode == tether.PARENT_GONE_EXIT and "parent 1 exited" in gone.stderr and not made.exists()
    ours = subprocess.run(run + [str(os.getpid()), "touch", str(made)], capture_output=True, text=True, timeout=30)
    assert ours.returncode == 0 and made.exists()
    missing = subprocess.run(run + [str(os.getpid()), str(tmp_path / "no-python")], capture_output=True, text=True,
                             timeout=30)
    assert missing.returncode == 127 and "cannot run" in missing.stderr and "no-python" in missing.stderr
    assert subprocess.run(run + ["x"], capture_output=True, timeout=30).returncode == 2
