"""The stages of launch/pipeline.py: what each Slurm job of a reproduction runs, with which
options and after which others (`Pipeline.stages`), and the sbatch line of each.

The dependencies, and why: each stage `afterok` on the one before, with
`--kill-on-invalid-dep=yes`, so a stage that fails cancels every later one before it starts.
Training links 2..N wait `afterany` on the link before (a link that crashes or reaches its
time limit is resumed by the next from the run's latest checkpoint, as slurm/chain.sh does)
and `afterok` on the stage before training: a cancelled link satisfies `afterany`, so without
it a failed `verify` would cancel link 1 and then start link 2. `export` waits `afterok` on
the last link. The composed config is read (not validated: `dapo-mega plan` validates the
run's overrides) for the run directory, the mode, the layout and the step count only.

Devices and time limits: only the stages whose processes use GPUs (the training links and
the final eval of a GPU run) get the `--sbatch-opt` options that request GPUs
(`requests_gpus`: --gpus-per-node, --gres=gpu:..., ...); data, import, verify and export run
on the CPU, the conversion stages (import, verify, export) with `--cpus-per-task` = the
layout's tp·pp ranks (`conversion_cpus`: the clock's conversion estimate counts a core per
rank; one CPU would run the 32B import's 16 gloo ranks one at a time). Every stage gets a
`--time`: `--time` (training links) and `--stage-time` (the others) when given, else the
plan's clock (`stage_limits_s`, `training_link_limit_s`); a plan without it is refused. The training links also get `--signal=B:USR1@<lead>` from the
plan's clock (`stop_signal_lead_s`: a step, its evaluation and a checkpoint save, with a
margin), over the sbatch scripts' 600 s, which a 32B step (~22 min) and its save outlast.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
STAGES = ("data", "import", "verify", "train", "export", "eval")
EVAL_DRIVER_CPUS = 4
"""CPUs of `dapo-mega eval` itself beside its engines: the driver and its verifier workers."""
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
    gpu: bool = False
    """Its processes use GPUs (the training links and the eval of a GPU run): the GPU-requesting
    --sbatch-opt options go to such stages only."""

    @property
    def log(self) -> str:
        return next(o.split("=", 1)[1] for o in self.sbatch if o.startswith("--output="))


def _hydra(value: Path | str) -> str:
    from dapo_mega.config import hydra_value

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
        self.rollout = cfg.rollout
        self.mode = cfg.cluster.mode
        self.tp, self.pp = cfg.megatron.tensor_model_parallel_size, cfg.megatron.pipeline_model_parallel_size
        self.ep = cfg.megatron.expert_model_parallel_size
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
        return self.engine_python_problem()

    def engine_python_problem(self) -> Optional[str]:
        """SGLang engines (the training jobs' engines role, the final eval) start from
        `rollout.engine_python`; empty means the jobs' Python, which the GPU install of
        docs/cluster.md section 1 keeps SGLang out of. Refused here, at submit time, unless it
        is named (the jobs' Python too, when that one has SGLang); a named one visible here
        (no container) is asked whether it finds sglang; in the jobs the prepare role asks."""
        from dapo_mega.config import ConfigError
        from dapo_mega.plan.preflight import check_engine_python, python_has_sglang

        python = self.rollout.engine_python
        if self.rollout.backend != "sglang":
            return None
        if self.args.local:  # the jobs run here: the check they would make
            try:
                check_engine_python(self.rollout, starts_engines=True)
            except ConfigError as exc:
                return str(exc)
            return None
        if not python:
            return (f"rollout.engine_python: empty, so the SGLang engines of the training jobs and the eval would "
                    f"start from the jobs' Python ({self.args.python}), which the GPU install keeps SGLang out of "
                    "(docs/cluster.md section 1). Fix: add -- rollout.engine_python=/opt/sglang/bin/python (the "
                    f"SGLang venv's), or rollout.engine_python={self.args.python} if the jobs' Python has SGLang")
        if not self.args.container and Path(python).is_absolute() and Path(python).exists() and \
                not python_has_sglang(python):
            return (f"rollout.engine_python: {python} cannot import sglang. Fix: point it at the bin/python of the "
                    "SGLang venv (docs/cluster.md section 1)")
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
        from dapo_mega.plan.types import blocking_warnings

        warnings = plan.get("warnings", [])
        refusing = blocking_warnings(warnings, engines_take_gpus=not self.cpu)  # the plan says which ones block
        if refusing or out.returncode != 0:
            more = f"; and {len(refusing) - 4} more: run the `plan:` command above to see them all" if len(refusing) > 4 else ""
            return "; ".join(refusing[:4]) + more or f"dapo-mega plan exited {out.returncode}", [], plan
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
    def stages(self, plan: dict) -> List[Stage]:
        """The jobs from `--from` on, each with its dependencies on the ones before and its time
        limit (`plan`: `dapo-mega plan --json`'s, whose clock gives the limits not given)."""
        self.clock = plan.get("clock") or {}
        a, py = self.args, self.args.python
        meg, hf = str(self.megatron), str(a.hf_model.resolve())
        steps: List[Stage] = []
        if a.start == "data":
            steps.append(self._stage("data", [py, "tools/prepare_data.py", "--dapo-math", str(a.dapo_math.resolve()),
                                              "--aime", str(a.aime.resolve()), "--out", str(self.data_dir)]))
        if STAGES.index(a.start) <= STAGES.index("import"):
            steps.append(self._stage("import", [py, "tools/convert_checkpoint.py", "import", "--hf-path", hf,
                                                "--megatron-path", meg, "--tp", str(self.tp), "--pp", str(self.pp),
                                                *self.expert_args], cpus=self.conversion_cpus))
        if STAGES.index(a.start) <= STAGES.index("verify"):
            steps.append(self._stage("verify", [py, "tools/convert_checkpoint.py", "verify", "--hf-path", hf,
                                                "--megatron-path", meg, *self.expert_args], cpus=self.conversion_cpus))
        before_train = [steps[-1].name] if steps else []
        if STAGES.index(a.start) <= STAGES.index("train"):
            for i in range(1, a.chain + 1):
                link = self._train_link(i)
                link.after_ok = list(before_train)  # never after a failed stage before training
                link.after_any = [steps[-1].name] if i > 1 else []  # after the previous link however it ended
                steps.append(link)
        if STAGES.index(a.start) <= STAGES.index("export"):
            steps.append(self._stage("export", ["bash", "launch/export_final.sh", str(self.run_dir),
                                                str(self.total_steps), str(self.hf_out), "--tp", str(self.tp),
                                                "--pp", str(self.pp), *self.expert_args], cpus=self.conversion_cpus))
        engines = [f"rollout.num_engines={self.eval_engines}"] if self.eval_engines else []
        steps.append(self._stage("eval", [py, "-m", "dapo_mega.cli", "eval", *self.overrides, *engines,
                                          f"eval.checkpoint={_hydra(self.hf_out)}",
                                          f"eval.output={_hydra(self.eval_out)}"], gpu=not self.cpu,
                                 cpus=self.eval_cpus))
        for before, stage in zip(steps, steps[1:]):
            if not stage.after_ok and not stage.after_any:
                stage.after_ok = [before.name]
        return steps

    def _job_wide(self, name: str) -> List[str]:
        """Name and log: sbatch_line keeps these two (and the dependency) before any ':'."""
        return [f"--job-name={self.run_dir.name}-{name}", f"--output={self.logs}/{name}-%j.log"]

    def _site(self, time_limit: str, gpu: bool, before: Sequence[str] = ()) -> List[str]:
        """Options every job component takes: time limit, partition, account, the stage's own
        (`before`), the extra --sbatch-opt (those requesting GPUs only where the stage uses them)."""
        a = self.args
        return [f"--time={time_limit}"] + ([f"--partition={a.partition}"] if a.partition else []) + (
            [f"--account={a.account}"] if a.account else []) + list(before) + [
            o for o in a.sbatch_opt if gpu or not requests_gpus(o)]

    @property
    def expert_args(self) -> List[str]:
        """A mixture's conversions at the run's EP (each rank holds its share of the experts, not
        all of them); nothing for a dense model."""
        return ["--ep", str(self.ep)] if self.ep > 1 else []

    @property
    def conversion_cpus(self) -> int:
        """CPUs of a conversion stage: one per rank of the layout (import and export spawn tp·pp
        gloo ranks, times EP's data-parallel copies for a mixture; verify's one rank takes them
        all as torch threads, `spawn.torch_threads_per_rank`)."""
        from dapo_mega.backends.placement import conversion_world_size

        return conversion_world_size(self.tp, self.pp, self.ep)

    @property
    def eval_cpus(self) -> int:
        """CPUs of the GPU eval stage: each SGLang engine runs a scheduler process per GPU rank
        (each keeps a core busy) and a tokenizer and a detokenizer; the eval process and its
        verifier workers take EVAL_DRIVER_CPUS. Slurm's default, one CPU for the task, held two
        TP-4 engines' ten processes on one core. 0 (Slurm's default) on a CPU run."""
        if not self.eval_engines:
            return 0
        gpus_per_engine = self.rollout.engine_tp_size * self.rollout.engine_dp_size
        return self.eval_engines * (gpus_per_engine + 2) + EVAL_DRIVER_CPUS

    def _stage(self, name: str, command: List[str], gpu: bool = False, cpus: int = 0) -> Stage:
        """A one-node stage; `cpus` > 0: `--cpus-per-task` (stage.sbatch passes it on to its srun),
        before the site options so an --sbatch-opt=--cpus-per-task=N wins."""
        own = [f"--cpus-per-task={cpus}"] if cpus else []
        return Stage(name, [name, *command], "launch/stage.sbatch",
                     self._job_wide(name) + self._site(self._stage_time(name), gpu, before=own), gpu=gpu)

    def _stage_time(self, name: str) -> str:
        """--stage-time, else the plan's limit of this stage; refused without either."""
        if self.args.stage_time:
            return self.args.stage_time
        seconds = (self.clock.get("stage_limits_s") or {}).get(name)
        if not seconds:
            raise PipelineError(f"the plan gives no time limit for stage '{name}' (clock.stage_limits_s). "
                                "Fix: pass --stage-time, or rerun with a dapo-mega plan that estimates it")
        return slurm_time(seconds)

    def _link_time(self) -> str:
        """--time, else the plan's estimate of one link's share of the run (`training_link_limit_s`)."""
        if self.args.time:
            return self.args.time
        if not {"step_s", "engine_start_s", "assumptions"} <= set(self.clock):
            raise PipelineError("the plan gives no step time to derive the training jobs' --time from. "
                                "Fix: pass --time")
        from dapo_mega.plan.clock import training_link_limit_s

        return slurm_time(training_link_limit_s(self.clock, self.total_steps, self.args.chain))

    def _stop_signal(self, link_time: str) -> str:
        """`--signal=B:USR1@<lead>`: the plan's `stop_signal_lead_s` (a step, its evaluation and a
        save, with a margin) before the time limit, so the learners save before Slurm kills them;
        the sbatch scripts' own 600 s without a clock. Refused when it leaves the job no time."""
        from dapo_mega.launch import parse_slurm_duration
        from dapo_mega.plan.clock import STOP_SIGNAL_FLOOR_S, STOP_SIGNAL_MAX_S

        lead = math.ceil(max(STOP_SIGNAL_FLOOR_S, self.clock.get("stop_signal_lead_s") or 0.0))
        limit = parse_slurm_duration(link_time)  # None: UNLIMITED
        if lead > STOP_SIGNAL_MAX_S or (limit is not None and lead >= limit):
            raise PipelineError(f"--time {link_time}: the learners need their stop signal {lead} s before the limit "
                                "(the plan's clock.stop_signal_lead_s: a step, its evaluation and a checkpoint save), "
                                f"which leaves the job no time to train. Fix: pass a --time well over {lead} s")
        return f"--signal=B:USR1@{lead}"

    def _train_link(self, i: int) -> Stage:
        link_time = self._link_time()
        opts, site = self._job_wide(f"train-{i}"), self._site(link_time, gpu=not self.cpu)
        # the batch script (component 0 of a heterogeneous job) gets the signal and passes it on
        signal = self._stop_signal(link_time)
        if self.mode == "disaggregated":  # heterogeneous: learner nodes : engine nodes
            opts += [f"--nodes={self.nodes}", signal, *site, ":", f"--nodes={self.engine_nodes}", *site]
        else:
            opts += [f"--nodes={self.nodes}", signal, *site]
        return Stage(f"train-{i}", list(self.overrides), f"slurm/{self.mode}.sbatch", opts, gpu=not self.cpu)

    def job_env(self) -> dict:
        """The environment the jobs run with (sbatch exports the submitting one)."""
        env = {"DAPO_MEGA_REPO": str(REPO), "PYTHON": self.args.python,
               "LEARNERS_PER_NODE": str(self.learners_per_node)}
        env.update({k: v for k, v in (("CONTAINER", self.args.container), ("MOUNTS", self.args.mounts)) if v})
        return env


class PipelineError(Exception):
    """The launcher cannot build a stage's job; the message names it and the fix."""


GPU_OPTIONS = ("--gpus", "-G", "--gpus-per-node", "--gpus-per-task", "--gpus-per-socket", "--cpus-per-gpu",
               "--mem-per-gpu", "--gpu-bind", "--gpu-freq", "--ntasks-per-gpu")
"""sbatch options (Slurm 22.05) that request GPUs or only apply to a job that has them."""


def requests_gpus(option: str) -> bool:
    """Whether an sbatch option (`--gpus-per-node=8`, `--gres=gpu:8`, `-G8`, ...) asks for GPUs."""
    name, value = (option.split("=", 1) + [""])[:2] if option.startswith("--") else (option[:2], option[2:])
    name, *rest = name.split() or [""]
    value = value or " ".join(rest)
    if name in GPU_OPTIONS:
        return True
    return name in ("--gres", "--tres-per-task", "--tres-per-node") and "gpu" in value


def slurm_time(seconds: float) -> str:
    """A Slurm --time of at least `seconds`, in whole minutes: HH:MM:00 or D-HH:MM:00."""
    days, minutes = divmod(math.ceil(seconds / 60), 24 * 60)
    hours, minutes = divmod(minutes, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:00" if days else f"{hours:02d}:{minutes:02d}:00"


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
