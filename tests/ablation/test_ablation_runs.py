"""`dapo-mega ablate` end to end: a reduced quick ladder locally (real training runs: the
shared warm start, then 2 rungs x 2 seeds of 3 steps, ~2.5 min on 2 cores) and one rung x 2
seeds as a Slurm job array on the local two-node cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _check_outputs(directory: Path, rungs, seeds) -> dict:
    md = (directory / "ablation.md").read_text()
    data = json.loads((directory / "ablation.json").read_text())
    assert (directory / "ablation.png").stat().st_size > 1000
    assert [r["name"] for r in data["rungs"]] == list(rungs)
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| rung")]
    assert [row.split(" | ")[0][2:] for row in rows] == list(rungs)  # one row per rung, in order
    for rung in data["rungs"]:
        assert sorted(r["seed"] for r in rung["runs"]) == sorted(seeds), rung["missing_seeds"]
        final = rung["stats"]["final_avg_at_k"]
        assert final["n"] == len(seeds) >= 2 and final["half_width"] is not None  # an interval over seeds
        assert 0.0 <= final["mean"] <= 1.0
        assert rung["stats"]["entropy_end"]["mean"] > 0.0  # the rollout policy's entropy was recorded
    for rung in data["rungs"][1:]:
        assert rung["final_avg_at_k_difference"] is not None  # compared with the rung before
    return data


@pytest.mark.slow  # a shorter shared warm start + 2 rungs x 2 seeds x 3 steps, ~2.5 min on 2 cores
def test_quick_ladder_writes_table_json_and_curves(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # the quick ladder's first and last rung (the last one, a ladder, also holds clip-higher), 3 steps
    cmd = [sys.executable, "-m", "dapo_mega.cli", "ablate", "+ablation=dapo_ladder", "ablation.quick=true",
           "ablation.quick_rungs=[naive_grpo,+dynamic_sampling]", "trainer.total_steps=3",
           # a third of the shared warm start (~55 s, not ~165 s): accuracy ~0.03, so dynamic
           # sampling keeps ~1 group in 6 and takes 2-3 of its 10 rounds per step
           "trainer.sft_warmup_steps=400",
           "trainer.eval_interval=3", "trainer.save_interval=3", "eval.max_problems=16",  # the table's, not a claim
           f"trainer.output_dir={tmp_path}", "trainer.wandb_mode=disabled", "trainer.plot=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=2400, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    directory = tmp_path / "dapo_ladder_quick"
    data = _check_outputs(directory, ["naive_grpo", "+dynamic_sampling"], [1, 2])
    # the runs started from the shared warm start and kept their own run directories
    assert (directory / "warm_start" / "checkpoints" / "step_000000").is_dir()
    metrics = [json.loads(line) for line in
               (Path(data["rungs"][0]["runs"][0]["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert "rollout/entropy_mc" in metrics[-1]
    run_log = (directory / "logs" / "naive_grpo-seed1.log").read_text()
    assert re.search(r"^step\s+3 \| v3 .*\| ent \d\.\d{3} \|", run_log, re.M), run_log[-2000:]  # on the console line
    # dynamic sampling generates more samples than it trains on; the base does not
    assert data["rungs"][0]["stats"]["samples_per_trained"]["mean"] == pytest.approx(1.0)
    assert data["rungs"][1]["stats"]["samples_per_trained"]["mean"] > 1.0
    # a second invocation finds every run finished and only rebuilds the table
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert again.returncode == 0 and again.stdout.count("skipped") == 5, again.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_array_runs_the_ladder_and_builds_the_table(slurm_cluster, tmp_path):
    cluster = slurm_cluster
    env = {**cluster.env(), "LEARNERS_PER_NODE": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    # one node per run (the two seeds at once on the two nodes), one rung of 2 steps; not the
    # dynamic-sampling rung: after tiny_cpu_slurm's 10-step warm start every group is all wrong,
    # and with its max_num_gen_batches=0 refilling would never end. Rung differences are the
    # local test's.
    cmd = [sys.executable, "-m", "dapo_mega.cli", "ablate", "+ablation=dapo_ladder", "--slurm",
           "ablation.quick=true", "ablation.quick_rungs=[naive_grpo]",
           "ablation.sbatch_args=['--nodes=1','--mem=4000']", "+experiment=tiny_cpu_slurm",
           "cluster.num_nodes=1", "cluster.num_learner_processes=1", "rollout.num_engines=1",
           f"trainer.output_dir={tmp_path}", "trainer.total_steps=2", "trainer.eval_interval=2",
           "eval.max_problems=8", "eval.n_samples=2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report_job = int(re.search(r"built by job (\d+)", out.stdout).group(1))
    array_job = int(re.search(r"job array (\d+)", out.stdout).group(1))
    info = cluster.wait_job(report_job, timeout_s=1200)
    assert info.get("JobState") == "COMPLETED", (info, cluster.debug_tail())
    directory = tmp_path / "dapo_ladder_quick"
    script = (directory / "slurm" / "array.sbatch").read_text()
    assert "algo." not in script and "colocated.sbatch" in script
    _check_outputs(directory, ["naive_grpo"], [1, 2])  # every array task finished
    logs = sorted((directory / "slurm").glob(f"slurm-{array_job}_*.out"))
    assert len(logs) == 2, logs  # one task per rung x seed
