"""Start and stop embedded engine processes (for the CPU default, tests and benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from dapo_mega.backends.sglang.launch import wait_for_health


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineProcess:
    """`python -m dapo_mega.rollout.server` on 127.0.0.1:<free port>; kill() by pid."""

    def __init__(self, model_path: str, port: Optional[int] = None, api_key: str = "",
                 weight_version: str = "0", extra_args: Sequence[str] = (), log_path: Optional[str] = None,
                 num_threads: int = 1, health_timeout_s: float = 120.0):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "dapo_mega.rollout.server", "--model-path", str(model_path),
                "--host", "127.0.0.1", "--port", str(self.port), "--weight-version", str(weight_version),
                "--num-threads", str(num_threads), *extra_args]
        if api_key:
            argv += ["--api-key", api_key]
        self.log_path = log_path
        out = open(log_path, "wb") if log_path else subprocess.DEVNULL
        env = {**os.environ, "OMP_NUM_THREADS": str(num_threads), "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.api_key = api_key
        self.health_timeout_s = health_timeout_s

    def wait_healthy(self) -> "EngineProcess":
        try:
            wait_for_health(self.url, self.health_timeout_s, api_key=self.api_key, process=self.proc)
        except Exception:
            self.kill()
            raise
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace") if self.log_path else ""


def start_engines(model_path: str, count: int, **kwargs) -> List[EngineProcess]:
    """Start `count` engines concurrently and wait for all of them; kills all on failure."""
    engines = [EngineProcess(model_path, **kwargs) for _ in range(count)]
    try:
        for e in engines:
            e.wait_healthy()
    except Exception:
        for e in engines:
            e.kill()
        raise
    return engines
