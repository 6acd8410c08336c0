"""Resumes of `dapo-mega train`: after running out of wall time, after a change of a guarded
field (refused unless allowed), and from a named step. A SIGKILL in each phase and its resume:
tests/faults/test_faults_kill_resume.py; a stop signal and its resume (counters, data cursor,
wandb run): tests/trainer/test_stop_signal.py."""

import json
import os
import subprocess
import time

import pytest
from helpers.training import (
    REPO,
    RUN_NAME,
    check_records_of_run,
    read_rows,
    run_train,
    train_command,
)

from dapo_mega.records.ledger import read_records
from dapo_mega.records.ledger_report import build_report, render_markdown
from dapo_mega.run_files.identity import read_config_history, read_run_id


def test_a_run_out_of_wall_time_stops_with_a_checkpoint_and_resumes(tmp_path):
    """trainer.wall_time_minutes too short for a second step: the run stops after step 1 with
    step 1's checkpoint (save_interval=0 would have saved only at the end), says so, exits 0;
    the same command without the limit resumes from it and finishes."""
    run_dir = tmp_path / RUN_NAME
    limited = ["trainer.total_steps=3", "trainer.save_interval=0", "trainer.wall_time_minutes=0.01",
               "trainer.stop_margin_minutes=0"]
    output = run_train(tmp_path, *limited, tag="limited")
    assert "[trainer] stopped after step 1 of 3 to end within trainer.wall_time_minutes=0.01" in output
    assert "checkpoint step 1 saved, run again to resume" in output
    assert [r["step"] for r in read_rows(run_dir)] == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000001"]

    output = run_train(tmp_path, "trainer.total_steps=3", "trainer.save_interval=0", tag="resumed")
    assert "at step 1, policy version 1" in output and "stopped after" not in output
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3]
    check_records_of_run(run_dir, total_steps=3, max_staleness=0)


def test_a_resume_that_changes_the_verifier_stops_unless_the_change_is_allowed(tmp_path):
    """One change at a time: step 1 with the dapo verifier, checkpointed; the same run resumed
    with algo.verifier=math_verify stops before anything is built (non-zero, naming the field
    and both values, config.yaml as it was); allowed by name, it trains step 2 with math_verify,
    the history holds the change at step 2, and the ledger report lists it. Every ledger row
    carries the run's one id."""
    run_dir = tmp_path / RUN_NAME
    quick = ["trainer.sft_warmup_steps=0", "trainer.save_interval=1"]
    run_train(tmp_path, *quick, "trainer.total_steps=1", tag="first")
    run_id = read_run_id(run_dir)
    config_before = (run_dir / "config.yaml").read_bytes()

    changed = [*quick, "trainer.total_steps=2", "algo.verifier=math_verify"]
    start = time.monotonic()
    refused = subprocess.run(train_command(tmp_path, *changed), capture_output=True, text=True, timeout=120, cwd=REPO,
                             env={**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"})
    assert refused.returncode != 0, refused.stdout[-3000:]
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith("dapo-mega: config error: algo.verifier:"), refused.stderr[-3000:]
    assert 'algo.verifier "dapo" -> "math_verify"' in error and "trainer.allow_changes=[algo.verifier]" in error
    assert "[warm start]" not in refused.stdout and "[data]" not in refused.stdout  # stopped before any work
    assert time.monotonic() - start < 60
    assert (run_dir / "config.yaml").read_bytes() == config_before
    assert read_config_history(run_dir) == [] and read_run_id(run_dir) == run_id

    output = run_train(tmp_path, *changed, "trainer.allow_changes=[algo.verifier]", tag="allowed")
    assert f"[trainer] run {run_id} " in output and "resumed at step 1" in output
    guarded = [c for c in read_config_history(run_dir) if c["shapes_training"]]
    assert [(c["run_id"], c["step"], c["field"], c["old"], c["new"]) for c in guarded] == [
        (run_id, 2, "algo.verifier", "dapo", "math_verify")]
    assert "verifier: math_verify" in (run_dir / "config.yaml").read_text()
    rows = read_records(run_dir)
    assert {r.step: r.verifier for r in rows} == {1: "dapo", 2: "math_verify"}
    assert {(r.run_id, r.run_name) for r in rows} == {(run_id, RUN_NAME)}
    assert [r["run_id"] for r in read_rows(run_dir) if r["step"] >= 1] == [run_id, run_id]
    report = render_markdown(build_report(run_dir))
    assert 'step 2: algo.verifier "dapo" -> "math_verify"' in report


@pytest.mark.slow
def test_a_restart_from_a_named_step_keeps_the_later_steps_aside(tmp_path):
    """trainer.resume_step=1 after 3 saved steps: training goes on from step 1 (its step 2 is
    trained again), the old steps 2-3 (checkpoints, ledger shards, metrics as they were) are in
    set_aside/, and the same command again goes on from the restarted run's latest."""
    run_dir = tmp_path / RUN_NAME
    quick = ["trainer.sft_warmup_steps=0", "trainer.save_interval=1", "trainer.keep_last_k=5", "trainer.eval_interval=0"]
    run_train(tmp_path, *quick, "trainer.total_steps=3", tag="first")
    output = run_train(tmp_path, *quick, "trainer.total_steps=2", "trainer.resume_step=1", tag="restart")
    assert "resumed from" in output and "at step 1" in output and "moved to" in output
    aside = [p for p in (run_dir / "set_aside").iterdir()]
    assert len(aside) == 1 and aside[0].name.startswith("after_step_1_")
    assert sorted(p.name for p in (aside[0] / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert sorted(p.name for p in (aside[0] / "ledger").iterdir()) == ["step_00000002.parquet", "step_00000003.parquet"]
    assert [json.loads(line)["step"] for line in (aside[0] / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["step"] >= 1] == [1, 2, 3]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_000001", "step_000002"]
    assert sorted({r.step for r in read_records(run_dir)}) == [1, 2]
    again = run_train(tmp_path, *quick, "trainer.total_steps=2", "trainer.resume_step=1", tag="again")
    assert "at step 2" in again and len(list((run_dir / "set_aside").iterdir())) == 1
