"""Where a benchmark's figures come from: the commit (and whether the tree was dirty) and the
machine. Every result file records both; `run.py`, `timing.py` and the benchmarks read them here."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Optional

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def git_state() -> Dict[str, Any]:
    """{"commit": HEAD or "unknown", "dirty": uncommitted changes?, "dirty_paths": up to 40}."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    paths = [line[3:] for line in (status or "").splitlines() if line.strip()]
    return {"commit": head.strip() if head else "unknown", "dirty": bool(paths), "dirty_paths": paths[:40]}


def machine_info() -> Dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "load_average": os.getloadavg()[0], "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
