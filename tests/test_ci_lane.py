"""A lane that cannot run skips on a laptop and fails under CI=true, with its reason."""

import pytest
import slurm_cluster
from ci_lane import in_ci
from sglang_venv import sglang_python_or_skip


@pytest.mark.parametrize("value,expected", [("true", True), ("TRUE", True), ("1", True), ("yes", True),
                                            ("", False), ("false", False), ("0", False)])
def test_in_ci_reads_the_ci_variable(monkeypatch, value, expected):
    monkeypatch.setenv("CI", value)
    assert in_ci() is expected


def test_a_missing_sglang_venv_skips_outside_ci(monkeypatch, tmp_path):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("DAPO_MEGA_SGLANG_PYTHON", str(tmp_path / "absent" / "bin" / "python"))
    with pytest.raises(pytest.skip.Exception, match="no SGLang venv at .*absent.*tools/setup_sglang_cpu.sh"):
        sglang_python_or_skip()


def test_a_missing_sglang_venv_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("DAPO_MEGA_SGLANG_PYTHON", str(tmp_path / "absent" / "bin" / "python"))
    with pytest.raises(pytest.fail.Exception, match="CI=true and this lane cannot run: no SGLang venv at .*absent"):
        sglang_python_or_skip()


def test_a_present_sglang_venv_is_returned_under_ci(monkeypatch, tmp_path):
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("DAPO_MEGA_SGLANG_PYTHON", str(python))
    assert sglang_python_or_skip() == python


@pytest.mark.parametrize("ci,raised", [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_slurm_that_cannot_be_installed_fails_under_ci_and_skips_outside(monkeypatch, tmp_path, ci, raised):
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster, "ensure_installed", lambda: "apt-get install slurm failed: no network")
    with pytest.raises(raised, match="no local Slurm: apt-get install slurm failed: no network"):
        slurm_cluster.start_or_skip(tmp_path)


def test_slurm_without_root_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.fail.Exception, match="runs its daemons as root"):
        slurm_cluster.start_or_skip(tmp_path)


def test_slurm_daemons_that_do_not_start_fail_under_ci(monkeypatch, tmp_path):
    def refuse(self, timeout_s=60.0):
        raise RuntimeError("slurmctld exited with 1")

    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster, "ensure_installed", lambda: None)
    monkeypatch.setattr(slurm_cluster.LocalSlurmCluster, "start", refuse)
    with pytest.raises(pytest.fail.Exception, match="did not start: slurmctld exited with 1"):
        slurm_cluster.start_or_skip(tmp_path)
