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


FAKE_APT_GET = '''#!{python}
"""A stand-in apt-get: dpkg's frontend lock, held {hold_s}s per install, as the real one takes it."""
import fcntl, sys, time
from pathlib import Path

args = sys.argv[1:]
wait_s = 0.0
for i, arg in enumerate(args[:-1]):
    if arg == "-o" and args[i + 1].startswith("DPkg::Lock::Timeout="):
        wait_s = float(args[i + 1].split("=", 1)[1])
with open({log!r}, "a") as log:
    log.write(" ".join(args) + "\\n")
if "install" not in args:
    sys.exit(0)
with open({dpkg_lock!r}, "a") as lock:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                sys.exit("E: Unable to acquire the dpkg frontend lock ({dpkg_lock}), is another process using it?")
            time.sleep(0.05)
    time.sleep({hold_s})
    for name in {binaries!r}:
        path = Path({bindir!r}, name)
        path.write_text("#!/bin/sh\\n")
        path.chmod(0o755)
'''

INSTALL_ONCE = '''
import os, sys
sys.path.insert(0, {tests!r})
os.geteuid = lambda: 0  # the stand-in needs no root; the rule under test is the waiting
import slurm_cluster
from pathlib import Path
why_not = slurm_cluster.ensure_installed(60, search_dirs=[Path({bindir!r})], apt_get={apt_get!r},
                                         lock_path=Path({lock!r}))
sys.exit(why_not)
'''


def test_two_workers_installing_slurm_at_once_both_succeed(tmp_path):
    """Two pytest workers reach the Slurm fixture together on a machine without Slurm, while
    another apt (say, the SGLang setup's) still holds dpkg's lock: both wait, apt-get runs once,
    and both find the binaries (before the lock, one failed on dpkg's lock)."""
    import fcntl
    import subprocess
    import sys
    import time
    from pathlib import Path

    bindir, log, dpkg_lock = tmp_path / "bin", tmp_path / "apt.log", tmp_path / "dpkg-lock-frontend"
    bindir.mkdir()
    apt_get = tmp_path / "apt-get"
    apt_get.write_text(FAKE_APT_GET.format(python=sys.executable, hold_s=1.5, log=str(log),
                                           dpkg_lock=str(dpkg_lock), binaries=slurm_cluster.SLURM_BINARIES,
                                           bindir=str(bindir)))
    apt_get.chmod(0o755)
    script = INSTALL_ONCE.format(tests=str(Path(__file__).parent), bindir=str(bindir), apt_get=str(apt_get),
                                 lock=str(tmp_path / "install.lock"))
    with open(dpkg_lock, "a") as other_apt:
        fcntl.flock(other_apt, fcntl.LOCK_EX)
        workers = [subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
                   for _ in range(2)]
        time.sleep(1.0)
    results = [(w.wait(timeout=60), w.stderr.read()) for w in workers]
    assert results == [(0, ""), (0, "")], results
    assert slurm_cluster.missing_binaries([bindir]) == []
    installs = [line for line in log.read_text().splitlines() if "install" in line.split()]
    assert len(installs) == 1, installs  # the second worker waited, then found Slurm installed
    assert "DPkg::Lock::Timeout=" in installs[0]
    assert installs[0].split()[-len(slurm_cluster.DEBIAN_PACKAGES):] == list(slurm_cluster.DEBIAN_PACKAGES)
