"""Every command that starts SGLang engines refuses, before it starts or writes anything, when
their Python (`rollout.engine_python`, or this one when it is empty) cannot import sglang:
`dapo-mega train`, `eval` and `audit`, and the Slurm job's prepare and engines roles
(`preflight.check_engine_python`; the launch pipeline's check at submit time is in
tests/launch/test_pipeline.py). On a GPU cluster the learner's environment has no SGLang, so
an empty `rollout.engine_python` there used to surface as an engine that died at start.

Stand-in interpreters (tests/helpers/interpreters.py): this Python without its site-packages
(`-S`), with or without a package named sglang on its path."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.interpreters import stand_in_python

from dapo_mega.config import ConfigError, RolloutConfig, load_config
from dapo_mega.plan.preflight import check_engine_python, python_has_sglang

REPO = Path(__file__).resolve().parents[1]
LACKS = (r"^rollout.engine_python: \S+/no-sglang/python cannot import sglang, so no SGLang engine can start\. "
         r"Fix: point it at the bin/python of the SGLang venv")


@pytest.fixture
def lacking(tmp_path) -> Path:
    return stand_in_python(tmp_path, with_sglang=False)


def test_the_rule_asks_the_engines_python(tmp_path, lacking):
    having = stand_in_python(tmp_path, with_sglang=True)
    assert python_has_sglang(str(having)) and not python_has_sglang(str(lacking))
    assert not python_has_sglang(str(tmp_path / "nowhere" / "python"))
    with pytest.raises(ConfigError, match=LACKS):
        check_engine_python(RolloutConfig(backend="sglang", engine_python=str(lacking)))
    check_engine_python(RolloutConfig(backend="sglang", engine_python=str(having)))
    with pytest.raises(ConfigError, match=r"^rollout.engine_python: .*/nowhere/bin/python is not an executable"):
        check_engine_python(RolloutConfig(backend="sglang", engine_python=str(tmp_path / "nowhere/bin/python")))
    check_engine_python(RolloutConfig(backend="embedded", engine_python=str(lacking)))  # no SGLang engine
    # empty: this Python's engines; refused where it has no SGLang (this lane), with the fix
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ConfigError, match=r"^rollout.engine_python: empty.*cannot import sglang.*Fix: set "):
            check_engine_python(RolloutConfig(backend="sglang"))
    else:
        check_engine_python(RolloutConfig(backend="sglang"))  # one environment
    # the trainer attaches to engines someone else started; who starts them is checked, whatever they say
    for attached in (RolloutConfig(backend="sglang", engine_python=str(lacking), engine_registry=str(tmp_path)),
                     RolloutConfig(backend="sglang", engine_python=str(lacking), engine_urls=["http://127.0.0.1:1"])):
        check_engine_python(attached)
        with pytest.raises(ConfigError, match=LACKS):
            check_engine_python(attached, starts_engines=True)


def test_eval_refuses_before_starting_an_engine(tmp_path, lacking):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dapo_mega.cli", "eval", f"eval.checkpoint={tmp_path}", "rollout.backend=sglang",
           f"rollout.engine_python={lacking}", "cluster.device=cpu", f"trainer.output_dir={out}",
           "rollout.engine_urls=[http://127.0.0.1:1]"]  # eval starts its own engines all the same
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"dapo-mega: config error: rollout.engine_python: {lacking} "
                                                   "cannot import sglang"), error
    assert not out.exists()  # no engine log, no result


def test_audit_refuses_before_exporting_or_starting(tmp_path, lacking):
    from dapo_mega.audit.run import parse_audit_args, run_audit

    options, overrides = parse_audit_args(["--out", str(tmp_path / "audit"), "rollout.backend=sglang",
                                           f"rollout.engine_python={lacking}", "cluster.device=cpu",
                                           f"trainer.output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError, match=LACKS):
        run_audit(load_config(overrides), options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-sglang"]  # no run directory, no sheet


def test_slurm_prepare_and_engines_roles_refuse_before_any_role(tmp_path, lacking):
    import dapo_mega.launch as launch

    cfg = load_config(["+experiment=tiny_cpu_slurm", f"trainer.output_dir={tmp_path / 'out'}",
                       "rollout.backend=sglang", f"rollout.engine_python={lacking}"])
    with pytest.raises(ConfigError, match=LACKS):  # the sbatch script exits 2 before starting a role
        launch.run_prepare(cfg, "colocated", 2, "77")
    assert not (tmp_path / "out").exists()  # no log directory, no registry, no tiny model
    # the engines role run alone (its registry is where it announces, not engines to attach to)
    cfg = load_config(["+experiment=tiny_cpu_slurm", f"trainer.output_dir={tmp_path / 'out'}",
                       "rollout.backend=sglang", f"rollout.engine_python={lacking}",
                       f"rollout.engine_registry={tmp_path / 'out' / 'engines'}"])
    task = launch.SlurmTask(job_id="42", proc_id=0, num_tasks=1, node_id=0, num_nodes=2, local_id=0,
                            tasks_on_node=1, node_name="n1")
    with pytest.raises(ConfigError, match=LACKS):
        launch.run_engines(cfg, task, 2, {})
    assert not (tmp_path / "out").exists()
