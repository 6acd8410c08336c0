"""Which NCCL a Python loads: the libnccl its torch maps, asked for its release with NCCL's
own `ncclGetVersion`.

`torch.cuda.nccl.version()` is not that: it returns NCCL_MAJOR / NCCL_MINOR / NCCL_PATCH of
the header torch was compiled against (torch/csrc/cuda/nccl.cpp `version()`), whatever
library the process runs. After `pip install --no-deps nvidia-nccl-cu13==2.30.7` a torch
built against 2.29.7 runs 2.30.7 and still says 2.29.7 (verl PR #6621 met the same). A CUDA
torch maps the library when it is imported, GPU or not: libtorch_cuda.so needs libnccl.so.2,
which the dynamic loader finds first on LD_LIBRARY_PATH, else through its RUNPATH in the
nvidia-nccl-cu* wheel beside torch (`$ORIGIN/../../nvidia/nccl/lib`), else in the system's.
This reads the one mapped (/proc/self/maps), so it answers what the loader chose, not what
a search of our own would find (`ctypes.CDLL("libnccl.so.2")` may pick another copy).

Standard library only: `plan.nccl` imports this module in its own Python and runs its
source in another (the SGLang venv's, which has no dapo_mega), so both read one code.
Run as a script it prints `loaded_nccl()` as one JSON line.
"""

from __future__ import annotations

import ctypes
import json
import os
from importlib import metadata
from typing import Dict, List, Optional

NCCL_SUCCESS = 0
"""ncclSuccess, what `ncclGetVersion` returns when it filled in the release."""


def loaded_nccl() -> Dict[str, object]:
    """The NCCL this Python loads once torch is imported:

    version          "2.30.7", or None where nothing loads NCCL (no torch, a CPU-only torch)
    library          the libnccl file mapped in the process, or None
    package          the pip distribution whose files hold `library` ("nvidia-nccl-cu13"),
                     or None (a system copy, one from LD_LIBRARY_PATH, or NCCL linked into torch)
    ld_library_path  whether `library`'s directory is on LD_LIBRARY_PATH (which the loader
                     searches before torch's RUNPATH)
    torch, cuda      torch.__version__ and torch.version.cuda, None where torch does not import
    note             where version is None: why

    A CUDA torch that maps no libnccl has NCCL linked into it: the release it was built
    against is then the one it runs, and `library` is None."""
    found: Dict[str, object] = {"version": None, "library": None, "package": None, "ld_library_path": False,
                                "torch": None, "cuda": None, "note": None}
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any failure of the import: nothing here loads NCCL
        found["note"] = f"torch does not import ({type(exc).__name__}: {exc})"
        return found
    found["torch"] = getattr(torch, "__version__", None)
    found["cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    libraries = mapped_nccl_libraries()
    if libraries:
        library = libraries[0]
        found.update(library=library, package=owning_package(library), ld_library_path=on_ld_library_path(library))
        try:
            found["version"] = library_release(library)
        except (OSError, AttributeError) as exc:  # not loadable here, or no ncclGetVersion in it
            found["note"] = f"{library}: no release from ncclGetVersion ({exc})"
    elif found["cuda"]:
        try:
            import torch.cuda.nccl

            found["version"] = ".".join(str(v) for v in torch.cuda.nccl.version()[:3])
        except Exception as exc:  # noqa: BLE001 - a CUDA torch built without NCCL
            found["note"] = f"torch {found['torch']} maps no libnccl and reports none linked in ({exc})"
    else:
        found["note"] = f"torch {found['torch']} has no CUDA and maps no libnccl"
    return found


def mapped_nccl_libraries() -> List[str]:
    """Paths of the libnccl shared objects mapped in this process, in address order (one,
    unless two copies were loaded; NCCL's network plugins, libnccl-net*, are not NCCL)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:  # not Linux: no NCCL either
        return []
    paths: List[str] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if os.path.basename(path).startswith("libnccl.so") and path not in paths:
            paths.append(path)
    return paths


def library_release(path: str) -> str:
    """The release of the NCCL at `path` by its `ncclGetVersion`: major·10000 + minor·100 +
    patch since 2.9, major·1000 + minor·100 + patch before. Opening a mapped file by its path
    returns the handle already loaded; no GPU is needed."""
    code = ctypes.c_int()
    result = ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code))
    if result != NCCL_SUCCESS:
        raise OSError(f"ncclGetVersion returned {result}")
    major, rest = divmod(code.value, 10000 if code.value >= 10000 else 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def owning_package(path: str) -> Optional[str]:
    """The installed distribution whose RECORD lists the file at `path` (lower-case name), or
    None where pip did not install it."""
    real = os.path.realpath(path)
    for dist in metadata.distributions():
        for file in dist.files or ():
            if file.name.startswith("libnccl") and os.path.realpath(dist.locate_file(file)) == real:
                return (dist.metadata["Name"] or "").lower() or None
    return None


def on_ld_library_path(path: str) -> bool:
    """Whether the directory of `path` is an entry of LD_LIBRARY_PATH."""
    directory = os.path.realpath(os.path.dirname(path))
    return any(entry and os.path.realpath(entry) == directory
               for entry in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep))


if __name__ == "__main__":
    print(json.dumps(loaded_nccl()))
