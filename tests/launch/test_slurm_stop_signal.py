"""`scancel -s USR1 --batch` (what `#SBATCH --signal=B:USR1@600` sends ahead of the time limit)
to a running slurm/colocated.sbatch job on the local two-node Slurm cluster: the batch script
forwards it to the learner step (slurm/lib.sh), the trainer saves a checkpoint of the step it
is on and exits 75, and the job ends with 75 after stopping the engines. The trainer's side
alone (and the resume) is tests/trainer/test_stop_signal.py; the jobs' other behaviour is
tests/launch/test_slurm_jobs.py, whose submission this follows.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from dapo_mega.distributed import free_port
from dapo_mega.driver.stop_signal import EXIT_STOPPED

pytestmark = [pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
STEPS = 200  # far more than the test waits for: the job ends only by the signal


def _metrics(run_dir: Path) -> list:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.slow  # one real job: ~1 min on 2 cores
def test_usr1_to_the_batch_script_saves_the_learners_step_and_ends_the_job_with_75(slurm_cluster, tmp_path):
    run_dir = tmp_path / "stop"
    args = [f"--output={tmp_path}/slurm-%j.out", "-Jstop", "--nodes=2", "--mem=4000", "--time=30",
            str(REPO / "slurm" / "colocated.sbatch"), "+experiment=tiny_cpu_slurm", f"trainer.output_dir={tmp_path}",
            "trainer.run_name=stop", f"trainer.total_steps={STEPS}", "trainer.save_interval=0"]
    env = {"LEARNERS_PER_NODE": "1", "MASTER_PORT": str(free_port()), "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1"}
    job = slurm_cluster.sbatch(args, extra_env=env, cwd=REPO)
    batch_log = tmp_path / f"slurm-{job}.out"
    deadline = time.monotonic() + 180
    while not _metrics(run_dir) and time.monotonic() < deadline:
        time.sleep(0.3)
    rows_at_signal = len(_metrics(run_dir))
    assert rows_at_signal, batch_log.read_text(errors="replace") if batch_log.exists() else "(no batch log)"
    slurm_cluster.run(["scancel", "-s", "USR1", "-b", str(job)])
    info = slurm_cluster.wait_job(job, 180)

    log = batch_log.read_text(errors="replace")
    learner0 = (run_dir / "logs" / f"job-{job}" / "learner-0.log").read_text(errors="replace")
    assert info["ExitCode"] == f"{EXIT_STOPPED}:0", log + learner0[-3000:]
    assert "SIGUSR1 received; the learners save a checkpoint at the end of their step" in log
    assert "learners saved a checkpoint and stopped on a signal (USR1); stopping the engines" in log
    steps = [m["step"] for m in _metrics(run_dir)]
    on = steps[-1]  # the step the learners were on when the forwarded signal reached them
    assert steps == list(range(1, on + 1)) and rows_at_signal < on < STEPS
    assert f"[trainer] stopped after step {on} of {STEPS} on SIGUSR1: checkpoint step {on} saved" in learner0
    # save_interval=0: the only checkpoint is the one the signal asked for
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [f"step_{on:06d}"]
    assert re.search(rf"^step_{on:06d}$", (run_dir / "checkpoints" / "latest").read_text(), re.M)
    assert slurm_cluster.run(["squeue", "-h", "-j", str(job)], check=False).stdout.strip() == ""
