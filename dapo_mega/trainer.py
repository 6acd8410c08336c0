"""The DAPO driver loop: `dapo-mega train`.

    generate -> reward -> dynamic sampling -> advantages -> train (mini-batches)
             -> sync weights (policy_version += 1) -> evaluate -> save -> HF export
             -> stop early, saved, when another step would not fit trainer.wall_time_minutes,
                or on SIGUSR1 / SIGTERM (exit 75: run again to resume; driver/stop_signal.py)

Every learner rank runs `train`. Global rank 0 is also the driver: it owns the rollout
engines, the verifier, the data cursor, the ledger and the records, and hands each step's
samples to the other ranks; `role` is that part on each rank (`driver/roles.py`: the driver,
or a learner rank that receives), so the loop never tests the rank. The components live in
`dapo_mega/driver/` (see docs/architecture.md); `dapo_mega/session.py` wires them,
and this file is the loop.

How it departs from the textbook: no critic and no KL (DAPO); the loss is token-level
over the whole mini-batch; groups with uniform rewards are dropped and refilled; in
disaggregated mode with `cluster.max_staleness = k > 0` generation of step s+1.. runs on a
background thread while step s trains, and a sample more than k versions older than the
learner is dropped as `stale`; disaggregated, the held-out evaluation of step s runs beside
step s+1 (`eval.overlap`, driver/eval_beside.py) and its row is written when it ends.

Run it with no arguments for the embedded CPU default; `python -m dapo_mega.trainer
--config RUN_DIR/config.yaml` is how spawned learner ranks start.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, Optional, Tuple

from dapo_mega.config import DapoConfig, check_warm_start, eval_beside, from_yaml
from dapo_mega.driver.stop_signal import EXIT_STOPPED, WALL_TIME, StopSignals, stop_message
from dapo_mega.heap import freeze_startup_objects, keep_freed_memory
from dapo_mega.records.resources import PhaseMeter


def train(cfg: DapoConfig) -> int:
    """The loop. Returns a process exit code."""
    import torch

    from dapo_mega.session import Session

    if not torch.cuda.is_available():
        keep_freed_memory()                     # the learner computes on the CPU (heap.py)
    signals = StopSignals().install()           # SIGUSR1 / SIGTERM: checkpoint at the end of the step, exit 75
    try:
        s = Session.start(cfg)                  # process groups, learner, engines, resume
    except BaseException:
        signals.restore()
        raise
    role, run = s.role, s.run                   # this rank's part (driver or not), counters
    try:
        if run.state.step == 0 and cfg.trainer.sft_warmup_steps > 0 and not run.resumed:
            sft = cfg.trainer                   # say what it does before it does it
            role.say(f"[warm start] {sft.sft_warmup_steps} supervised steps x {sft.sft_batch_size} reference answers "
                     f"at lr {sft.sft_lr:g} on {cfg.model.name} before RL step 1 (trainer.sft_warmup_steps=0: none)")
            s.warm_start()                      # supervised warm start (the tiny model's group)
            if cfg.trainer.total_steps == 0:    # a warm start only (`dapo-mega ablate`'s shared start)
                s.save_checkpoint(0)
        s.sync_weights()                        # engines serve the learner's weights at v
        freeze_startup_objects()                # no full GC pass walks start-up's objects (heap.py)
        beside = eval_beside(cfg)               # eval.overlap: the evaluation runs beside the next step
        deferred: Optional[DeferredRow] = None  # the eval step's row, written once its evaluation ends
        if run.state.step == 0 and cfg.trainer.eval_interval > 0:  # held-out accuracy before any RL step
            if beside:
                role.begin_eval()
                deferred = (0, {}, {})
            else:
                role.log_step(0, role.evaluate(), {})
        role.start_rollouts(run.state.step + 1)  # a thread, when disaggregated with staleness > 0
        for step in range(run.state.step + 1, cfg.trainer.total_steps + 1):
            meter = PhaseMeter()                # seconds and peak memory of each phase (records/resources.py)
            with meter.phase("rollout"):
                batch = role.next_rollout_batch(step, run.state.policy_version)  # generate, reward, filter
                samples = role.train_samples(batch)  # advantages; every learner rank gets the list
                experts = role.routed_experts(samples, step)  # a mixture: each DP rank its share, on the host
            with meter.phase("train"):
                with s.policy_sync.engines_released():  # colocated: engines free memory meanwhile
                    train_metrics = s.learner.train_step(samples, step=step, experts=experts)  # step seeds the shuffle
            s.probe.after_step(train_metrics, step)  # the engines' log-probs of their samples vs the learner's
            if deferred is not None:
                with meter.phase("eval"):       # the evaluation beside this step ends before the weights change
                    _write_deferred(role, deferred, wait=True)
                deferred = None
            with meter.phase("sync"):
                run.state.policy_version += 1
                sync_metrics = s.sync_weights(step, {**batch.metrics, **train_metrics})  # engines serve it now

            run.state.step = step
            role.write_ledger(step, batch)      # one row per sample, kept or rejected
            eval_metrics: Dict[str, float] = {}
            evaluating_beside = beside and run.should_eval(step) and step < cfg.trainer.total_steps
            if evaluating_beside:
                role.begin_eval()               # against the engines that now serve version `step`
            elif run.should_eval(step):
                with meter.phase("eval"):
                    eval_metrics = role.evaluate()
            run.clock.record_step(sum(meter.timings().values()))
            # a stop signal (the driver's) or the wall-time limit: save this step and stop
            stop = role.stop_reason(run.clock, signals.received) if step < cfg.trainer.total_steps else ""
            row = {**batch.metrics, **train_metrics, **sync_metrics, **eval_metrics}
            if run.should_save(step) or stop:
                with meter.phase("save"):       # the row so far goes in: a resume writes it if this run cannot
                    s.save_checkpoint(step, row={**row, **meter.metrics})
                run.clock.record_save(meter.metrics["time/save_s"])
            if run.should_export_hf(step):      # <run_dir>/hf/step_<N>/ (trainer.hf_export_interval)
                with meter.phase("hf_export"):
                    row.update(s.export_hf(step))
            if evaluating_beside:
                deferred = (step, row, meter.metrics)
            else:
                role.log_step(step, row, meter.metrics)
            if stop and deferred is not None:   # a stopping run does not wait for the evaluation
                _write_deferred(role, deferred, wait=False)
                deferred = None
            if stop and stop != WALL_TIME:
                signals.begin_close()           # saved: SIGTERM (srun's, once a rank exits 75) is ignored
                role.broadcast()                # ... on every rank before any rank leaves
                role.say(stop_message(stop, step, cfg.trainer.total_steps))
                return EXIT_STOPPED
            if stop:
                role.say(f"[trainer] stopped after step {step} of {cfg.trainer.total_steps} to end within "
                         f"trainer.wall_time_minutes={cfg.trainer.wall_time_minutes:g} (running "
                         f"{run.clock.elapsed_s() / 60:.1f} min; a step takes up to {run.clock.longest_step_s:.0f} s, "
                         f"a save {run.clock.last_save_s:.0f} s); checkpoint step {step} saved, run again to resume")
                break
        if deferred is not None:                # step 0's, of a run with no step left to take
            _write_deferred(role, deferred, wait=True)
        return 0
    finally:
        s.close()
        signals.restore()                       # (a no-op after begin_close: SIGTERM stays ignored)


DeferredRow = Tuple[int, Dict[str, float], Dict[str, float]]
"""(step, metrics, timings) of an eval step whose evaluation runs beside the next step."""


def _write_deferred(role, deferred: DeferredRow, wait: bool) -> None:
    """The eval step's row with its evaluation's figures (`role.finish_eval`; a hand-over)."""
    step, row, timings = deferred
    role.log_step(step, {**row, **role.finish_eval(wait)}, timings)


def run_training(cfg: DapoConfig) -> int:
    """`dapo-mega train`: spawn learner ranks when asked for several, else run here."""
    from dapo_mega.driver.learner_ranks import maybe_spawn_learners

    check_warm_start(cfg)                       # a warm start on a pretrained model is asked for by name
    code = maybe_spawn_learners(cfg)
    if code is not None:
        return code
    return train(cfg)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description="one learner rank of `dapo-mega train`")
    parser.add_argument("--config", required=True, help="a resolved config.yaml (written by the parent)")
    args = parser.parse_args(argv)
    with open(args.config) as f:
        cfg = from_yaml(f.read())
    return train(cfg)


if __name__ == "__main__":
    sys.exit(main())
