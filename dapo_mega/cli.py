"""`dapo-mega` command line: train, eval, audit, plan, ablate.

    dapo-mega train [hydra overrides]      the DAPO run (no overrides: embedded CPU default)
    dapo-mega train --cfg job [overrides]  print the composed config and exit
    dapo-mega train --help                 every config field with its default and meaning
    dapo-mega eval  [overrides] eval.checkpoint=... avg@k on the held-out set
    dapo-mega audit [overrides] [--checkpoint PATH] [--n N] [--seed S] [--per-stratum K] [--out DIR] [--json]
                                           N fixed training prompts rolled out and graded as in training
                                           -> audit.md / audit.html / audit.json for a person to read
    dapo-mega plan  [overrides] [clock.key=value] [--json]
                                           layout and memory per GPU and the run's clock (phase
                                           durations beside the timeouts), without starting anything
    dapo-mega ablate +ablation=dapo_ladder [overrides] [--slurm] [--report]
                                           rungs x seeds of training runs -> ablation.md/.json/.png
    dapo-mega sandbox FILE [--wall-s S] [--cpu-s S] [--memory-mb M] [--output-bytes B] [--json]
                                           run FILE as the python tool would and print what the
                                           model would see (exit 0 unless the sandbox failed)
    dapo-mega sandbox serve [--host H] [--port P] [--max-concurrent N] [limits]
                                           the sandbox as a service (environments/sandbox_service.py)

Overrides use Hydra syntax (`algo.lr=2e-6`, `+experiment=dapo_qwen2.5_32b`).
"""

from __future__ import annotations

import sys
from typing import List, Optional

from dapo_mega.config import ConfigError, describe_fields, load_config, to_yaml

COMMANDS = ("train", "eval", "audit", "plan", "ablate", "sandbox")


def _usage() -> str:
    return __doc__ or ""


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"dapo-mega: unknown command {command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if command == "sandbox" and rest[:1] == ["serve"]:
        from dapo_mega.environments.sandbox_service import main as serve_main

        return serve_main(rest[1:])
    if command == "sandbox":
        from dapo_mega.environments.sandbox import main as sandbox_main

        return sandbox_main(rest)
    if "-h" in rest or "--help" in rest:
        print(_usage())
        print("Config fields (override with key=value):")
        print("\n".join("  " + line for line in describe_fields()))
        if command == "ablate":
            from dapo_mega.ablation.rungs import AblationConfig

            print("Ablation fields (ablation.key=value; pick one with +ablation=dapo_ladder or one_factor):")
            print("\n".join("  " + line for line in describe_fields(AblationConfig, prefix="ablation.")))
        if command == "audit":
            from dapo_mega.audit import USAGE

            print("Audit flags (besides the overrides):\n" + USAGE)
        if command == "plan":
            from dapo_mega.plan.clock import ClockAssumptions

            print("Clock assumptions (clock.key=value; null rates follow the engine's size):")
            print("\n".join("  " + line for line in describe_fields(ClockAssumptions, prefix="clock.")))
        return 0
    if command == "ablate":  # its own config group besides the train overrides
        return _ablate(rest)
    if command == "audit":  # its own flags besides the overrides
        return _audit(rest)
    show_cfg = False
    as_json = False
    overrides: List[str] = []
    clock: List[str] = []  # `plan` only: clock.* assumptions, not config fields
    it = iter(rest)
    for arg in it:
        if arg == "--cfg":
            next(it, None)
            show_cfg = True
        elif arg == "--json":
            as_json = True
        elif command == "plan" and arg.startswith("clock."):
            clock.append(arg)
        else:
            overrides.append(arg)
    try:
        cfg = load_config(overrides)
        if show_cfg:
            print(to_yaml(cfg))
            return 0
        if command == "plan":
            return _plan(cfg, clock, as_json)
        return _run(command, cfg, overrides, as_json)
    except ConfigError as exc:  # every config error, whenever found: one line naming the field and the fix
        print(f"dapo-mega: config error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _ablate(rest: List[str]) -> int:
    from dapo_mega.ablation import run_ablate_command

    try:
        return run_ablate_command(rest)
    except ConfigError as exc:
        print(f"dapo-mega: config error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _audit(rest: List[str]) -> int:
    from dapo_mega.audit import run_audit_command
    from dapo_mega.data import DataError
    from dapo_mega.engines.process import EngineStartError

    try:
        return run_audit_command(rest)
    except (ConfigError, DataError) as exc:
        print(f"dapo-mega: {'data' if isinstance(exc, DataError) else 'config'} error: {_one_line(exc)}",
              file=sys.stderr)
        return 2
    except EngineStartError as exc:  # names the engine's log and quotes its last lines
        print(f"dapo-mega: engine error: {exc}", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _run(command: str, cfg, overrides: List[str], as_json: bool) -> int:
    if command == "train":
        from dapo_mega.data import DataError
        from dapo_mega.driver.known_warnings import route_known_warnings

        route_known_warnings(cfg.run_dir)  # before the preflight imports megatron-core
        from dapo_mega.driver.weight_probe import WeightCheckError
        from dapo_mega.engines.process import EngineStartError
        from dapo_mega.plan.preflight import check_before_start
        from dapo_mega.trainer import run_training

        check_before_start(cfg)  # layout, model shape, data files: before anything is built
        try:
            return run_training(cfg)
        except DataError as exc:  # the user's data, not a bug: the message names file, row and field
            print(f"dapo-mega: data error: {exc}", file=sys.stderr)
            return 2
        except EngineStartError as exc:  # names the engine's log and quotes its last lines
            print(f"dapo-mega: engine error: {exc}", file=sys.stderr)
            return 1
        except WeightCheckError as exc:  # names the check, the engine and the likely cause
            print(f"dapo-mega: weight check failed: {exc}", file=sys.stderr)
            return 1
    if command == "eval":
        from dapo_mega.engines.process import EngineStartError
        from dapo_mega.evaluate import run_eval_command
        from dapo_mega.plan.preflight import check_eval_inputs

        check_eval_inputs(cfg)  # data files, a held-out set, the checkpoints: before engines start
        try:
            return run_eval_command(cfg)
        except EngineStartError as exc:  # names the engine's log and quotes its last lines
            print(f"dapo-mega: engine error: {exc}", file=sys.stderr)
            return 1
    raise ValueError(f"unknown command {command!r}")


def _plan(cfg, clock_overrides: List[str], as_json: bool) -> int:
    """`dapo-mega plan`: the plan (layout, memory) and the clock (durations beside the timeouts
    that bound them), warnings of both last; exit 1 when the learner does not fit, alone or
    beside a colocated engine."""
    import json

    from dapo_mega.plan.clock import assumptions_from_overrides, clock_warnings, estimate_clock, format_clock
    from dapo_mega.plan.memory import compute_plan, format_plan
    from dapo_mega.records.ledger import ledger_bytes_per_step_of

    assumptions = assumptions_from_overrides(clock_overrides)
    plan = compute_plan(cfg, assumptions.lengths)
    clock = estimate_clock(cfg, assumptions, plan)
    plan.warnings.extend(f"clock: {w}" for w in clock_warnings(cfg, clock))
    lengths = assumptions.lengths.resolved(cfg.algo.max_prompt_length, cfg.algo.max_response_length)
    per_round = ledger_bytes_per_step_of(cfg, lengths.response_moment(1, cfg.algo.max_response_length),
                                         lengths.prompt_tokens, shape=plan.model.shape)
    rounds = max(1, cfg.algo.max_num_gen_batches)
    routed = ", with routed experts" if cfg.trainer.ledger_routed_experts and plan.model.shape.is_moe else ""
    ledger = (f"ledger: {per_round / 1e6:,.1f} MB per step and generation round (trainer.ledger_text="
              f"{cfg.trainer.ledger_text}{routed}; up to {per_round * rounds / 1e6:,.1f} MB at algo.max_num_gen_batches="
              f"{cfg.algo.max_num_gen_batches}), {per_round * cfg.trainer.total_steps / 1e9:,.1f} GB over "
              f"{cfg.trainer.total_steps} steps of one round")
    if as_json:  # the plan's sections, then the clock and the ledger
        print(json.dumps({**plan.to_dict(), "clock": clock.to_dict(),
                          "ledger": {"bytes_per_step": per_round, "bytes_per_step_at_round_limit": per_round * rounds,
                                     "text": cfg.trainer.ledger_text}}, indent=2))
    else:
        print(format_plan(plan, sections=[format_clock(cfg, clock), ledger]))
    return 1 if any(w.startswith(("learner does not fit", "learner and engine do not fit"))
                    for w in plan.warnings) else 0


if __name__ == "__main__":
    sys.exit(main())
