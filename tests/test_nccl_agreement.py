"""One NCCL release on both sides of a weight sync (issues #37 item 1, #46).

NCCL refuses a communicator between ranks of different releases ("Mismatched NCCL version
detected", src/init.cc), so a disaggregated run whose learner (torch 2.13.0: NCCL 2.29.7) and
SGLang venv (torch 2.14.1: NCCL 2.30.7) load different ones fails at its first
/init_weights_update_group. Each side is asked which library its torch loads and that
library's `ncclGetVersion`, not `torch.cuda.nccl.version()` (the release torch was compiled
against: after the documented `pip install --no-deps nvidia-nccl-cu13==2.30.7` it still says
2.29.7). Gloo has no such check, so on the CPU the two Pythons are stand-ins whose torch
loads a libnccl.so.2 built here, found as PyPI's torch finds it (tests/helpers/interpreters.py),
and each refusal's fix is applied to the stand-in to see that it is the one that works.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.interpreters import build_libnccl, install_nccl_wheel, site_of, stand_in_python, write_wrapper

from dapo_mega.config import ConfigError, load_config
from dapo_mega.plan.nccl import NcclVersion, nccl_mismatch, nccl_version
from dapo_mega.plan.preflight import check_nccl_agreement

REPO = Path(__file__).resolve().parents[1]

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="the stand-in libnccl.so.2 is built with gcc")


def _cfg(tmp_path: Path, engines: Path, mode: str = "disaggregated", device: str = "auto"):
    return load_config([f"cluster.mode={mode}", f"cluster.device={device}", "rollout.backend=sglang",
                        f"rollout.engine_python={engines}", f"trainer.output_dir={tmp_path / 'out'}"])


def test_the_fix_installs_the_newer_release_on_the_older_side_where_its_library_comes_from():
    wheel = NcclVersion("/venv/bin/python", "2.29.7", "/venv/site/nvidia/nccl/lib/libnccl.so.2", "nvidia-nccl-cu13")
    engines = NcclVersion("/sglang/bin/python", "2.30.7", "/sglang/site/nvidia/nccl/lib/libnccl.so.2",
                          "nvidia-nccl-cu13")
    message = nccl_mismatch(wheel, engines)
    assert message.startswith("rollout.engine_python: the engines' Python (/sglang/bin/python) loads NCCL 2.30.7, "
                              "the learner's (/venv/bin/python) NCCL 2.29.7;")
    assert message.endswith("Fix: /venv/bin/python -m pip install --no-deps nvidia-nccl-cu13==2.30.7 "
                            "(docs/cluster.md section 1)")
    cu12 = NcclVersion("/sglang/bin/python", "2.9.6", "/s/libnccl.so.2", "nvidia-nccl-cu12")
    newer = NcclVersion("/venv/bin/python", "2.30.7", "/v/libnccl.so.2", "nvidia-nccl-cu13")
    assert "Fix: /sglang/bin/python -m pip install --no-deps nvidia-nccl-cu12==2.30.7" in \
        nccl_mismatch(newer, cu12)  # 2.30 > 2.9: by number, and the older side's own CUDA line
    # a copy pip does not manage: pip would not change what is loaded
    ld = NcclVersion("/venv/bin/python", "2.29.7", "/opt/nccl/lib/libnccl.so.2", None, ld_library_path=True)
    assert "Fix: take /opt/nccl/lib off LD_LIBRARY_PATH where /venv/bin/python runs" in nccl_mismatch(ld, engines)
    assert "then /venv/bin/python -m pip install --no-deps nvidia-nccl-cu13==2.30.7" in nccl_mismatch(ld, engines)
    system = NcclVersion("/venv/bin/python", "2.29.7", "/usr/lib/x86_64-linux-gnu/libnccl.so.2.29.7")
    assert ("Fix: /venv/bin/python loads /usr/lib/x86_64-linux-gnu/libnccl.so.2.29.7, which pip does not manage: "
            "replace it with NCCL 2.30.7's libnccl.so.2") in nccl_mismatch(system, engines)
    linked = NcclVersion("/venv/bin/python", "2.29.7", None, torch="2.13.0")
    assert "Fix: /venv/bin/python's torch 2.13.0 has NCCL 2.29.7 linked in" in nccl_mismatch(linked, engines)
    # agreement, and the sides without NCCL
    assert nccl_mismatch(wheel, NcclVersion("/sglang/bin/python", "2.29.7", "/s/libnccl.so.2")) is None
    assert nccl_mismatch(wheel, NcclVersion("/sglang/bin/python", None)) is None  # a CPU engine: gloo
    cpu_torch = NcclVersion("/venv/bin/python", None, torch="2.13.0+cpu", note="torch 2.13.0+cpu has no CUDA")
    assert "the learner's (/venv/bin/python) none (torch 2.13.0+cpu has no CUDA)" in nccl_mismatch(cpu_torch, engines)
    assert nccl_mismatch(cpu_torch, engines, learner_on_cpu=True) is None  # a CPU learner joins over gloo
    assert nccl_mismatch(cpu_torch, NcclVersion("/sglang/bin/python", None)) is None  # the CPU lane


@needs_gcc
def test_the_library_torch_loads_is_read_not_the_release_torch_was_built_with(tmp_path):
    """The issue's learner after the documented fix: torch 2.13.0 (built against 2.29.7) with
    nvidia-nccl-cu13 2.30.7 installed loads 2.30.7; with engines on 2.30.7 the run is accepted."""
    learner = stand_in_python(tmp_path, with_sglang=False, nccl="2.30.7", torch_nccl="2.29.7")
    engines = stand_in_python(tmp_path, with_sglang=True, nccl="2.30.7")
    check_nccl_agreement(_cfg(tmp_path, engines), learner_python=str(learner))
    assert nccl_version(str(learner)) == NcclVersion(
        str(learner), "2.30.7", library=str(site_of(learner) / "nvidia" / "nccl" / "lib" / "libnccl.so.2"),
        package="nvidia-nccl-cu13", torch="2.13.0+stand-in")


@needs_gcc
def test_a_mismatch_is_refused_and_its_fix_makes_the_older_side_load_the_newer_release(tmp_path):
    learner = stand_in_python(tmp_path, with_sglang=False, nccl="2.29.7")
    engines = stand_in_python(tmp_path, with_sglang=True, nccl="2.30.7")
    with pytest.raises(ConfigError, match=r"loads NCCL 2\.30\.7, the learner's .* NCCL 2\.29\.7.* Fix: "
                                          rf"{learner} -m pip install --no-deps nvidia-nccl-cu13==2\.30\.7 "):
        check_nccl_agreement(_cfg(tmp_path, engines), learner_python=str(learner))
    check_nccl_agreement(_cfg(tmp_path, engines, mode="colocated"), learner_python=str(learner))  # CUDA IPC
    install_nccl_wheel(site_of(learner), "2.30.7")  # what the fix's pip command does to the learner's site
    check_nccl_agreement(_cfg(tmp_path, engines), learner_python=str(learner))


@needs_gcc
def test_a_library_on_ld_library_path_is_named_and_taking_it_off_is_the_fix(tmp_path):
    """LD_LIBRARY_PATH comes before torch's RUNPATH: a module's NCCL there wins over the wheel,
    so the pip command alone would change nothing."""
    module = build_libnccl(tmp_path / "module" / "lib", "2.29.7").parent
    learner = stand_in_python(tmp_path, with_sglang=False, nccl="2.30.7", torch_nccl="2.29.7",
                              ld_library_path=module)
    engines = stand_in_python(tmp_path, with_sglang=True, nccl="2.30.7")
    with pytest.raises(ConfigError, match=rf"Fix: take {module} off LD_LIBRARY_PATH where {learner} runs .*then "
                                          rf"{learner} -m pip install --no-deps nvidia-nccl-cu13==2\.30\.7"):
        check_nccl_agreement(_cfg(tmp_path, engines), learner_python=str(learner))
    found = nccl_version(str(learner))
    assert (found.version, found.library, found.package, found.ld_library_path) == \
        ("2.29.7", str(module / "libnccl.so.2"), None, True)
    write_wrapper(learner, site_of(learner))  # LD_LIBRARY_PATH without the module's directory
    check_nccl_agreement(_cfg(tmp_path, engines), learner_python=str(learner))


@needs_gcc
def test_a_learner_that_loads_no_nccl_is_refused_where_the_engines_load_one(tmp_path):
    """A CPU-only torch in the learner's venv: said, not passed; where both lack NCCL (the CPU
    lane) or the learner is on the CPU (gloo), the run goes on."""
    learner = stand_in_python(tmp_path, with_sglang=False, torch="cpu")
    engines = stand_in_python(tmp_path, with_sglang=True, nccl="2.30.7")
    with pytest.raises(ConfigError, match=rf"the learner's \({learner}\) none \(torch 2\.13\.0\+stand-in has no "
                                          r"CUDA and maps no libnccl\).* Fix: install the learner's CUDA torch"):
        check_nccl_agreement(_cfg(tmp_path, engines), learner_python=str(learner))
    check_nccl_agreement(_cfg(tmp_path, engines, device="cpu"), learner_python=str(learner))
    cpu_engines = stand_in_python(tmp_path, with_sglang=True, torch="cpu")
    check_nccl_agreement(_cfg(tmp_path, cpu_engines), learner_python=str(learner))


@needs_gcc
def test_the_probe_reports_a_torch_without_one_and_nccl_linked_into_torch(tmp_path):
    no_torch = nccl_version(str(stand_in_python(tmp_path, with_sglang=True)))
    assert no_torch.version is None and no_torch.note.startswith("torch does not import (ModuleNotFoundError")
    static = nccl_version(str(stand_in_python(tmp_path, with_sglang=True, torch="static", torch_nccl="2.28.9")))
    assert (static.version, static.library) == ("2.28.9", None)  # linked in: the built-with release runs
    # a CUDA torch whose libnccl.so.2 is nowhere does not import, as PyPI's without its wheel
    missing = nccl_version(str(stand_in_python(tmp_path, with_sglang=False, torch="cuda")))
    assert missing.version is None and "libnccl.so.2" in missing.note


def test_this_python_is_probed_by_the_code_another_runs(tmp_path):
    """In this process the probe is called, elsewhere its source runs: one answer."""
    here = nccl_version(sys.executable)
    other = tmp_path / "python"
    other.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    other.chmod(0o755)
    assert nccl_version(str(other)) == NcclVersion(**{**here.__dict__, "python": str(other)})


@needs_gcc
def test_train_refuses_before_anything_starts(tmp_path):
    """`dapo-mega train`, disaggregated, its process mapping a libnccl.so.2 of 2.29.7 (loaded at
    start by a sitecustomize, as a CUDA torch's import would), engines 2.30.7: exit 2 with one
    line, no run directory, no engine started."""
    engines = stand_in_python(tmp_path, with_sglang=True, nccl="2.30.7")
    library = build_libnccl(tmp_path / "learner_lib", "2.29.7")
    preload = tmp_path / "preload"
    preload.mkdir()
    (preload / "sitecustomize.py").write_text(f"import ctypes\nctypes.CDLL({str(library)!r})\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dapo_mega.cli", "train", "cluster.mode=disaggregated", "cluster.device=cpu",
           "cluster.num_nodes=2", "cluster.engine_nodes=1", "rollout.backend=sglang",
           f"rollout.engine_python={engines}", f"trainer.output_dir={out}"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(preload), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("dapo-mega: config error: rollout.engine_python: the engines' "
                                                   f"Python ({engines}) loads NCCL 2.30.7, the learner's "
                                                   f"({sys.executable}) NCCL 2.29.7;"), error
    assert f"Fix: {sys.executable} loads {library}, which pip does not manage" in error[0]
    assert not out.exists()


@needs_gcc
def test_slurm_prepare_and_engines_roles_refuse(tmp_path, monkeypatch):
    import dapo_mega.launch as launch
    import dapo_mega.plan.preflight as preflight

    engines = stand_in_python(tmp_path, with_sglang=True, nccl="2.30.7")
    learner = stand_in_python(tmp_path, with_sglang=False, nccl="2.29.7")
    real = preflight.check_nccl_agreement
    monkeypatch.setattr(preflight, "check_nccl_agreement", lambda cfg: real(cfg, learner_python=str(learner)))
    cfg = load_config(["+experiment=tiny_cpu_slurm", f"trainer.output_dir={tmp_path / 'out'}",
                       "cluster.mode=disaggregated", "cluster.engine_nodes=1", "rollout.backend=sglang",
                       f"rollout.engine_python={engines}"])
    with pytest.raises(ConfigError, match=r"loads NCCL 2\.30\.7"):
        launch.run_prepare(cfg, "disaggregated", 2, "77")
    assert not (tmp_path / "out").exists()
    task = launch.SlurmTask(job_id="42", proc_id=0, num_tasks=1, node_id=0, num_nodes=2, local_id=0,
                            tasks_on_node=1, node_name="n1")
    with pytest.raises(ConfigError, match=r"loads NCCL 2\.30\.7"):
        launch.run_engines(cfg, task, 2, {})
