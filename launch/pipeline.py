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
it bounds (the training jobs' `--time` included).

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
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
STAGES = ("data", "import", "verify", "train", "export", "eval")
REFUSING_WARNINGS = (r"^learner does not fit", r"^learner and engine do not fit", r"^engines have no KV-cache room",
                     r"engines x \d+ GPUs need", r"^placement: ", r"^clock: ", r"not divisible by tp\*pp\*cp",
                     r"do not split over TP", r"layers do not split evenly")
"""Plan warnings that would stop (or silently break) the run: the launcher refuses on these;
the others (idle GPUs, TP across nodes, ...) are printed and let through."""
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE")


@dataclass
class Stage:
    """One Slurm job of the pipeline (a training chain has one per link)."""

    name: str
    """data, import, verify, train-<i>, export or eval."""
    command: List[str]
    """What runs: the stage script's arguments, or a training link's Hydra overrides."""
    script: str
    """launch/stage.sbatch, slurm/colocated.sbatch or slurm/disaggregated.sbatch."""
    sbatch: List[str] = field(default_factory=list)
    """Options of this job besides the dependency (nodes, time, output, name)."""
    after_ok: List[str] = field(default_factory=list)
    """Stages this one starts after, each COMPLETED."""
    after_any: List[str] = field(default_factory=list)
    """Stages this one starts after, in whatever state they ended (chain links)."""

    @property
    def log(self) -> str:
        return next(o.split("=", 1)[1] for o in self.sbatch if o.startswith("--output="))


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
    p.add_argument("--time", help="--time of each training job (e.g. 24:00:00); the plan checks a step fits")
    p.add_argument("--stage-time", help="--time of the other stages")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--container", help="Pyxis/enroot image for every step (CONTAINER)")
    p.add_argument("--mounts", help="container mounts src:dst[,src:dst] (MOUNTS)")
    p.add_argument("--python", default=os.environ.get("PYTHON", "python"), help="interpreter in the jobs (PYTHON)")
    p.add_argument("--sbatch-opt", action="append", default=[], help="extra option of every job (repeat)")
    p.add_argument("--from", dest="start", choices=STAGES, default="data", help="skip the stages before this one")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="check and print the sbatch lines; submit nothing")
    mode.add_argument("--local", action="store_true", help="run the stages here in the foreground (no Slurm)")
    p.add_argument("--wait", action="store_true", help="after submitting, wait and report each stage's end")
    p.add_argument("--gpus", type=int, help="--local: learner processes on this machine (default gpus_per_node)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides after --: paths, site fixes (not the recipe)")
    return p.parse_args(argv)


def _hydra(value: Path | str) -> str:
    from dapo_mega.launch import hydra_value

    return hydra_value(str(value))


class Pipeline:
    """The stages of one experiment's reproduction, from the launcher's arguments and the
    composed config (read only for the run directory, the mode, the layout and the step count)."""

    def __init__(self, args: argparse.Namespace):
        from dapo_mega.config import compose_config, register_configs

        register_configs()
        self.args = args
        base = [f"+experiment={args.experiment}"] + ([f"trainer.run_name={_hydra(args.run_name)}"]
                                                     if args.run_name else [])
        if args.output_dir:
            base.append(f"trainer.output_dir={_hydra(args.output_dir.resolve())}")
        # read, not validated: the launcher's topology completes it; `dapo-mega plan` validates the result
        cfg = compose_config("config", base + list(args.overrides))
        if not args.output_dir:  # absolute, so the jobs (run from the repository root) mean this directory
            base.append(f"trainer.output_dir={_hydra(REPO / cfg.trainer.output_dir)}")
            cfg = compose_config("config", base + list(args.overrides))
        self.run_dir = cfg.run_dir.resolve()
        self.mode = cfg.cluster.mode
        self.tp, self.pp = cfg.megatron.tensor_model_parallel_size, cfg.megatron.pipeline_model_parallel_size
        self.total_steps = cfg.trainer.total_steps
        self.cpu = cfg.cluster.device == "cpu"
        self.learners_per_node = args.learners_per_node or cfg.cluster.gpus_per_node
        engine_nodes = args.engine_nodes or cfg.cluster.engine_nodes
        self.nodes = args.nodes or (cfg.cluster.num_nodes - engine_nodes if self.mode == "disaggregated"
                                    else cfg.cluster.num_nodes)
        self.engine_nodes = engine_nodes if self.mode == "disaggregated" else 0
        gpus_per_engine = cfg.rollout.engine_tp_size * cfg.rollout.engine_dp_size
        self.eval_engines = None if self.cpu else max(1, cfg.cluster.gpus_per_node // gpus_per_engine)
        self.logs = self.run_dir / "logs" / "pipeline"
        self.megatron = (args.megatron_model or self.run_dir / "base_megatron").resolve()
        self.data_dir = (args.data_dir or self.run_dir / "data").resolve()
        self.hf_out = self.run_dir / "hf_final"
        self.eval_out = self.run_dir / "eval" / "final.json"
        if args.local:  # one machine: its GPUs are the learner processes (dapo-mega train starts them)
            gpus = args.gpus or self.learners_per_node
            topology = ["cluster.num_nodes=1", f"cluster.gpus_per_node={gpus}", f"cluster.num_learner_processes={gpus}"]
        else:
            topology = [f"cluster.num_nodes={self.nodes + self.engine_nodes}"]
            topology += [f"cluster.engine_nodes={self.engine_nodes}"] if self.mode == "disaggregated" else []
        self.overrides = base + [f"model.hf_path={_hydra(args.hf_model.resolve())}",
                                 f"model.megatron_path={_hydra(self.megatron)}",
                                 f"data.train_path={_hydra(self.data_dir / 'dapo_math_17k.parquet')}",
                                 f"data.eval_path={_hydra(self.data_dir / 'aime_2024.parquet')}",
                                 *topology, *args.overrides]

    # --- inputs and plan ----------------------------------------------------------------
    def check_inputs(self) -> Optional[str]:
        """The first missing input, as a one-line error naming the flag and the fix."""
        a = self.args
        if STAGES.index(a.start) <= STAGES.index("verify") and not (a.hf_model / "config.json").is_file():
            return (f"--hf-model {a.hf_model}: no config.json there. Fix: point it at the HF checkpoint directory "
                    "(config.json, tokenizer, *.safetensors)")
        if a.start == "data":
            for flag, path in (("--dapo-math", a.dapo_math), ("--aime", a.aime)):
                if path is None or not path.is_file():
                    return (f"{flag} {path or '(not given)'}: no such file. Fix: give the published parquet, or "
                            f"--from import with --data-dir holding the prepared files")
        if a.chain < 1:
            return f"--chain {a.chain}: must be >= 1. Fix: give the number of chained training jobs"
        return None

    def plan(self) -> tuple:
        """(refusal reason or None, other warnings, the plan's JSON) of `dapo-mega plan` on this
        run's overrides, with the training jobs' --time as trainer.wall_time_minutes."""
        extra = [f"trainer.wall_time_minutes={slurm_minutes(self.args.time):g}"] if self.args.time else []
        cmd = [sys.executable, "-m", "dapo_mega.cli", "plan", *self.overrides, *extra, "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
        try:
            plan = json.loads(out.stdout)
        except json.JSONDecodeError:
            tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
            return f"dapo-mega plan failed (exit {out.returncode}): {tail}", [], {}
        warnings = plan.get("warnings", [])
        patterns = [p for p in REFUSING_WARNINGS if not (self.cpu and "GPUs need" in p)]  # CPU engines take no GPU
        refusing = [w for w in warnings if any(re.search(p, w) for p in patterns)]
        if refusing or out.returncode != 0:
            return "; ".join(refusing) or f"dapo-mega plan exited {out.returncode}", [], plan
        others = [w for w in warnings if w not in refusing]
        others += self._chain_warning(plan.get("clock", {}))
        return None, others, plan

    def _chain_warning(self, clock: dict) -> List[str]:
        """The plan's estimate of the training time against the chain's total time limit."""
        if not self.args.time or not clock.get("step_s"):
            return []
        need_h = self.total_steps * clock["step_s"] / 3600 + self.args.chain * clock.get("engine_start_s", 0) / 3600
        have_h = self.args.chain * slurm_minutes(self.args.time) / 60
        if need_h <= have_h:
            return []
        return [f"chain: the plan estimates ~{need_h:,.0f} h of training ({self.total_steps} steps of "
                f"~{clock['step_s'] / 60:,.0f} min plus engine starts), the chain gives {self.args.chain} x "
                f"{self.args.time} = {have_h:,.0f} h; raise --chain to {math.ceil(self.args.chain * need_h / have_h)}"]

    # --- stages -------------------------------------------------------------------------
    def stages(self) -> List[Stage]:
        """The jobs from `--from` on, each with its dependencies on the ones before."""
        a, py = self.args, self.args.python
        meg, hf = str(self.megatron), str(a.hf_model.resolve())
        steps: List[Stage] = []
        if a.start == "data":
            steps.append(self._stage("data", [py, "tools/prepare_data.py", "--dapo-math", str(a.dapo_math.resolve()),
                                              "--aime", str(a.aime.resolve()), "--out", str(self.data_dir)]))
        if STAGES.index(a.start) <= STAGES.index("import"):
            steps.append(self._stage("import", [py, "tools/convert_checkpoint.py", "import", "--hf-path", hf,
                                                "--megatron-path", meg, "--tp", str(self.tp), "--pp", str(self.pp)]))
        if STAGES.index(a.start) <= STAGES.index("verify"):
            steps.append(self._stage("verify", [py, "tools/convert_checkpoint.py", "verify", "--hf-path", hf,
                                                "--megatron-path", meg]))
        before_train = steps[-1].name if steps else None
        if STAGES.index(a.start) <= STAGES.index("train"):
            for i in range(1, a.chain + 1):
                link = self._train_link(i)
                if i == 1:
                    link.after_ok = [before_train] if before_train else []
                else:  # resume after the previous link however it ended, never after a failed stage before training
                    link.after_any = [steps[-1].name]
                    link.after_ok = [before_train] if before_train else []
                steps.append(link)
        steps.append(self._stage("export", ["bash", "launch/export_final.sh", str(self.run_dir), str(self.total_steps),
                                            str(self.hf_out), "--tp", str(self.tp), "--pp", str(self.pp)]))
        engines = [f"rollout.num_engines={self.eval_engines}"] if self.eval_engines else []
        steps.append(self._stage("eval", [py, "-m", "dapo_mega.cli", "eval", *self.overrides, *engines,
                                          f"eval.checkpoint={_hydra(self.hf_out)}",
                                          f"eval.output={_hydra(self.eval_out)}"]))
        for before, stage in zip(steps, steps[1:]):
            if not stage.after_ok and not stage.after_any:
                stage.after_ok = [before.name]
        return steps

    def _common(self, name: str, time_limit: Optional[str]) -> List[str]:
        """Job-wide options: name and log first (sbatch_line keeps them before any ':'), then --time."""
        opts = [f"--job-name={self._job_name(name)}", f"--output={self.logs}/{name}-%j.log"]
        opts += [f"--time={time_limit}"] if time_limit else []
        return opts

    def _job_name(self, name: str) -> str:
        return f"{self.run_dir.name}-{name}"

    def _site(self) -> List[str]:
        """Options every job component takes: partition, account, the extra --sbatch-opt."""
        a = self.args
        return ([f"--partition={a.partition}"] if a.partition else []) + (
            [f"--account={a.account}"] if a.account else []) + list(a.sbatch_opt)

    def _stage(self, name: str, command: List[str]) -> Stage:
        return Stage(name, [name, *command], "launch/stage.sbatch",
                     self._common(name, self.args.stage_time) + self._site())

    def _train_link(self, i: int) -> Stage:
        opts = self._common(f"train-{i}", self.args.time)
        if self.mode == "disaggregated":  # heterogeneous: learner nodes : engine nodes
            opts += [f"--nodes={self.nodes}", *self._site(), ":", f"--nodes={self.engine_nodes}", *self._site()]
        else:
            opts += [f"--nodes={self.nodes}", *self._site()]
        return Stage(f"train-{i}", list(self.overrides), f"slurm/{self.mode}.sbatch", opts)

    def job_env(self) -> dict:
        """The environment the jobs run with (sbatch exports the submitting one)."""
        env = {"DAPO_MEGA_REPO": str(REPO), "PYTHON": self.args.python,
               "LEARNERS_PER_NODE": str(self.learners_per_node)}
        env.update({k: v for k, v in (("CONTAINER", self.args.container), ("MOUNTS", self.args.mounts)) if v})
        return env


def slurm_minutes(text: str) -> float:
    """Minutes of a Slurm --time value (MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]])."""
    from dapo_mega.launch import parse_slurm_duration

    seconds = parse_slurm_duration(text)
    if seconds is None:
        raise SystemExit(f"pipeline: --time {text}: not a Slurm duration. Fix: e.g. 24:00:00 or 1-00:00:00")
    return seconds / 60


def dependency(stage: Stage, job_ids: dict) -> List[str]:
    """`--dependency=afterany:<prev>,afterok:<verify>` (all must hold) and `--kill-on-invalid-dep=yes`."""
    parts = [f"afterany:{job_ids[n]}" for n in stage.after_any] + [f"afterok:{job_ids[n]}" for n in stage.after_ok]
    return [f"--dependency={','.join(parts)}", "--kill-on-invalid-dep=yes"] if parts else []


def sbatch_line(stage: Stage, job_ids: dict) -> List[str]:
    """The whole sbatch command; job-wide options (name, output, dependency) come first, as
    after a ':' they would apply to the last component of a heterogeneous job only."""
    return ["sbatch", "--parsable", *stage.sbatch[:2], *dependency(stage, job_ids), *stage.sbatch[2:], stage.script,
            *stage.command]


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
    failed = next((s for s in stages if states[s.name] not in ("COMPLETED", "CANCELLED")
                   and not s.name.startswith("train-")), None)
    failed = failed or next((s for s in stages if states[s.name] != "COMPLETED"), None)
    if failed is None:
        print(f"pipeline: every stage completed; final eval result {pipeline.eval_out}")
        return 0
    print(f"pipeline: stage '{failed.name}' ended {states[failed.name]}; the end of its log:")
    print(log_tail(Path(failed.log.replace("%j", job_ids[failed.name]))))
    return 1


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
    print("plan: fits" + (f" ({len(warnings)} warnings above)" if warnings else ""))
    stages = pipeline.stages()
    if args.local:
        return run_local(pipeline, stages)
    job_ids = submit(pipeline, stages, plan, dry_run=args.dry_run)
    if job_ids is None:
        return 1
    return wait_for(pipeline, stages, job_ids) if args.wait and not args.dry_run else 0


if __name__ == "__main__":
    sys.exit(main())
