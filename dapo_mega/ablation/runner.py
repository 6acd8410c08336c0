"""Running an ablation's training runs: locally one after another, or as a Slurm job array.

Every run is an ordinary `dapo-mega train` with its own run directory, so a crash stays
inside its run and the trainer's own resume does the rest:

- a finished run (latest complete checkpoint at its trainer.total_steps) is skipped;
- a killed run continues from its last checkpoint when started again;
- a failed run is reported, the others go on, and the table is built from what finished.

Locally each run is a subprocess (`python -m dapo_mega.cli train <overrides>`, output in
`<ablation>/logs/<rung>-seed<S>.log`). With Slurm, `submit_slurm` writes

    <ablation>/slurm/warm_start.json, runs.json   the overrides of each array task
    <ablation>/slurm/array.sbatch                 the #SBATCH lines of slurm/<topology>.sbatch,
                                                  then: read task $SLURM_ARRAY_TASK_ID's
                                                  overrides, exec that topology script
    <ablation>/slurm/report.sbatch                builds the table when the array is done

and submits the warm start (when shared), the array (after the warm start succeeded) and
the report job (after every array task ended, whatever their state). The topology script
runs unchanged; nothing of the recipe is written into a script.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from dapo_mega import log
from dapo_mega.ablation.rungs import AblationPlan, PlannedRun, slug

logger = log.get(__name__)


@dataclass
class RunOutcome:
    """What happened to one planned run in this invocation."""

    run: PlannedRun
    status: str
    """skipped (already finished), finished, failed."""
    seconds: float = 0.0
    returncode: Optional[int] = None


def completed_step(run_dir: Path | str) -> int:
    """Step of the latest complete checkpoint of a run directory (0: none)."""
    from dapo_mega.run_files.checkpoints import find_latest_checkpoint

    latest = find_latest_checkpoint(Path(run_dir))
    return int(latest.name.split("_")[-1]) if latest is not None else 0


def is_finished(run_dir: Path | str, total_steps: int) -> bool:
    """A run is finished when its latest checkpoint is at trainer.total_steps."""
    from dapo_mega.run_files.checkpoints import find_latest_checkpoint

    return find_latest_checkpoint(Path(run_dir)) is not None and completed_step(run_dir) >= total_steps


def total_steps_of(run: PlannedRun) -> int:
    """trainer.total_steps of a planned run (composed from its overrides)."""
    from dapo_mega.config import load_config

    return load_config(run.overrides).trainer.total_steps


def train_command(run: PlannedRun) -> List[str]:
    return [sys.executable, "-m", "dapo_mega.cli", "train", *run.overrides]


def log_path(plan: AblationPlan, run: PlannedRun) -> Path:
    return Path(plan.directory) / "logs" / f"{slug(run.rung)}-seed{run.seed}.log"


def run_locally(plan: AblationPlan, say: Optional[Callable[[str], None]] = None, timeout_s: float = 0.0,
                command: Callable[[PlannedRun], List[str]] = train_command) -> List[RunOutcome]:
    """The warm start (if any) and every run, one after another; returns each run's outcome.
    `say` gets each progress line (default: the library's logger)."""
    say = say or logger.info
    outcomes: List[RunOutcome] = []
    todo = ([plan.warm_start] if plan.warm_start else []) + list(plan.runs)
    for i, run in enumerate(todo):
        label = f"[ablate] {i + 1}/{len(todo)} {run.rung} seed {run.seed}"
        total = total_steps_of(run)
        if is_finished(run.run_dir, total):
            say(f"{label}: finished before (checkpoint at step {total}); skipped")
            outcomes.append(RunOutcome(run, "skipped"))
            continue
        if run is not plan.warm_start and plan.warm_start is not None and not is_finished(plan.warm_start.run_dir, 0):
            say(f"{label}: not started, the shared warm start did not finish")
            outcomes.append(RunOutcome(run, "failed"))
            continue
        done = completed_step(run.run_dir)
        log = log_path(plan, run)
        log.parent.mkdir(parents=True, exist_ok=True)
        say(f"{label}: {'resuming at step ' + str(done) if done else 'starting'}; log {log}")
        start = time.perf_counter()
        with open(log, "a") as out:
            proc = subprocess.Popen(command(run), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s or None)
            except subprocess.TimeoutExpired:
                _stop(proc)
                code = -9
            except BaseException:  # Ctrl-C: stop this run's process group, keep its checkpoints
                _stop(proc)
                raise
        seconds = time.perf_counter() - start
        status = "finished" if code == 0 and is_finished(run.run_dir, total) else "failed"
        record_timing(plan, run, seconds, status)
        say(f"{label}: {status} in {seconds:.0f} s" + ("" if status == "finished" else f" (exit {code}; see {log})"))
        outcomes.append(RunOutcome(run, status, seconds, code))
    return outcomes


TIMINGS_FILE = "timings.jsonl"
"""`<ablation>/logs/timings.jsonl`: one line per local run attempt (rung, seed, seconds, status),
kept across invocations, so the report can say how long the runs took in all."""


def record_timing(plan: AblationPlan, run: PlannedRun, seconds: float, status: str) -> None:
    path = Path(plan.directory) / "logs" / TIMINGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"rung": run.rung, "seed": run.seed, "seconds": round(seconds, 1), "status": status}) + "\n")


def total_run_seconds(directory: Path | str) -> Optional[float]:
    """Wall clock of every local run attempt so far (None when nothing ran locally)."""
    path = Path(directory) / "logs" / TIMINGS_FILE
    if not path.exists():
        return None
    total = 0.0
    for line in path.read_text().splitlines():
        try:
            total += float(json.loads(line)["seconds"])
        except (ValueError, KeyError):
            continue
    return total


def _stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the run's process group (learners, engines), then SIGKILL."""
    import signal

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# --------------------------------------------------------------------------- Slurm
DROPPED_SBATCH_OPTIONS = ("--job-name", "-J", "--output", "-o", "--dependency", "-d", "--array", "-a")
"""#SBATCH options of a topology file the array script leaves out: the array names its own
jobs and logs, and `--dependency=singleton` would run every task of the array in turn."""


def topology_directives(script_text: str) -> List[str]:
    """The `#SBATCH` lines of a topology script that an array task keeps (in order)."""
    kept = []
    for line in script_text.splitlines():
        m = re.match(r"^#SBATCH\s+(\S+)", line)
        if not m:
            continue
        option = m.group(1).split("=", 1)[0]
        if option not in DROPPED_SBATCH_OPTIONS:
            kept.append(line.rstrip())
    return kept


def array_script(topology: Path, repo: Path, python: str) -> str:
    """The array task script: the topology's #SBATCH lines, then exec the topology script
    with the overrides of task $SLURM_ARRAY_TASK_ID of the task file given as $1."""
    directives = "\n".join(topology_directives(topology.read_text()))
    return f"""#!/bin/bash
# dapo-mega ablate: one training run per array task. Written by `dapo-mega ablate --slurm`;
# the topology is {topology.name}'s (its #SBATCH lines below), the run's overrides are line
# $SLURM_ARRAY_TASK_ID of the task file "$1" (JSON: one list of overrides per task).
{directives}
set -euo pipefail
export DAPO_MEGA_REPO={shlex.quote(str(repo))}
PYTHON=${{PYTHON:-{shlex.quote(python)}}}
export PYTHON
mapfile -t ARGS < <("$PYTHON" -m dapo_mega.ablation task-args "$1" "${{SLURM_ARRAY_TASK_ID:-0}}")
echo "dapo-mega ablate: task ${{SLURM_ARRAY_TASK_ID:-0}} of $1: ${{ARGS[*]}}"
exec bash {shlex.quote(str(topology))} "${{ARGS[@]}}"
"""


def report_script(directory: Path, python: str) -> str:
    return f"""#!/bin/bash
# dapo-mega ablate: build ablation.md / .json / .png once every array task has ended.
#SBATCH --nodes=1
#SBATCH --ntasks=1
set -euo pipefail
PYTHON=${{PYTHON:-{shlex.quote(python)}}}
exec "$PYTHON" -m dapo_mega.ablation report {shlex.quote(str(directory))}
"""


def task_arguments(task_file: Path | str, index: int) -> List[str]:
    """The overrides of task `index` of a task file (`python -m dapo_mega.ablation task-args`)."""
    return list(json.loads(Path(task_file).read_text())[index])


@dataclass
class SlurmSubmission:
    """Job ids of a submitted ablation (warm start: None when not shared or already done)."""

    warm_start_job: Optional[int]
    array_job: Optional[int]
    report_job: int
    num_tasks: int


def _sbatch(args: Sequence[str], cwd: Path, env: Optional[dict] = None) -> int:
    out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, cwd=cwd,
                         env=env, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch {' '.join(args)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return int(out.stdout.strip().split(";")[0])


def submit_slurm(plan: AblationPlan, topology_name: str, sbatch_args: Sequence[str], max_parallel: int,
                 repo: Path, python: str = sys.executable, env: Optional[dict] = None,
                 say: Optional[Callable[[str], None]] = None) -> SlurmSubmission:
    """Write the task files and scripts, submit warm start -> array -> report (see the module
    docstring). Finished runs are left out of the array; the report job always runs."""
    say = say or logger.info
    directory = Path(plan.directory)
    slurm_dir = directory / "slurm"
    slurm_dir.mkdir(parents=True, exist_ok=True)
    topology = (repo / "slurm" / topology_name).resolve()
    if not topology.is_file():
        from dapo_mega.config import ConfigError

        raise ConfigError(f"ablation.sbatch_script: no {topology}. Fix: use colocated.sbatch or disaggregated.sbatch")
    array = slurm_dir / "array.sbatch"
    array.write_text(array_script(topology, repo, python))
    report = slurm_dir / "report.sbatch"
    report.write_text(report_script(directory, python))
    name = f"ablate-{directory.name}"
    common = [f"--output={slurm_dir}/slurm-%A_%a.out", f"-J{name}", *sbatch_args]

    warm_job: Optional[int] = None
    if plan.warm_start is not None and not is_finished(plan.warm_start.run_dir, 0):
        warm_file = slurm_dir / "warm_start.json"
        warm_file.write_text(json.dumps([plan.warm_start.overrides]))
        warm_job = _sbatch([*common, "--array=0", str(array), str(warm_file)], cwd=repo, env=env)
        say(f"[ablate] submitted the shared warm start: job {warm_job}")
    pending = [r for r in plan.runs if not is_finished(r.run_dir, total_steps_of(r))]
    array_job: Optional[int] = None
    if pending:
        runs_file = slurm_dir / "runs.json"
        runs_file.write_text(json.dumps([r.overrides for r in pending]))
        spec = f"0-{len(pending) - 1}" + (f"%{max_parallel}" if max_parallel > 0 else "")
        dependency = [f"--dependency=afterok:{warm_job}"] if warm_job is not None else []
        array_job = _sbatch([*common, f"--array={spec}", *dependency, str(array), str(runs_file)], cwd=repo, env=env)
        say(f"[ablate] submitted {len(pending)} runs as job array {array_job} ({len(plan.runs) - len(pending)} "
            "finished before)")
    after = array_job or warm_job
    report_args = [f"--output={slurm_dir}/slurm-report-%j.out", f"-J{name}-report",
                   *[a for a in sbatch_args if a.startswith("--mem")]]
    if after is not None:
        report_args.append(f"--dependency=afterany:{after}")
    report_job = _sbatch([*report_args, str(report)], cwd=repo, env=env)
    say(f"[ablate] the table is built by job {report_job} when the runs have ended: {directory}/ablation.md")
    return SlurmSubmission(warm_start_job=warm_job, array_job=array_job, report_job=report_job,
                           num_tasks=len(pending))
