"""SIGUSR1 (Slurm's warning ahead of the time limit) or SIGTERM to a running `dapo-mega train`:
it saves a checkpoint of the step it is on, exits 75 (`driver/stop_signal.py`), and the same
command resumes from that step. The Slurm side (the batch script forwarding the signal) is in
tests/launch/test_slurm_jobs.py."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.training import (
    RECORDS_IN_FULL,
    RUN_NAME,
    check_records_of_run,
    kill_group,
    read_rows,
    run_train,
    start_train,
    train_command,
)

from dapo_mega.driver.stop_signal import EXIT_STOPPED, StopSignals
from dapo_mega.records.ledger import read_records

LONG = ["trainer.total_steps=40", "trainer.save_interval=0", *RECORDS_IN_FULL]  # saves only at the end, unless stopped


def _stop_mid_run(tmp_path, sig: int, tag: str) -> tuple:
    """Start a long run, send `sig` to the trainer (not its engine) once a step's row is written;
    returns (exit code, its output, the rows written when the signal was sent)."""
    run_dir = tmp_path / RUN_NAME
    before = len(read_rows(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
    proc = start_train(train_command(tmp_path, *LONG), tmp_path / f"{tag}.log")
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if (run_dir / "metrics.jsonl").exists() and len(read_rows(run_dir)) > before:
                break
            time.sleep(0.1)
        rows_at_signal = len(read_rows(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
        assert proc.poll() is None and rows_at_signal > before, (tmp_path / f"{tag}.log").read_text()[-4000:]
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=300)
    finally:
        kill_group(proc)
    return code, (tmp_path / f"{tag}.log").read_text(), read_rows(run_dir)[rows_at_signal - 1]["step"]


@pytest.mark.slow
def test_a_stop_signal_saves_the_step_it_was_on_and_the_run_resumes(tmp_path):
    """SIGTERM here; SIGUSR1 takes the same path (`StopSignals`, below) and goes end to end
    through the Slurm batch script in tests/launch/test_slurm_stop_signal.py. The resume
    continues the counters, the data cursor and the wandb run (SIGKILL in each phase and its
    resume: tests/faults/test_faults_kill_resume.py)."""
    sig = signal.SIGTERM
    run_dir = tmp_path / RUN_NAME
    code, output, last_row_step = _stop_mid_run(tmp_path, sig, "stopped")
    wandb_runs_before = {p.name.rsplit("-", 1)[-1] for p in (run_dir / "wandb").glob("offline-run-*")}
    on = last_row_step + 1  # the signal came after this row: the trainer was on the next step
    assert code == EXIT_STOPPED, output[-4000:]
    name = signal.Signals(sig).name
    assert f"[trainer] {name} received: saving a checkpoint at the end of this step" in output
    assert f"[trainer] stopped after step {on} of 40 on {name}: checkpoint step {on} saved; exit 75" in output
    assert [r["step"] for r in read_rows(run_dir)] == list(range(1, on + 1))
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [f"step_{on:06d}"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{on:06d}"

    total = on + 1
    resumed = run_train(tmp_path, f"trainer.total_steps={total}", "trainer.save_interval=0", *RECORDS_IN_FULL,
                        tag="resumed")
    assert f"at step {on}, policy version {on}" in resumed and "[warm start]" not in resumed
    assert "stopped after" not in resumed
    check_records_of_run(run_dir, total_steps=total, max_staleness=0)
    assert [r["policy_version"] for r in read_rows(run_dir) if r["step"] >= 1] == list(range(1, total + 1))
    # the data cursor continued: the resumed step's fresh prompts are none of the earlier steps'
    fresh = {s: {r.prompt_id for r in read_records(run_dir, steps=[s]) if r.reject_reason == "kept"}
             for s in range(1, total + 1)}
    assert fresh[total] and not fresh[total] & set().union(*(fresh[s] for s in range(1, total)))
    # the same wandb run continues (its id is in the checkpoint)
    wandb_runs_after = {p.name.rsplit("-", 1)[-1] for p in (run_dir / "wandb").glob("offline-run-*")}
    assert len(wandb_runs_before) == 1 and wandb_runs_after == wandb_runs_before


def test_stop_signals_records_the_first_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    signals = StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.received == "SIGUSR1"
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_second_sigterm_ends_the_process_at_once():
    """The first SIGTERM waits for the step's checkpoint; a user who asks again is not kept waiting."""
    program = ("import os, signal, time\nfrom dapo_mega.driver.stop_signal import StopSignals\n"
               "s = StopSignals().install()\nos.kill(os.getpid(), signal.SIGTERM)\nassert s.received == 'SIGTERM'\n"
               "print('first', flush=True)\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\nprint('survived')\n")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGTERM, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == "first\n" and "SIGTERM received" in result.stderr


def test_after_the_checkpoint_sigterm_cannot_end_the_close_even_in_interpreter_shutdown():
    """srun's --kill-on-bad-exit sends SIGTERM to the ranks still closing once the first exits 75
    (a CI run lost a whole job's 75 this way): here a sender keeps sending SIGTERM from before
    `begin_close` returns until the process is gone, through Python's own shutdown, and the
    process still exits 75."""
    program = ("import os, signal, subprocess, sys, time\nfrom dapo_mega.driver.stop_signal import StopSignals\n"
               "s = StopSignals().install()\nos.kill(os.getpid(), signal.SIGUSR1)\ns.begin_close()\n"
               "subprocess.Popen(['sh', '-c', f'i=0; while [ $i -lt 200000 ] && kill -TERM {os.getpid()} 2>/dev/null; '\n"
               "                  'do i=$((i+1)); done'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
               "time.sleep(0.5)\ns.restore()\nprint('closed', flush=True)\nsys.exit(75)\n")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_STOPPED, (result.returncode, result.stdout, result.stderr[-2000:])
    assert result.stdout == "closed\n"
