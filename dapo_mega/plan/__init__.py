"""The plan of a run, worked out from its config before any GPU is used (`dapo-mega plan`).

* `memory`: the planner: layout, memory per GPU and stage, engine KV room, checkpoint disk,
  conversion RAM, the learner's padding efficiency (`compute_plan`, `format_plan`);
* `types`: the `Plan` it returns, a record of typed sections;
* `clock`: the run's clock (phase durations beside the timeouts that bound them) and the
  derived engine start bound;
* `preflight`: the checks `dapo-mega train` and `eval` run before anything is built;
* `hand_over`: what the driver hands the learner ranks each step, in bytes;
* `nccl`, `nccl_probe`: whether the learners' and the engines' NCCL agree (the library each
  Python loads, not the one torch was built against).

This file imports nothing, so a caller of one module (`preflight` before a start) does not
load the planner.
"""
