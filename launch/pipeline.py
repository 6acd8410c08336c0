#!/usr/bin/env python
"""The whole reproduction of one experiment, from published files to the final score.

    python launch/pipeline.py --experiment dapo_qwen2.5_32b --nodes 16 --chain 8 --time 24:00:00 \\
        --hf-model /lustre/models/Qwen2.5-32B --dapo-math dapo-math-17k.parquet --aime aime-2024.parquet \\
        --output-dir /lustre/runs [--partition P --account A --container dapo.sqsh --mounts /lustre:/lustre] \\
        [--dry-run | --wait | --local] [-- more Hydra overrides]

Stages, in order: `data` (tools/prepare_data.py) -> `import` (tools/convert_checkpoint.py
import of the HF model) -> `verify` (its logits against the HF model's) -> `train` (a chain
of `--chain` jobs of slurm/colocated.sbatch or slurm/disaggregated.sbatch, each resuming
from the run's latest checkpoint) -> `export` (the final checkpoint to HF) -> `eval`
(`dapo-mega eval` of that export). Before anything is submitted the launcher runs
`dapo-mega plan` with the same overrides and refuses, quoting the plan, when the learner or
the engines do not fit, the placement breaks a rule, or a timeout is shorter than the work
it bounds (the training jobs' `--time` included). Every job gets a `--time` (given, or the
plan's estimate); options requesting GPUs go to the GPU stages only (training, eval).

Each stage is one Slurm job with `--kill-on-invalid-dep=yes`: a stage that fails cancels
every later one. Dependencies: each stage `afterok` on the one before; chain links 2..N
`afterany` on the link before (a link that crashes or times out is resumed by the next
from the last checkpoint), plus `afterok` on `verify`, so a failure before training cancels
the whole chain (`afterany` alone would start link 2 after link 1 was cancelled); `export`
`afterok` on the last link, and it refuses to export unless the run reached its last step.

This file holds topology and paths only (nodes, partition, container, files, chain
length); every hyperparameter comes from configs/experiment/<name>.yaml. `--local` runs
the same stages in the foreground on one machine without Slurm and stops at the first
stage that fails, printing the end of its log. launch/README.md has the details.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from pipeline_stages import (  # beside this file
    REPO,
    STAGES,
    TERMINAL,
    Pipeline,
    PipelineError,
    Stage,
    requests_gpus,
    sbatch_line,
)


def package_import_error() -> Optional[str]:
    """Why this interpreter cannot run the pipeline (None when it imports dapo_mega): the
    entry points run `${PYTHON:-python}`, which is the shell's first `python` unless PYTHON says."""
    try:
        import dapo_mega  # noqa: F401
    except ImportError as exc:
        return (f"{sys.executable} cannot import dapo_mega ({exc}); the launchers run ${{PYTHON:-python}}. Fix: "
                "activate the venv dapo-mega is installed in, or set PYTHON=/path/to/that/venv/bin/python")
    return None


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--experiment", required=True, help="configs/experiment/<name>.yaml")
    p.add_argument("--hf-model", type=Path, required=True, help="the HF checkpoint to start from")
    p.add_argument("--megatron-model", type=Path, help="where `import` writes (default <run_dir>/base_megatron)")
    p.add_argument("--dapo-math", type=Path, help="published DAPO-Math-17k parquet (the data stage's input)")
    p.add_argument("--aime", type=Path, help="published AIME 2024 parquet (the data stage's input)")
    p.add_argument("--data-dir", type=Path, help="prepared data (default <run_dir>/data)")
    p.add_argument("--output-dir", type=Path, help="trainer.output_dir (default: the config's)")
    p.add_argument("--run-name", help="trainer.run_name (default: the experiment's)")
    p.add_argument("--nodes", type=int, help="training nodes (disaggregated: learner nodes); default: the config's")
    p.add_argument("--engine-nodes", type=int, help="disaggregated: engine nodes (default: the config's)")
    p.add_argument("--learners-per-node", type=int, help="learner tasks per node (default cluster.gpus_per_node)")
    p.add_argument("--chain", type=int, default=4, help="chained training jobs (each resumes the run)")
    p.add_argument("--time", help="--time of each training job (e.g. 24:00:00; the plan checks a step fits); "
                                   "default: the plan's estimate of a link's share of the run")
    p.add_argument("--stage-time", help="--time of every other stage (default: each its own, from the plan's clock)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--container", help="Pyxis/enroot image for every step (CONTAINER)")
    p.add_argument("--mounts", help="container mounts src:dst[,src:dst] (MOUNTS)")
    p.add_argument("--python", default=os.environ.get("PYTHON", "python"), help="interpreter in the jobs (PYTHON)")
    p.add_argument("--sbatch-opt", action="append", default=[],
                   help="extra option of every job (repeat); those requesting GPUs (--gpus-per-node, --gres=gpu:..) "
                        "go to the stages that use GPUs only")
    p.add_argument("--from", dest="start", choices=STAGES, default="data", help="skip the stages before this one")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="check and print the sbatch lines; submit nothing")
    mode.add_argument("--local", action="store_true", help="run the stages here in the foreground (no Slurm)")
    p.add_argument("--wait", action="store_true", help="after submitting, wait and report each stage's end")
    p.add_argument("--gpus", type=int, help="--local: learner processes on this machine (default gpus_per_node)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides after --: paths, site fixes (not the recipe)")
    return p.parse_args(argv)


# --- the runners -------------------------------------------------------------------------
def submit(pipeline: Pipeline, stages: List[Stage], plan: dict, dry_run: bool) -> Optional[dict]:
    """Submit every stage in order (or print the lines: `--dry-run`); returns stage -> job id,
    None when a submission failed (the jobs already submitted are cancelled)."""
    env = {**os.environ, **pipeline.job_env()}
    print("job environment: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in pipeline.job_env().items()))
    job_ids: dict = {}
    if not dry_run:
        pipeline.logs.mkdir(parents=True, exist_ok=True)  # Slurm opens --output there; it creates no directory
        (pipeline.logs / "plan.json").write_text(json.dumps(plan, indent=1))
    for stage in stages:
        line = sbatch_line(stage, {s.name: f"<{s.name}>" for s in stages} if dry_run else job_ids)
        if dry_run:
            print(" ".join(shlex.quote(x) for x in line))
            continue
        out = subprocess.run(line, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
        if out.returncode != 0:
            print(f"pipeline: sbatch of stage '{stage.name}' failed: {out.stderr.strip()}; cancelling the "
                  f"{len(job_ids)} jobs submitted", file=sys.stderr)
            if job_ids:
                subprocess.run(["scancel", *job_ids.values()], env=env, timeout=60)
            return None
        job_ids[stage.name] = out.stdout.strip().split(";")[0]
    if not dry_run:
        print_summary(pipeline, stages, job_ids)
    return job_ids


def print_summary(pipeline: Pipeline, stages: List[Stage], job_ids: dict, states: Optional[dict] = None) -> None:
    print(f"{'stage':10s} {'job':>10s}  {'after':24s} {'state':12s} log" if states else
          f"{'stage':10s} {'job':>10s}  {'after':24s} log")
    for s in stages:
        after = ",".join([f"any:{n}" for n in s.after_any] + [f"ok:{n}" for n in s.after_ok]) or "-"
        state = f"{states.get(s.name, '?'):12s} " if states else ""
        print(f"{s.name:10s} {job_ids[s.name]:>10s}  {after:24s} {state}{s.log.replace('%j', job_ids[s.name])}")
    print(f"final export: {pipeline.hf_out}\nfinal eval result: {pipeline.eval_out}")


def job_state(job_id: str) -> str:
    """The job's state from the controller, or from accounting once the controller forgot it."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    m = re.search(r"JobState=(\S+)", out.stdout)
    if m:
        return m.group(1)
    acct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True,
                          timeout=60) if out.returncode != 0 else None
    states = acct.stdout.split() if acct is not None and acct.returncode == 0 else []
    return states[0] if states else "UNKNOWN"


def wait_for(pipeline: Pipeline, stages: List[Stage], job_ids: dict, poll_s: float = 5.0) -> int:
    """`--wait`: until every stage ended; prints each one's state and, for the first that did
    not complete, the end of its log. 0 when the final eval completed."""
    states: dict = {}
    while True:
        states = {s.name: job_state(job_ids[s.name]) for s in stages}
        if all(st.split()[0] in TERMINAL or st == "UNKNOWN" for st in states.values()):
            break
        time.sleep(poll_s)
    print_summary(pipeline, stages, job_ids, states)
    failed = stopping_stage(stages, states)
    if failed is None:
        for s in stages:
            if states[s.name] != "COMPLETED":  # a training link that failed; the next one resumed the run
                print(f"pipeline: {s.name} ended {states[s.name]}, a later link resumed the run "
                      f"(log {s.log.replace('%j', job_ids[s.name])})")
        print(f"pipeline: the final eval completed; result {pipeline.eval_out}")
        return 0
    print(f"pipeline: stage '{failed.name}' ended {states[failed.name]}; the end of its log:")
    print(log_tail(Path(failed.log.replace("%j", job_ids[failed.name]))))
    return 1


def stopping_stage(stages: List[Stage], states: dict) -> Optional[Stage]:
    """The stage that stopped the pipeline, None when its last stage completed. The stages are a
    line: it is the one before the first CANCELLED (unless that one completed: then the cancelled
    one was cancelled by hand), else the last that did not complete."""
    if states[stages[-1].name] == "COMPLETED":
        return None
    first = next((i for i, s in enumerate(stages) if states[s.name] == "CANCELLED"), None)
    if first is None:
        return [s for s in stages if states[s.name] != "COMPLETED"][-1]
    return stages[first - 1] if first and states[stages[first - 1].name] != "COMPLETED" else stages[first]


def log_tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return f"  ({path}: no log, the job never started)"
    return "\n".join("  | " + line for line in path.read_text(errors="replace").splitlines()[-lines:])


def run_local(pipeline: Pipeline, stages: List[Stage]) -> int:
    """`--local`: the stages one after another here, each logged to <run_dir>/logs/pipeline/
    <stage>.log; stops at the first that fails, quoting the end of its log."""
    pipeline.logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **pipeline.job_env()}
    for stage in stages:
        if stage.name.startswith("train-") and stage.name != "train-1":
            continue  # one machine, no wall time: one run (rerun with --from train to resume it)
        command = stage.command[1:] if not stage.name.startswith("train-") else \
            [pipeline.args.python, "-m", "dapo_mega.cli", "train", *stage.command]
        log = pipeline.logs / f"{stage.name.split('-')[0]}.log"
        print(f"[{stage.name.split('-')[0]}] {' '.join(shlex.quote(c) for c in command)}  (log {log})", flush=True)
        with open(log, "w") as f:
            rc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode
        if rc != 0:
            print(f"pipeline: stage '{stage.name.split('-')[0]}' failed with exit {rc}; the later stages did not "
                  f"run. The end of its log:\n{log_tail(log)}", file=sys.stderr)
            return rc
    print(f"pipeline: every stage completed; final eval result {pipeline.eval_out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # interleaved with the stages' output and the logs
    args = parse_args(argv)
    missing = package_import_error()
    if missing:
        print(f"pipeline: error: {missing}", file=sys.stderr)
        return 2
    from dapo_mega.config import ConfigError

    try:
        pipeline = Pipeline(args)
    except ConfigError as exc:  # a bad override: one line naming the key, as dapo-mega prints it
        print(f"pipeline: config error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    problem = pipeline.check_inputs()
    if problem:
        print(f"pipeline: error: {problem}", file=sys.stderr)
        return 2
    print(f"dapo-mega pipeline {args.experiment}: run dir {pipeline.run_dir}")
    print(f"plan: dapo-mega plan {' '.join(shlex.quote(o) for o in pipeline.overrides)}")
    refusal, warnings, plan = pipeline.plan()
    if refusal:
        print(f"pipeline: refused, the plan says: {refusal}", file=sys.stderr)
        return 1
    for w in warnings:
        print(f"plan warning: {w}")
    print("plan: fits" + (f" ({len(warnings)} warning{'s' if len(warnings) > 1 else ''} above)" if warnings else ""))
    try:
        stages = pipeline.stages(plan)
    except PipelineError as exc:
        print(f"pipeline: refused: {exc}", file=sys.stderr)
        return 1
    gpu_opts = [o for o in args.sbatch_opt if requests_gpus(o)]
    if gpu_opts and not args.local:
        print(f"GPU options {' '.join(gpu_opts)}: only in the stages that use GPUs "
              f"({', '.join(s.name for s in stages if s.gpu) or 'none: a CPU run'}); the others run on the CPU")
    if args.local:
        return run_local(pipeline, stages)
    job_ids = submit(pipeline, stages, plan, dry_run=args.dry_run)
    if job_ids is None:
        return 1
    return wait_for(pipeline, stages, job_ids) if args.wait and not args.dry_run else 0


if __name__ == "__main__":
    sys.exit(main())
