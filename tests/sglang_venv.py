"""Where the tests find the real SGLang server's venv (../shared/sglang-cpu/setup.sh), or why not."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sglang_python() -> Path:
    """The SGLang venv's interpreter: $DAPO_MEGA_SGLANG_PYTHON, else REPO/.venv-sglang."""
    return Path(os.environ.get("DAPO_MEGA_SGLANG_PYTHON") or REPO / ".venv-sglang" / "bin" / "python")


def sglang_python_or_skip() -> Path:
    import pytest

    python = sglang_python()
    if not python.exists():
        pytest.skip(f"no SGLang venv at {python}: build one with ../shared/sglang-cpu/setup.sh "
                    f"{REPO / '.venv-sglang'} (or set DAPO_MEGA_SGLANG_PYTHON)")
    return python
