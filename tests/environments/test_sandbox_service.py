"""The sandbox as a service (issue #47 item 5): `dapo-mega sandbox serve` in its own process,
the python tool sending its runs there with `url`. The hostile programs of test_sandbox.py are
contained there as they are beside the driver, and a service that is gone answers the run as a
`sandbox_error` the model reads: the episode goes on, the run is not stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_sandbox import _leftovers, loopback_listener

from dapo_mega.environments.python_tool import PythonTool
from dapo_mega.environments.sandbox_service import READY

SECRET_ENV = "sk-service-KEY-51"


@pytest.fixture()
def service():
    env = {**os.environ, "OPENAI_API_KEY": SECRET_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "dapo_mega.cli", "sandbox", "serve", "--port", "0", "--wall-s", "4",
                             "--cpu-s", "1", "--memory-mb", "256", "--output-bytes", "2048", "--max-concurrent", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    url, deadline = None, time.monotonic() + 60
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        if line.startswith(READY):
            url = line[len(READY):].strip()
    try:
        assert url, f"the service did not start (exit {proc.poll()})"
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_the_python_tool_runs_its_code_on_the_service(service):
    _, url = service
    tool = PythonTool(url=url)
    result = tool.step("<code>\nprint(6 * 7)\n</code>")
    assert result.observation == "\n<interpreter>\n42\n</interpreter>\n" and result.tool_errors == {}
    assert tool.report()["sandbox"]["service"] == url and tool.report()["sandbox"]["ok"]


def test_the_hostile_programs_are_contained_on_the_service(service, tmp_path):
    _, url = service
    tool = PythonTool(url=url)
    secret = tmp_path / "run_state.json"
    secret.write_text("TOPSECRET-51")
    programs = {
        "secret file": f"print(open({str(secret)!r}).read())",
        "environment": "import os\nprint(os.environ.get('OPENAI_API_KEY'))",
        "connect": "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=2)"
                   "\nprint('connected')",
        "fork bomb": "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                     "        time.sleep(0.01)\n",
    }
    results = {}
    with loopback_listener(8) as (port, accepted):
        for name, code in programs.items():
            results[name] = tool.step(f"<code>\n{code.replace('PORT', str(port))}\n</code>")
    for name, result in results.items():
        assert "TOPSECRET" not in result.observation and SECRET_ENV not in result.observation, (name, result)
        assert "connected" not in result.observation, (name, result)
        assert result.tool_errors.get("sandbox_error") is None, (name, result)  # the service ran each
    assert accepted == [] and secret.read_text() == "TOPSECRET-51"
    deadline = time.monotonic() + 5  # the fork bomb's processes, by their directory (test_sandbox.py)
    while _leftovers("dapo-sandbox-") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _leftovers("dapo-sandbox-") == []


def test_a_service_that_is_gone_answers_a_sandbox_error_the_model_reads(service):
    proc, url = service
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    result = PythonTool(url=url).step("<code>\nprint(1)\n</code>")
    assert not result.done and result.tool_errors == {"sandbox_error": 1}, result
    assert f"the sandbox service at {url} failed" in result.observation
