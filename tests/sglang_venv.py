"""Where the tests find the real SGLang server's venv (tools/setup_sglang_cpu.sh builds it), or why not."""

import os
from pathlib import Path

from ci_lane import lane_unavailable

REPO = Path(__file__).resolve().parents[1]


def sglang_python() -> Path:
    """The SGLang venv's interpreter: $DAPO_MEGA_SGLANG_PYTHON, else REPO/.venv-sglang."""
    return Path(os.environ.get("DAPO_MEGA_SGLANG_PYTHON") or REPO / ".venv-sglang" / "bin" / "python")


def sglang_python_or_skip() -> Path:
    """The venv's interpreter; without one the test skips, or fails under CI."""
    python = sglang_python()
    if not python.exists():
        lane_unavailable(f"no SGLang venv at {python}: build one with tools/setup_sglang_cpu.sh "
                         f"{REPO / '.venv-sglang'} --offline DIR (see tools/sglang_cpu/README.md), "
                         f"or set DAPO_MEGA_SGLANG_PYTHON")
    return python
