"""One NCCL release on both sides of a weight sync (issue #37, item 1).

NCCL refuses a communicator between ranks of different releases ("Mismatched NCCL version
detected", src/init.cc), so a disaggregated run whose learner (torch 2.13.0: NCCL 2.29.7) and
SGLang venv (torch 2.14.1: NCCL 2.30.7) load different ones fails at its first
/init_weights_update_group. Gloo has no such check, so on the CPU the two Pythons are stand-ins
that report an NCCL release the way a CUDA venv's installed package does
(tests/helpers/interpreters.py), read by the same probe that reads torch's on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.interpreters import nccl_package, stand_in_python

from dapo_mega.config import ConfigError, load_config
from dapo_mega.plan.preflight import NcclVersion, check_nccl_agreement, nccl_mismatch, nccl_version

REPO = Path(__file__).resolve().parents[1]


def test_the_rule_installs_the_newer_release_on_the_older_side():
    learner = NcclVersion("/venv/bin/python", "2.29.7", "nvidia-nccl-cu13")
    engines = NcclVersion("/sglang/bin/python", "2.30.7", "torch")
    message = nccl_mismatch(learner, engines)
    assert message.startswith("rollout.engine_python: the engines' Python (/sglang/bin/python) loads NCCL 2.30.7, "
                              "the learner's (/venv/bin/python) NCCL 2.29.7;")
    assert message.endswith("Fix: /venv/bin/python -m pip install --no-deps nvidia-nccl-cu13==2.30.7 "
                            "(docs/cluster.md section 1)")
    assert "Fix: /sglang/bin/python -m pip install --no-deps nvidia-nccl-cu12==2.30.7" in \
        nccl_mismatch(NcclVersion("/venv/bin/python", "2.30.7", "torch"),
                      NcclVersion("/sglang/bin/python", "2.9.6", "nvidia-nccl-cu12"))  # 2.30 > 2.9: by number
    assert nccl_mismatch(learner, NcclVersion("/sglang/bin/python", "2.29.7", "torch")) is None
    assert nccl_mismatch(learner, NcclVersion("/sglang/bin/python", None)) is None  # a CPU engine: no NCCL


def test_stand_ins_report_their_release_and_a_mismatch_is_refused(tmp_path):
    engines = stand_in_python(tmp_path, with_sglang=True, nccl="2.30.7")
    learner = stand_in_python(tmp_path, with_sglang=False, nccl="2.29.7")
    assert nccl_version(str(engines)) == NcclVersion(str(engines), "2.30.7", "nvidia-nccl-cu13")
    assert nccl_version(str(stand_in_python(tmp_path, with_sglang=True))).version is None

    def cfg(mode: str, python: Path):
        return load_config([f"cluster.mode={mode}", "rollout.backend=sglang", f"rollout.engine_python={python}",
                            f"trainer.output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError, match=r"loads NCCL 2\.30\.7, the learner's .* NCCL 2\.29\.7.* Fix: "
                                          rf"{learner} -m pip install --no-deps nvidia-nccl-cu13==2\.30\.7"):
        check_nccl_agreement(cfg("disaggregated", engines), learner_python=str(learner))
    same = stand_in_python(tmp_path / "same", with_sglang=True, nccl="2.29.7")
    check_nccl_agreement(cfg("disaggregated", same), learner_python=str(learner))
    check_nccl_agreement(cfg("colocated", engines), learner_python=str(learner))  # CUDA IPC: no group joins them


def test_train_refuses_before_anything_starts(tmp_path):
    """`dapo-mega train`, disaggregated, learner reporting 2.29.7 (its site on PYTHONPATH),
    engines 2.30.7: exit 2 with one line, no run directory, no engine started."""
    engines = stand_in_python(tmp_path, with_sglang=True, nccl="2.30.7")
    site = nccl_package(tmp_path / "learner_site", "2.29.7")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dapo_mega.cli", "train", "cluster.mode=disaggregated", "cluster.device=cpu",
           "cluster.num_nodes=2", "cluster.engine_nodes=1", "rollout.backend=sglang",
           f"rollout.engine_python={engines}", f"trainer.output_dir={out}"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("dapo-mega: config error: rollout.engine_python: the engines' "
                                                   f"Python ({engines}) loads NCCL 2.30.7"), error
    assert not out.exists()


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
