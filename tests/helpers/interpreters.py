"""Stand-in interpreters for the checks of `rollout.engine_python` (`preflight.python_has_sglang`)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path
from typing import Optional


def stand_in_python(root: Path, with_sglang: bool, nccl: Optional[str] = None) -> Path:
    """This Python without its site-packages (-S), finding a package named sglang or none:
    <root>/sglang/python or <root>/no-sglang/python (with `nccl`: <root>/sglang-nccl<v>/python,
    whose site has the metadata of nvidia-nccl-cu13 at that version, as a CUDA venv has)."""
    home = root / (("sglang" if with_sglang else "no-sglang") + (f"-nccl{nccl}" if nccl else ""))
    (home / "site").mkdir(parents=True)
    if with_sglang:
        (home / "site" / "sglang").mkdir()
        (home / "site" / "sglang" / "__init__.py").write_text("")
    if nccl:
        nccl_package(home / "site", nccl)
    python = home / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={home / "site"} exec {sys.executable} -S "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def nccl_package(site: Path, version: str) -> Path:
    """The installed-package metadata of nvidia-nccl-cu13 `version` in `site` (what pip leaves,
    and what `preflight.NCCL_PROBE` reads where torch has no CUDA): a site on PYTHONPATH makes
    an interpreter report that NCCL."""
    info = site / f"nvidia_nccl_cu13-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-nccl-cu13\nVersion: {version}\n")
    return site
