"""slurm/colocated.sbatch and slurm/disaggregated.sbatch on a real two-node Slurm cluster.

The module fixture starts the private local cluster of tests/slurm_cluster.py (n1, n2 on
this machine) once; each test submits the real sbatch script with the tiny CPU
experiment, waits with a bound and checks the run directory and the job's exit state.
Roles run the stand-ins of tests/slurm_cluster.py (DAPO_MEGA_LEARNER_CMD /
DAPO_MEGA_ENGINE_CMD) where the real trainer/engine are not available, so what is tested
is the launch machinery itself: roles, ranks, rendezvous, registry, logs, teardown, exit.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import LocalSlurmCluster, ensure_installed

pytestmark = [pytest.mark.slurm]

REPO = Path(__file__).resolve().parent.parent
HELPER = Path(__file__).resolve().parent / "slurm_cluster.py"
JOB_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = ensure_installed()
    if reason:
        pytest.skip(f"no local Slurm: {reason}")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs its daemons as root (SlurmUser=root)")
    c = LocalSlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
    except Exception as exc:  # the daemons could not come up on this machine
        c.stop()
        pytest.skip(f"local Slurm cluster did not start: {exc}")
    yield c
    c.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _role_env(**extra: str) -> dict:
    env = {"LEARNERS_PER_NODE": "1", "MASTER_PORT": str(_free_port()), "PYTHON": sys.executable,
           "DAPO_MEGA_LEARNER_CMD": f"{sys.executable} {HELPER} standin-learner",
           "DAPO_MEGA_ENGINE_CMD": f"{sys.executable} {HELPER} standin-engine"}
    env.update(extra)
    return env


def _submit(cluster, script: str, out_dir: Path, run_name: str, sbatch_args, overrides=(), **env) -> int:
    # job-wide options first: after a ':' they would apply to the last het component only
    args = [f"--output={out_dir}/slurm-%j.out", f"-J{run_name}", *sbatch_args, str(REPO / "slurm" / script),
            "+experiment=tiny_cpu_slurm", f"trainer.output_dir={out_dir}", f"trainer.run_name={run_name}",
            *overrides]
    return cluster.sbatch(args, extra_env=_role_env(**env), cwd=REPO)


def _metrics(run_dir: Path) -> list:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _batch_log(out_dir: Path, job_id: int) -> str:
    return (out_dir / f"slurm-{job_id}.out").read_text(errors="replace")


def test_colocated_job_completes_with_records_and_per_role_logs(cluster, tmp_path):
    job = _submit(cluster, "colocated.sbatch", tmp_path, "coloc", ["--nodes=2", "--mem=3000"])
    info = cluster.wait_job(job, JOB_TIMEOUT_S)
    log = _batch_log(tmp_path, job)
    assert info["JobState"] == "COMPLETED", log
    assert info["ExitCode"] == "0:0"
    run_dir = tmp_path / "coloc"
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    # two learner ranks (one per node) met at the rendezvous: ranks 0+1 summed to 1
    assert all(m["world_size"] == 2 and m["rank_sum"] == 1.0 and m["allreduce"] == 2.0 for m in metrics)
    # both engines (one per node) were announced and answered /health with the job's key
    assert len(metrics[0]["engines"]) == 2
    assert sorted(p.name for p in (run_dir / "engines").glob("engine-*.json")) == ["engine-0.json", "engine-1.json"]
    assert sorted(p.name for p in (run_dir / "ledger").iterdir()) == [f"step_{s:06d}.jsonl" for s in (1, 2, 3, 4)]
    assert (run_dir / "checkpoints" / "step_000004" / "complete").exists()
    logs = run_dir / "logs" / f"job-{job}"
    names = sorted(p.name for p in logs.iterdir())
    assert names == ["engine-0.log", "engine-1.log", "engines-node0.log", "engines-node1.log",
                     "learner-0.log", "learner-1.log"]
    assert "learner world 2 (2 nodes), master 127.0.0.1" in (logs / "learner-0.log").read_text()
    assert "learners finished; stopping the engines" in log
    assert cluster.run(["squeue", "-h", "-j", str(job)], check=False).stdout.strip() == ""


def test_disaggregated_heterogeneous_job_completes(cluster, tmp_path):
    job = _submit(cluster, "disaggregated.sbatch", tmp_path, "disagg",
                  ["--nodes=1", "--mem=2000", ":", "--nodes=1", "--mem=2000"],
                  overrides=["cluster.mode=disaggregated", "cluster.engine_nodes=1"])
    info = cluster.wait_job(job, JOB_TIMEOUT_S)
    log = _batch_log(tmp_path, job)
    assert info["JobState"] == "COMPLETED", log
    run_dir = tmp_path / "disagg"
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["world_size"] == 1 for m in metrics)  # component 0: one node, one learner
    assert len(metrics[0]["engines"]) == 2  # component 1: both engines on its single node
    logs = run_dir / "logs" / f"job-{job}"
    assert (logs / "engines-node0.log").exists() and not (logs / "engines-node1.log").exists()
    engine_nodes = {json.loads(p.read_text())["node"] for p in (run_dir / "engines").glob("engine-*.json")}
    learner_node = info.get("NodeList")
    assert len(engine_nodes) == 1 and engine_nodes != {learner_node}, (engine_nodes, learner_node)


def test_cancel_mid_run_then_resubmit_resumes(cluster, tmp_path):
    overrides = ["trainer.total_steps=8", "trainer.save_interval=2"]
    job = _submit(cluster, "colocated.sbatch", tmp_path, "resume", ["--nodes=2", "--mem=3000"],
                  overrides=overrides, STANDIN_STEP_SECONDS="1.0")
    run_dir = tmp_path / "resume"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while len(_metrics(run_dir)) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(_metrics(run_dir)) >= 3, _batch_log(tmp_path, job)
    cluster.run(["scancel", str(job)])
    info = cluster.wait_job(job, 60)
    assert info["JobState"] == "CANCELLED"
    first = _metrics(run_dir)
    last_saved = max(s for s in (m["step"] for m in first) if s % 2 == 0)

    job2 = _submit(cluster, "colocated.sbatch", tmp_path, "resume", ["--nodes=2", "--mem=3000"],
                   overrides=overrides, STANDIN_STEP_SECONDS="0.2")
    info2 = cluster.wait_job(job2, JOB_TIMEOUT_S)
    assert info2["JobState"] == "COMPLETED", _batch_log(tmp_path, job2)
    second = [m for m in _metrics(run_dir) if m["job_id"] == str(job2)]
    # the second job starts right after the last complete checkpoint and finishes the run
    assert second[0]["resumed_from"] == last_saved
    assert [m["step"] for m in second] == list(range(last_saved + 1, 9))
    # the registry holds only the second job's engines (the first job's were cleared)
    assert {json.loads(p.read_text())["job_id"] for p in (run_dir / "engines").glob("engine-*.json")} == {str(job2)}


def test_learner_crash_fails_job_promptly_with_error_in_log(cluster, tmp_path):
    start = time.monotonic()
    job = _submit(cluster, "colocated.sbatch", tmp_path, "crash", ["--nodes=2", "--mem=3000"],
                  overrides=["trainer.total_steps=50"], STANDIN_STEP_SECONDS="0.5",
                  STANDIN_CRASH_RANK="1", STANDIN_CRASH_AT_STEP="2")
    info = cluster.wait_job(job, JOB_TIMEOUT_S)
    elapsed = time.monotonic() - start
    log = _batch_log(tmp_path, job)
    assert info["JobState"] == "FAILED", log
    assert info["ExitCode"] != "0:0"
    assert elapsed < 60, f"job took {elapsed:.0f}s to fail (50 steps would take 25s+ more)"
    assert "role 'learner' exited with status" in log
    assert "stand-in learner rank 1 crashed at step 2" in log  # the role's own error, in the job log
    assert len(_metrics(tmp_path / "crash")) < 50
    assert cluster.run(["squeue", "-h", "-j", str(job)], check=False).stdout.strip() == ""


def test_engine_crash_fails_job_with_engine_error(cluster, tmp_path):
    job = _submit(cluster, "colocated.sbatch", tmp_path, "engcrash", ["--nodes=2", "--mem=3000"],
                  overrides=["trainer.total_steps=100"], STANDIN_STEP_SECONDS="0.5",
                  STANDIN_ENGINE_CRASH_INDEX="1", STANDIN_ENGINE_CRASH_AFTER_S="3")
    info = cluster.wait_job(job, JOB_TIMEOUT_S)
    log = _batch_log(tmp_path, job)
    assert info["JobState"] == "FAILED", log
    # srun reports the worst task status: 3 from the crashed engine or 143 (SIGTERM) from
    # the node whose engines were stopped by --kill-on-bad-exit
    assert "role 'engines' exited with status" in log and "engine 1 exited with status 3" in log
    assert "simulated CUDA error: out of memory" in log
    assert len(_metrics(tmp_path / "engcrash")) < 100
