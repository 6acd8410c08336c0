"""Stand-in interpreters for the checks of `rollout.engine_python` (`preflight.python_has_sglang`)
and of the NCCL each side loads (`plan.nccl`).

A stand-in is this Python without its site-packages (-S), with a site of its own on
PYTHONPATH. For the NCCL check the site is laid out as a CUDA venv's: a stand-in torch whose
import maps torch/lib/libtorch_cuda.so, which needs libnccl.so.2 and finds it as PyPI's
torch does (LD_LIBRARY_PATH first, else its RUNPATH `$ORIGIN/../../nvidia/nccl/lib`: the
nvidia-nccl-cu13 wheel's file), and that wheel's files. Both shared objects are built here
with gcc; the stand-in libnccl.so.2 exports only `ncclGetVersion`, reporting a chosen release.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Optional

TORCH_INIT = '''"""A stand-in torch (tests/helpers/interpreters.py)."""
import ctypes
import os

from torch import cuda, version

__version__ = "2.13.0+stand-in"
_lib = os.path.join(os.path.dirname(__file__), "lib", "libtorch_cuda.so")
if os.path.exists(_lib):  # a CUDA build that links NCCL dynamically, as PyPI's: the import maps libnccl.so.2
    ctypes.CDLL(_lib)
'''


def stand_in_python(root: Path, with_sglang: bool, nccl: Optional[str] = None, torch: Optional[str] = None,
                    torch_nccl: Optional[str] = None, ld_library_path: Optional[Path] = None) -> Path:
    """An interpreter finding a package named sglang or none, at <root>/<what it has>/python.

    nccl             the release of the nvidia-nccl-cu13 wheel in its site (None: none)
    torch            None (no torch; "cuda" where `nccl` is given), "cuda" (loads libnccl.so.2
                     as PyPI's torch does), "static" (NCCL linked into it) or "cpu" (no NCCL)
    torch_nccl       the release torch was compiled against, what `torch.cuda.nccl.version()`
                     says (default: `nccl`, else 2.29.7, the learner's torch 2.13.0's)
    ld_library_path  LD_LIBRARY_PATH of the interpreter (the wrapper sets it)"""
    torch = torch or ("cuda" if nccl else None)
    name = "-".join(p for p in ("sglang" if with_sglang else "no-sglang", nccl and f"nccl{nccl}",
                                torch and f"torch-{torch}", ld_library_path and "ld") if p)
    home = root / name
    site = home / "site"
    site.mkdir(parents=True)
    if with_sglang:
        (site / "sglang").mkdir()
        (site / "sglang" / "__init__.py").write_text("")
    if nccl:
        install_nccl_wheel(site, nccl)
    if torch:
        stand_in_torch(site, torch, torch_nccl or nccl or "2.29.7")
    write_wrapper(home / "python", site, ld_library_path)
    return home / "python"


def write_wrapper(python: Path, site: Path, ld_library_path: Optional[Path] = None) -> Path:
    """The interpreter's script: this Python, -S, `site` on PYTHONPATH (and LD_LIBRARY_PATH)."""
    ld = f"LD_LIBRARY_PATH={ld_library_path} " if ld_library_path else ""
    python.write_text(f'#!/bin/sh\n{ld}PYTHONPATH={site} exec {sys.executable} -S "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def site_of(python: Path) -> Path:
    """The site of a stand-in made by `stand_in_python`."""
    return python.parent / "site"


def build_libnccl(directory: Path, release: str) -> Path:
    """<directory>/libnccl.so.2 (soname libnccl.so.2) whose `ncclGetVersion` reports `release`
    in NCCL's encoding (major·10000 + minor·100 + patch since 2.9, major·1000 before)."""
    major, minor, patch = (int(p) for p in release.split("."))
    code = major * (10000 if (major, minor) >= (2, 9) else 1000) + minor * 100 + patch
    directory.mkdir(parents=True, exist_ok=True)
    return _gcc(f"int ncclGetVersion(int *version) {{ *version = {code}; return 0; }}\n",
                directory / "libnccl.so.2", "-Wl,-soname,libnccl.so.2")


def install_nccl_wheel(site: Path, release: str) -> Path:
    """What `pip install --no-deps nvidia-nccl-cu13==<release>` leaves in `site`: the library
    at nvidia/nccl/lib/libnccl.so.2 and the distribution's metadata, whose RECORD lists it
    (an older release's metadata replaced)."""
    for old in site.glob("nvidia_nccl_cu13-*.dist-info"):
        shutil.rmtree(old)
    library = build_libnccl(site / "nvidia" / "nccl" / "lib", release)
    info = site / f"nvidia_nccl_cu13-{release}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-nccl-cu13\nVersion: {release}\n")
    (info / "RECORD").write_text(f"nvidia/nccl/lib/libnccl.so.2,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return library


def stand_in_torch(site: Path, kind: str, built_with: str) -> Path:
    """A torch package in `site`: "cuda" (torch/lib/libtorch_cuda.so needs libnccl.so.2, RUNPATH
    into the wheel beside it), "static" (a CUDA torch that maps no libnccl) or "cpu". Its
    `torch.cuda.nccl.version()` is `built_with`, and on a CUDA build `is_available()` is True,
    as on a GPU node."""
    package = site / "torch"
    (package / "cuda").mkdir(parents=True)
    (package / "__init__.py").write_text(TORCH_INIT)
    cuda = None if kind == "cpu" else "13.0"
    (package / "version.py").write_text(f"cuda = {cuda!r}\n")
    (package / "cuda" / "__init__.py").write_text(
        f"from torch.cuda import nccl\n\n\ndef is_available():\n    return {cuda is not None}\n")
    (package / "cuda" / "nccl.py").write_text(
        f"def version():  # the header's release, compiled in\n    return {tuple(int(p) for p in built_with.split('.'))}\n")
    if kind == "cuda":
        link = package / "lib" / "link"  # a libnccl.so.2 to link against; the loader finds another at import
        build_libnccl(link, built_with)
        _gcc("int torch_cuda_stand_in(void) { return 0; }\n", package / "lib" / "libtorch_cuda.so",
             "-Wl,--no-as-needed", f"-L{link}", "-l:libnccl.so.2",
             "-Wl,--enable-new-dtags,-rpath,$ORIGIN/../../nvidia/nccl/lib")
        shutil.rmtree(link)
    return package


def _gcc(source: str, out: Path, *flags: str) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-x", "c", "-", "-o", str(out), *flags], input=source, text=True,
                   check=True, capture_output=True)
    return out
