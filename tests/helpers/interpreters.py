"""Stand-in interpreters for the checks of `rollout.engine_python` (`preflight.python_has_sglang`)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path


def stand_in_python(root: Path, with_sglang: bool) -> Path:
    """This Python without its site-packages (-S), finding a package named sglang or none:
    <root>/sglang/python or <root>/no-sglang/python."""
    home = root / ("sglang" if with_sglang else "no-sglang")
    (home / "site").mkdir(parents=True)
    if with_sglang:
        (home / "site" / "sglang").mkdir()
        (home / "site" / "sglang" / "__init__.py").write_text("")
    python = home / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={home / "site"} exec {sys.executable} -S "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python
