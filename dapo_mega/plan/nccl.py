"""One NCCL release on both sides of a weight sync (issues #37 and #46).

NCCL refuses a communicator between ranks of different releases ("Mismatched NCCL version
detected", src/init.cc), so a disaggregated run whose learner and SGLang venv load different
ones fails at its first /init_weights_update_group. Before any engine starts, each Python is
asked which NCCL it loads (`plan.nccl_probe`: the libnccl its torch maps, by its
`ncclGetVersion`, not `torch.cuda.nccl.version()`, the release torch was compiled against),
and a mismatch is refused in one line whose fix changes what the older side loads:

    nccl_version(python)          the NCCL `python` loads (this process's, or another's)
    nccl_fix(older, release)      a command that makes `older` load `release`
    nccl_mismatch(learner, engines, learner_on_cpu)  the refusal, or None
    check_nccl_agreement(cfg)     the preflight check (plan.preflight runs it)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from dapo_mega.config import ConfigError, DapoConfig, EngineKind

NCCL_PROBE = Path(__file__).with_name("nccl_probe.py").read_text()
"""What `nccl_version` runs in another interpreter: `plan.nccl_probe`'s source, whose
`__main__` prints `loaded_nccl()` as one JSON line."""

PROBE_TIMEOUT_S = 300
"""Bound of one probe: an interpreter's `import torch` on a cold file system."""

DEFAULT_NCCL_PACKAGE = "nvidia-nccl-cu13"
"""The wheel of the project's CUDA line (constraints-gpu.txt), where neither side names one."""


@dataclass(frozen=True)
class NcclVersion:
    """The NCCL an interpreter loads, as `plan.nccl_probe.loaded_nccl` read it."""

    python: str
    version: Optional[str]
    """"2.30.7", or None where nothing loads NCCL (no torch, a CPU-only torch, a failed probe)."""
    library: Optional[str] = None
    """The libnccl file its torch maps; None where NCCL is linked into torch (or none loads)."""
    package: Optional[str] = None
    """The pip distribution that installed `library` ("nvidia-nccl-cu13"); None for a copy pip
    does not manage (the system's, one on LD_LIBRARY_PATH)."""
    ld_library_path: bool = False
    """`library`'s directory is on LD_LIBRARY_PATH, which the loader searches before torch's
    RUNPATH (the nvidia-nccl-cu* wheel)."""
    torch: Optional[str] = None
    """torch.__version__ in that interpreter."""
    note: Optional[str] = None
    """Where version is None: why."""


def nccl_version(python: str) -> NcclVersion:
    """The NCCL `python` (a path or a name on PATH) loads: `loaded_nccl()` called here when it
    is this interpreter, else the same source run in it."""
    if python == sys.executable:
        from dapo_mega.plan.nccl_probe import loaded_nccl

        found = loaded_nccl()
    else:
        try:
            out = subprocess.run([python, "-c", NCCL_PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return NcclVersion(python, None, note=f"the probe did not run: {exc}")
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            return NcclVersion(python, None, note=f"the probe exited {out.returncode}: "
                                                  f"{(out.stderr.strip().splitlines() or [''])[-1]}")
        found = json.loads(lines[-1])
    known = {f.name for f in fields(NcclVersion)}
    return NcclVersion(python=python, **{k: v for k, v in found.items() if k in known})


def release_key(version: str) -> tuple:
    """"2.30.7" -> (2, 30, 7): releases compared by number (2.30 is newer than 2.9)."""
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))


def nccl_fix(older: NcclVersion, release: str, package: Optional[str] = None) -> str:
    """A command after which `older.python` loads NCCL `release`, by where its library comes
    from. `package`: the wheel to name where `older` has none of its own (the other side's)."""
    wheel = older.package or package or DEFAULT_NCCL_PACKAGE
    pip = f"{older.python} -m pip install --no-deps {wheel}=={release}"
    if older.package:  # the wheel's file is what it loads: pip replaces it
        return pip
    if older.library is None:
        return (f"{older.python}'s torch {older.torch} has NCCL {older.version} linked in, which no package "
                f"replaces: install a torch that loads the {wheel} wheel (PyPI's builds do), then {pip}")
    if older.ld_library_path:
        return (f"take {os.path.dirname(older.library)} off LD_LIBRARY_PATH where {older.python} runs (the "
                f"loader takes its libnccl before the one beside torch), then {pip}")
    return (f"{older.python} loads {older.library}, which pip does not manage: replace it with NCCL {release}'s "
            "libnccl.so.2, or point LD_LIBRARY_PATH at a directory holding one")


def nccl_mismatch(learner: NcclVersion, engines: NcclVersion, learner_on_cpu: bool = False) -> Optional[str]:
    """The refusal when the two sides of a weight-update group would not run one NCCL release,
    None where they do. The fix installs the newer release on the older side: NCCL runs
    programs built against older releases, not the reverse. An engine side without NCCL
    joins over gloo (a CPU engine), and so does a learner on the CPU (`learner_on_cpu`); a
    learner meant for the GPU that loads none while the engines load one is refused (a
    CPU-only torch in the learner's venv)."""
    if not engines.version:
        return None
    head = f"rollout.engine_python: the engines' Python ({engines.python}) loads NCCL {engines.version}, the learner's"
    if not learner.version:
        if learner_on_cpu:
            return None
        return (f"{head} ({learner.python}) none ({learner.note}), so no NCCL weight-update group can join them. "
                "Fix: install the learner's CUDA torch (pip install -c constraints-gpu.txt torch, docs/cluster.md "
                "section 1), or set cluster.device=cpu")
    if learner.version == engines.version:
        return None
    older, newer = sorted((learner, engines), key=lambda side: release_key(side.version))
    return (f"{head} ({learner.python}) NCCL {learner.version}; "
            "NCCL refuses a weight-update group between different releases, so the first weight sync would fail. "
            f"Fix: {nccl_fix(older, newer.version, newer.package)} (docs/cluster.md section 1)")


def check_nccl_agreement(cfg: DapoConfig, learner_python: Optional[str] = None) -> None:
    """A run whose weights go to SGLang engines of another Python over NCCL weight-update groups
    (disaggregated) loads one NCCL release on both sides; train and the Slurm job's prepare and
    engines roles call this before any engine starts. Colocated runs hand weights over by CUDA
    IPC and eval / audit read checkpoints from disk: no group joins the two Pythons there."""
    r = cfg.rollout
    python = learner_python or sys.executable
    if r.backend != EngineKind.SGLANG or cfg.cluster.mode != "disaggregated" or not r.engine_python \
            or r.engine_python == python:
        return
    problem = nccl_mismatch(nccl_version(python), nccl_version(r.engine_python),
                            learner_on_cpu=cfg.cluster.device == "cpu")
    if problem:
        raise ConfigError(problem)
