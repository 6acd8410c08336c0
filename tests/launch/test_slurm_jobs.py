"""slurm/colocated.sbatch and slurm/disaggregated.sbatch on a real two-node Slurm cluster,
running the real trainer and the real embedded engine.

The module fixture starts the private local cluster of tests/slurm_cluster.py (n1, n2 on
this machine) once; each test submits the real sbatch script with the tiny CPU experiment
(`configs/experiment/tiny_cpu_slurm.yaml`: `dapo-mega train` learner ranks over gloo, one
`python -m dapo_mega.engines.embedded.server` engine per engine node, 3 RL steps), waits with a
bound and checks the run directory and the job's exit state. Nothing is stubbed: metrics,
ledger shards and checkpoints are the trainer's own, and the policy versions the engines
report in the ledger show that the learner's weights reached engine processes started by
another srun step (another "node", another heterogeneous component). The disaggregated job runs with embedded
engines in the engine-kill test, which checks the same records over 60 steps; with real SGLang
servers, as the disaggregated recipe's twin (tests/launch/test_twin_runs.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dapo_mega.distributed import free_port

pytestmark = [pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 420
"""A bound on a short job, not a timed claim: alone a 3-step colocated job takes ~1 min here, but
beside the SGLang TP tests on the other worker (load ~10 on 2 cores) one took over 180 s."""
TOTAL_STEPS = 3  # configs/experiment/tiny_cpu_slurm.yaml


@pytest.fixture
def cluster(slurm_cluster):
    return slurm_cluster


def _job_env(learners_per_node: int = 1) -> dict:
    # one CPU thread per process (several processes share 2 cores)
    return {"LEARNERS_PER_NODE": str(learners_per_node), "MASTER_PORT": str(free_port()), "PYTHON": sys.executable,
            "OMP_NUM_THREADS": "1"}


def _sbatch_args(out_dir: Path, run_name: str, sbatch_args, script: str, overrides=()) -> list:
    # job-wide options first: after a ':' they would apply to the last het component only
    return [f"--output={out_dir}/slurm-%j.out", f"-J{run_name}", *sbatch_args, str(REPO / "slurm" / script),
            "+experiment=tiny_cpu_slurm", f"trainer.output_dir={out_dir}", f"trainer.run_name={run_name}",
            *overrides]


def _submit(cluster, script: str, out_dir: Path, run_name: str, sbatch_args, overrides=(),
            learners_per_node: int = 1) -> int:
    return cluster.sbatch(_sbatch_args(out_dir, run_name, sbatch_args, script, overrides),
                          extra_env=_job_env(learners_per_node), cwd=REPO)


COLOCATED = ["--nodes=2", "--mem=4000"]
DISAGGREGATED = ["--nodes=1", "--mem=4000", ":", "--nodes=1", "--mem=4000"]
DISAGG_OVERRIDES = ["cluster.mode=disaggregated", "cluster.engine_nodes=1"]


def _metrics(run_dir: Path) -> list:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _ledger(run_dir: Path) -> dict:
    """step -> the ledger rows of that step (the trainer's parquet shards)."""
    import pyarrow.parquet as pq

    out = {}
    for shard in sorted((run_dir / "ledger").glob("step_*.parquet")):
        out[int(shard.stem.split("_")[1])] = pq.read_table(shard).to_pylist()
    return out


def _batch_log(out_dir: Path, job_id: int) -> str:
    path = out_dir / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else "(no batch log)"


def _job_logs(run_dir: Path, job_id: int) -> str:
    """Every per-role log of the job, for assertion messages and error searches."""
    logs = run_dir / "logs" / f"job-{job_id}"
    return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(logs.glob("*.log"))) if logs.exists() else "(no role logs)"


def _trainer_state(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())


def _checkpoint_steps(run_dir: Path) -> list:
    from dapo_mega.run_files.checkpoints import list_complete_checkpoints

    return [int(p.name.split("_")[1]) for p in list_complete_checkpoints(run_dir)]


def _check_engine_versions(ledger: dict, steps) -> None:
    """Each step's samples came from engines serving the learner's weights of the step
    before (version s-1 at step s: synced after step s-1) or, at most, one version older
    (seen once after an update with zero gradient). Engines start at the base model, so
    any version >= 1 (step 3 onwards) is only possible if the learner's weights reached them."""
    for step in steps:
        rows = ledger[step]
        assert rows and all(r["step"] == step and r["learner_version"] == step - 1 for r in rows)
        assert all(step - 2 <= r["policy_version_min"] <= r["policy_version_max"] <= step - 1 for r in rows)
    assert max(r["policy_version_max"] for r in ledger[max(steps)]) >= 1


def _assert_completed_run(cluster, out_dir: Path, run_dir: Path, job: int, info: dict) -> list:
    log = _batch_log(out_dir, job)
    assert info["JobState"] == "COMPLETED", log + _job_logs(run_dir, job)
    assert info["ExitCode"] == "0:0"
    assert "learners finished; stopping the engines" in log
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, TOTAL_STEPS + 1))
    assert [m["policy_version"] for m in metrics] == list(range(1, TOTAL_STEPS + 1))
    assert all(m["rollout/num_samples"] == 8 * 4 for m in metrics)  # 8 prompts x 4 samples
    ledger = _ledger(run_dir)
    assert sorted(ledger) == list(range(1, TOTAL_STEPS + 1))
    assert all(len(rows) == 32 for rows in ledger.values())
    _check_engine_versions(ledger, range(1, TOTAL_STEPS + 1))
    # save_interval 2 and the last step; keep_last_k 2
    assert _checkpoint_steps(run_dir) == [2, 3]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert cluster.run(["squeue", "-h", "-j", str(job)], check=False).stdout.strip() == ""
    return metrics


def _learner_nodes(logs: Path) -> dict:
    """rank -> node, from each learner task's "learner rank R of W on NODE" line; asserts
    that every rank of the world the tasks report wrote its own log and agrees on W."""
    lines = {p.name: re.search(r"learner rank (\d+) of (\d+) on (\S+) ", p.read_text(errors="replace"))
             for p in logs.glob("learner-*.log")}
    assert lines and all(lines.values()), lines
    worlds = {int(m.group(2)) for m in lines.values()}
    assert len(worlds) == 1, worlds
    ranks = {int(m.group(1)): m.group(3) for m in lines.values()}
    assert sorted(ranks) == list(range(worlds.pop())) and sorted(lines) == [f"learner-{r}.log" for r in sorted(ranks)]
    return ranks


@pytest.mark.slow  # one or two real jobs: ~1 min each on 2 cores
def test_cancel_mid_run_resubmit_resumes_then_complete_chain_exits_early(cluster, tmp_path):
    steps = 6  # saves at 2 (tiny_cpu_slurm), cancelled then; the resubmitted job trains 3-6
    overrides = [f"trainer.total_steps={steps}"]
    run_dir = tmp_path / "resume"
    job = _submit(cluster, "colocated.sbatch", tmp_path, "resume", COLOCATED, overrides)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not _checkpoint_steps(run_dir) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _checkpoint_steps(run_dir), _batch_log(tmp_path, job) + _job_logs(run_dir, job)
    cluster.run(["scancel", str(job)])
    info = cluster.wait_job(job, 60)
    assert info["JobState"] == "CANCELLED"
    saved = _checkpoint_steps(run_dir)[-1]
    assert saved < steps, "the first job finished before it was cancelled"

    job2 = _submit(cluster, "colocated.sbatch", tmp_path, "resume", COLOCATED, overrides)
    info2 = cluster.wait_job(job2, JOB_TIMEOUT_S)
    learner0 = (run_dir / "logs" / f"job-{job2}" / "learner-0.log").read_text()
    assert info2["JobState"] == "COMPLETED", _batch_log(tmp_path, job2) + _job_logs(run_dir, job2)
    # the second job loaded the first job's last checkpoint and did not warm-start again
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{saved:06d}'} at step {saved}" in learner0
    assert "[warm start]" not in learner0
    assert re.findall(r"^step\s+(\d+) \|", learner0, re.M) == [str(s) for s in range(saved + 1, steps + 1)]
    # records: every step exactly once (rows after the checkpoint were dropped and redone)
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert [m["policy_version"] for m in metrics] == list(range(1, steps + 1))
    ledger = _ledger(run_dir)
    assert sorted(ledger) == list(range(1, steps + 1))
    _check_engine_versions(ledger, range(saved + 1, steps + 1))
    # the registry holds only the second job's engines (the first job's were cleared)
    assert {json.loads(p.read_text())["job_id"] for p in (run_dir / "engines").glob("engine-*.json")} == {str(job2)}

    # a chain queued behind a run that is now complete: each job exits 0 at once, no roles
    chain_cmd = ["bash", str(REPO / "slurm" / "chain.sh"), "2", str(REPO / "slurm" / "colocated.sbatch"),
                 f"--output={tmp_path}/slurm-%j.out", "-Jresume", *COLOCATED, "--",
                 "+experiment=tiny_cpu_slurm", f"trainer.output_dir={tmp_path}", "trainer.run_name=resume", *overrides]
    chain = subprocess.run(chain_cmd, capture_output=True, text=True, timeout=60, cwd=REPO,
                           env={**cluster.env(), **_job_env()})
    assert chain.returncode == 0, chain.stderr
    chained = [int(j) for j in re.findall(r"submitted job (\d+)", chain.stdout)]
    assert len(chained) == 2
    for tail_job in chained:
        tail = cluster.wait_job(tail_job, 90)
        log = _batch_log(tmp_path, tail_job)
        assert tail["JobState"] == "COMPLETED" and tail["ExitCode"] == "0:0", log
        assert f"already complete (checkpoint at step {steps} of {steps}); nothing to do" in log
        assert not (run_dir / "logs" / f"job-{tail_job}").exists()  # no role was started
    assert len(_metrics(run_dir)) == steps


def test_learner_error_fails_job_promptly_with_error_in_log(cluster, tmp_path):
    # a real trainer failure mid-run: the checkpoint directory cannot be created (a file
    # is in the way), so rank 0 raises in save_checkpoint at step 2 of 200
    run_dir = tmp_path / "crash"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a directory\n")
    start = time.monotonic()
    job = _submit(cluster, "colocated.sbatch", tmp_path, "crash", COLOCATED, ["trainer.total_steps=200"])
    info = cluster.wait_job(job, JOB_TIMEOUT_S)
    elapsed = time.monotonic() - start
    log = _batch_log(tmp_path, job)
    assert info["JobState"] == "FAILED", log
    assert info["ExitCode"] != "0:0"
    assert "role 'learner' exited with status" in log
    assert "FileExistsError" in log and str(run_dir / "checkpoints") in log  # the rank's own error
    assert [m["step"] for m in _metrics(run_dir)] == [1]  # step 2 died saving; nothing after it
    assert elapsed < 120, f"job took {elapsed:.0f}s to fail"
    assert cluster.run(["squeue", "-h", "-j", str(job)], check=False).stdout.strip() == ""


def test_engine_killed_mid_run_past_its_restarts_fails_job_promptly(cluster, tmp_path):
    # rollout.engine_restarts=0: the first exit of an engine ends the engines role, and the job
    run_dir = tmp_path / "engkill"
    job = _submit(cluster, "colocated.sbatch", tmp_path, "engkill", COLOCATED,
                  ["trainer.total_steps=200", "rollout.engine_restarts=0"])
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not _metrics(run_dir) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _metrics(run_dir), _batch_log(tmp_path, job) + _job_logs(run_dir, job)
    record = json.loads((run_dir / "engines" / "engine-1.json").read_text())
    assert record["job_id"] == str(job)
    os.kill(record["pid"], signal.SIGKILL)  # the engine process of node n2, as an OOM kill would
    killed_at = time.monotonic()
    info = cluster.wait_job(job, 90)
    elapsed = time.monotonic() - killed_at
    log = _batch_log(tmp_path, job)
    everything = log + _job_logs(run_dir, job)
    assert info["JobState"] == "FAILED", everything
    assert elapsed < 60, f"job took {elapsed:.0f}s to fail after the engine died"
    # whichever role noticed first (the engines' watcher or the trainer's next request),
    # the job log names it, and the engines' launcher log names the dead engine
    assert re.search(r"role '(engines|learner)' exited with status", log), log
    assert re.search(r"engine 1 \(\S+, pid \d+\) exited with signal 9; it was restarted 0 time\(s\) in this job, "
                     r"the most rollout.engine_restarts=0 allows", everything), everything
    assert len(_metrics(run_dir)) < 200
    assert cluster.run(["squeue", "-h", "-j", str(job)], check=False).stdout.strip() == ""


KILL_STEPS = 60
"""Steps of the engine-kill jobs: a tiny step takes ~0.4 s here and an embedded engine starts in
~5 s, so the restarted engine answers again with most of the run still to go (and is seen
back in the ledger) while the job stays short."""


def _kill_engine_1_after_step_1(cluster, out_dir: Path, run_dir: Path, job: int) -> dict:
    """SIGKILL engine 1's process (as an OOM kill would) once step 1 is recorded; its registry record."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not _metrics(run_dir) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _metrics(run_dir), _batch_log(out_dir, job) + _job_logs(run_dir, job)
    record = json.loads((run_dir / "engines" / "engine-1.json").read_text())
    assert record["job_id"] == str(job)
    os.kill(record["pid"], signal.SIGKILL)
    return record


def _assert_outlived_engine(cluster, out_dir: Path, run_dir: Path, job: int, record: dict, engines_log: str) -> dict:
    """The job completed every step although engine 1 died: the engines role restarted it at
    its URL (announced again with a new pid), the trainer dropped it, found it answering again
    and synced the weights into it before it served; every step's ledger is whole, from
    engines serving the learner's weights, and shows the gap in engine 1's service. The job's
    info."""
    info = cluster.wait_job(job, JOB_TIMEOUT_S * 2)
    logs = run_dir / "logs" / f"job-{job}"
    everything = _batch_log(out_dir, job) + _job_logs(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", everything
    engines = (logs / engines_log).read_text(errors="replace")
    assert f"engine 1 ({record['url']}, pid {record['pid']}) exited with signal 9; restarting it at its port" \
        in engines and "engine 1 restarted" in engines, engines[-3000:]
    again = json.loads((run_dir / "engines" / "engine-1.json").read_text())
    assert again["url"] == record["url"] and again["pid"] != record["pid"]  # back where the trainer looks
    learner0 = (logs / "learner-0.log").read_text(errors="replace")
    dropped = [line for line in learner0.splitlines() if "dropped from rollouts and weight sync" in line]
    assert dropped and all(record["url"] in line for line in dropped), learner0[-3000:]
    assert f"engine {record['url']} answers again" in learner0, learner0[-3000:]
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, KILL_STEPS + 1))
    ledger = _ledger(run_dir)
    assert sorted(ledger) == list(range(1, KILL_STEPS + 1)) and all(len(rows) == 32 for rows in ledger.values())
    _check_engine_versions(ledger, range(1, KILL_STEPS + 1))  # the restarted engine too: weights first
    # the gap: steps engine 1 served (the ledger's engine_id is its URL): some before the kill,
    # none for a while after it, and again once it held the weights
    served = [step for step, rows in sorted(ledger.items()) if any(r["engine_id"] == record["url"] for r in rows)]
    gap = [s for s in range(1, KILL_STEPS + 1) if s not in served]
    assert served and served[0] == 1 and gap and served[-1] > gap[0], served
    return info


@pytest.mark.slow  # one real job of 60 tiny steps, four learners on two nodes, an engine restart: ~1.5 min
def test_colocated_job_on_two_nodes_restarts_an_engine_killed_mid_run_and_completes(cluster, tmp_path):
    # two learner tasks per node: srun before Slurm 23.02.5 (22.05 here) took the batch
    # script's SLURM_NTASKS=2 as the step's -n and started one learner per node (world 2)
    run_dir = tmp_path / "coloc"
    job = _submit(cluster, "colocated.sbatch", tmp_path, "coloc", COLOCATED + ["--time=30"],
                  [f"trainer.total_steps={KILL_STEPS}", "trainer.save_interval=0"], learners_per_node=2)
    record = _kill_engine_1_after_step_1(cluster, tmp_path, run_dir, job)
    _assert_outlived_engine(cluster, tmp_path, run_dir, job, record, "engines-node1.log")
    logs = run_dir / "logs" / f"job-{job}"
    assert _learner_nodes(logs) == {0: "n1", 1: "n1", 2: "n2", 3: "n2"}, \
        _batch_log(tmp_path, job) + _job_logs(run_dir, job)
    assert "learners finished; stopping the engines" in _batch_log(tmp_path, job)
    assert cluster.run(["squeue", "-h", "-j", str(job)], check=False).stdout.strip() == ""
    assert sorted(p.name for p in logs.iterdir()) == ["engine-0.log", "engine-1.log", "engines-node0.log",
                                                      "engines-node1.log", *(f"learner-{r}.log" for r in range(4))]
    learner0 = (logs / "learner-0.log").read_text()
    assert "learner world 4 (2 nodes), master 127.0.0.1" in learner0
    assert _trainer_state(run_dir, KILL_STEPS)["learner_layout"]["dp"] == 4  # the trainer's own world
    # the job's 30-minute limit reached the trainer as the time it has (squeue's time left)
    left = re.search(r"trainer\.wall_time_minutes=(\d+\.\d\d)\b", learner0)
    assert left and 25 < float(left.group(1)) <= 30, learner0[:3000]
    assert re.search(r"^step\s+3 \| v3 ", learner0, re.M), learner0[-2000:]
    assert "[warm start] 10/10" in learner0
    # one engine per node, each announced with the job's key; every sample came from an
    # announced engine (every weight sync had to reach both, or the trainer would have raised
    # WeightSyncError and the job failed)
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "engines").glob("engine-*.json"))]
    assert sorted(r["node"] for r in records) == ["n1", "n2"]
    served = {r["engine_id"] for rows in _ledger(run_dir).values() for r in rows}
    assert served and served <= {r["url"] for r in records}


@pytest.mark.slow  # one real heterogeneous job of 60 tiny steps with an engine restart: ~1 min on 2 cores
def test_engine_killed_mid_run_is_restarted_and_the_disaggregated_job_completes(cluster, tmp_path):
    run_dir = tmp_path / "disagg_restart"
    job = _submit(cluster, "disaggregated.sbatch", tmp_path, "disagg_restart", DISAGGREGATED,
                  [*DISAGG_OVERRIDES, f"trainer.total_steps={KILL_STEPS}", "trainer.save_interval=0"])
    record = _kill_engine_1_after_step_1(cluster, tmp_path, run_dir, job)
    info = _assert_outlived_engine(cluster, tmp_path, run_dir, job, record, "engines-node0.log")
    # the embedded engines ran on component 1's node, the learner on component 0's
    engine_nodes = {json.loads(p.read_text())["node"] for p in (run_dir / "engines").glob("engine-*.json")}
    assert len(engine_nodes) == 1 and engine_nodes != {info.get("NodeList")}, (engine_nodes, info.get("NodeList"))
