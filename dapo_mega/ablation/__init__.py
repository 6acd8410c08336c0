"""`dapo-mega ablate`: rerun the DAPO paper's ablation ladder (or any ladder or one-factor
sweep of train overrides) with several seeds per rung and honest error bars.

    dapo-mega ablate +ablation=dapo_ladder [train overrides] [ablation.key=value]
    dapo-mega ablate +ablation=one_factor ablation.seeds=[1,2,3,4]
    dapo-mega ablate +ablation=dapo_ladder ablation.quick=true        a reduced ladder in minutes
    dapo-mega ablate +ablation=dapo_ladder --slurm ablation.sbatch_args=[--nodes=2]
    dapo-mega ablate +ablation=dapo_ladder --report                   rebuild the table only

Train overrides are those of `dapo-mega train`; `ablation.*` keys are those of
`AblationConfig` (`rungs.py`). Each rung x seed is an ordinary training run in its own run
directory (`runner.py`: locally one after another, or a Slurm job array; finished runs are
skipped, killed ones resume). The result is `ablation.md` / `.json` / `.png` in the
ablation's directory (`report.py`, statistics in `stats.py`); `__main__.py` holds what the
Slurm jobs run (`task-args`, `report`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List

from dapo_mega.ablation.rungs import (
    AblationConfig,
    AblationPlan,
    PlannedRun,
    RungConfig,
    build_plan,
    load_ablation_config,
    merge_overrides,
    split_arguments,
)


def plan_from_arguments(args: List[str]) -> tuple:
    """(AblationConfig, AblationPlan) of the command's arguments; every run's config is
    composed and validated here, before anything starts (ConfigError names the field)."""
    from dapo_mega.config import load_config

    ablation_args, train_args = split_arguments(args)
    cfg = load_ablation_config(ablation_args)
    common = load_config(merge_overrides(cfg.base, cfg.quick_overrides if cfg.quick else [], train_args))
    plan = build_plan(cfg, train_args, common.trainer.output_dir, common.trainer.sft_warmup_steps)
    for run in ([plan.warm_start] if plan.warm_start else []) + plan.runs:
        load_config(run.overrides)
    return cfg, plan


def run_ablate_command(args: List[str]) -> int:
    """`dapo-mega ablate`: flags --slurm and --report, the rest are overrides."""
    from dapo_mega.ablation.report import write_report
    from dapo_mega.ablation.runner import run_locally, submit_slurm
    from dapo_mega.config import config_dir

    slurm = "--slurm" in args
    report_only = "--report" in args
    cfg, plan = plan_from_arguments([a for a in args if a not in ("--slurm", "--report")])
    if report_only:
        md, _ = write_report(AblationPlan.load(plan.directory) if (Path(plan.directory) / "plan.json").exists()
                             else plan)
        print(md.read_text())
        return 0
    plan.save()
    n = len(plan.runs)
    print(f"[ablate] {cfg.name}{' (quick)' if cfg.quick else ''}: {len(plan.rungs)} rungs x "
          f"{len(cfg.active_seeds())} seeds = {n} runs" + (" + a shared warm start" if plan.warm_start else "")
          + f" in {plan.directory}", flush=True)
    if slurm or cfg.slurm:
        submit_slurm(plan, cfg.sbatch_script, cfg.sbatch_args, cfg.max_parallel, repo=config_dir().parent)
        return 0
    start = time.perf_counter()
    outcomes = run_locally(plan, timeout_s=cfg.run_timeout_s)
    md, _ = write_report(plan, elapsed_s=time.perf_counter() - start)
    print(md.read_text(), flush=True)
    print(f"[ablate] wrote {md}, ablation.json and ablation.png", flush=True)
    failed = [o for o in outcomes if o.status == "failed"]
    return 1 if failed else 0


__all__ = ["AblationConfig", "AblationPlan", "PlannedRun", "RungConfig", "plan_from_arguments", "run_ablate_command"]
