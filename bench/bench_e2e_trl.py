"""End to end: time to a target held-out accuracy, `dapo-mega train` vs TRL `GRPOTrainer` (DAPO).

Both trainers start from the same warm-start weights, train on the same synthetic
arithmetic problems (same order) with the same DAPO hyperparameters, and are evaluated by
the same code on the same held-out problems; the figure is the training time until the
held-out avg@k first reaches the target.

    python bench/bench_e2e_trl.py [--quick]                 all phases, prints the result
    python bench/bench_e2e_trl.py warmstart --work DIR      phase 1 only (used by the above)

Phases (each a subprocess, so that Megatron's process groups, TRL/accelerate and the engine
processes never share an interpreter):

1. warm start: `Session.start` + `Session.warm_start` (the supervised phase of
   `dapo-mega train`, `trainer.sft_warmup_steps` steps), exported with
   `export_learner_to_hf` to `WORK/warm_hf`; its held-out avg@k (the trainer's own
   `DriverRole.evaluate`) sets the target = warm-start avg@k + `delta`.
2. ours: `dapo-mega train model.hf_path=WORK/warm_hf trainer.sft_warmup_steps=0 ...`; its
   `metrics.jsonl` is followed while it runs and the process group is stopped once an
   eval row reaches the target (or the step budget ends).
3. TRL: `GRPOTrainer(loss_type="dapo", beta=0, epsilon=ε_low, epsilon_high=ε_high, same G,
   max_completion_length, learning rate + warm-up, temperature, top-p, grad clip)` on the
   HF model loaded with `from_pretrained(WORK/warm_hf)`. Rewards come from
   `dapo_mega.reward.compute_rewards` (the DAPO verifier on answer_prefix + response, plus
   the same soft overlong penalty). One TRL "rollout step" = train_batch_size prompts x G samples (32 x 8 here)
   generated, `train_batch_size / mini_batch_size` optimizer updates, as in ours.

Held-out evaluation, identical for both: `dapo_mega.evaluate.evaluate_problems` (k samples
per problem at eval.temperature / eval.top_p through an embedded engine, DAPO verifier,
the training length limit) on the first `eval.max_problems` held-out problems, every
`trainer.eval_interval` rollout steps. For TRL the engine gets the HF model's weights by
`WeightSyncer` (shared memory) before each evaluation.

Timing: the training loop's wall-clock from the first step, excluding held-out evaluation
and checkpoint saving (start-up of both trainers is reported separately as total seconds).

What differs by construction (documented, not tuned away): TRL has no dynamic sampling
(uniform-reward groups stay in the batch with zero advantage) and no dual clip; ours
generates with the embedded engine, TRL with `transformers.generate`. TRL is installed for
this benchmark only (`pip install trl -c constraints-cpu.txt`); when it is missing or fails
the benchmark says so and reports no ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results" / "e2e_trl.json"
"""The last full-size run; --quick writes e2e_trl_quick.json (bench/run.py --quick: latest.json too)."""

# Shared by every phase. The default config's model, task and batch shapes; a larger
# learning rate than the default so that the held-out accuracy moves within the budget on a
# CPU, the same for both trainers.
COMMON_OVERRIDES = [
    "trainer.wandb_mode=disabled", "trainer.plot=false", "megatron.use_distributed_optimizer=false",
    "eval.temperature=1.0", "eval.top_p=1.0",
]
# The warm start is the default config's (1200 supervised steps, held-out avg@4 ~0.19): a
# weaker one leaves too few informative groups for either trainer to move in a few steps.
QUICK = {"overrides": ["trainer.sft_warmup_steps=1200", "algo.lr=5e-4", "eval.n_samples=4", "eval.max_problems=100"],
         "max_steps": 10, "eval_interval": 2, "delta": 0.05, "seeds": (1,)}
FULL = {"overrides": ["trainer.sft_warmup_steps=1200", "algo.lr=5e-4", "eval.n_samples=8", "eval.max_problems=200"],
        "max_steps": 40, "eval_interval": 4, "delta": 0.10, "seeds": (1, 2, 3)}
ROLLOUT_OVERRIDES = ["rollout.prompts_per_request=16", "rollout.requests_per_engine=2"]
"""dapo-mega's RL runs only (not the warm start, whose cache key they would change): two
requests of 16 prompts in flight (16 x 2 x G=8 = the embedded engine's 256 rows) instead of
the default 8 of 4. On 2 CPU cores a rollout step took 73-75 ms against 80-82 ms (fewer
round trips and replies to parse); the default streams finer because with small batches
(a 4-prompt step) a 16-prompt request generates groups no step needs. bench/README.md."""
# Seeds (trainer.seed: sampling and TRL's shuffle/initial RNG; the prompt order and the warm
# start are the same for all): the held-out avg@k moves by ~0.02 between evaluations, so
# the step at which one run first crosses the target is largely chance (one run of ours
# crossed at step 28, another at 32 after a change of rounding only). The ratio is taken
# over the sum of the seeds' times to target.


WARM_START_CACHE = REPO / "outputs" / "bench_warm_start"
"""Warm starts are produced once per set of overrides and reused (outputs/ is not in git)."""


def sizes_for(quick: bool) -> Dict[str, Any]:
    return QUICK if quick else FULL


# ============================================================================ pure helpers
def time_to_target(curve: Sequence[Dict[str, float]], target: float) -> Optional[Dict[str, float]]:
    """First point of an eval curve [{step, train_s, avg_at_k}, ...] (in step order) whose
    avg_at_k >= target; None when the curve never gets there."""
    for point in curve:
        if point["avg_at_k"] >= target:
            return point
    return None


def dapo_mega_eval_curve(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, float]]:
    """Eval points of a `metrics.jsonl` with the training time up to each.

    train_s(k) = unix(k) - unix(0) - sum_{j=1..k} (eval_s(j) + save_s(j)): the step-0 row is
    logged after the initial evaluation, and row k after step k's evaluation and save, so
    this is the loop's wall-clock without held-out evaluation and checkpoint saving.
    """
    rows = sorted(rows, key=lambda r: r["step"])
    if not rows or rows[0]["step"] != 0:
        return []
    start = rows[0]["time/unix"]
    excluded = 0.0
    parts = {"rollout_s": 0.0, "learner_s": 0.0, "sync_s": 0.0}
    curve = []
    for r in rows:
        if r["step"] > 0:
            excluded += r.get("time/eval_s", 0.0) + r.get("time/save_s", 0.0)
            parts["rollout_s"] += r.get("time/rollout_s", 0.0)
            parts["learner_s"] += r.get("time/train_s", 0.0)
            parts["sync_s"] += r.get("time/sync_s", 0.0)
        if "eval/avg_at_k" in r:
            train_s = r["time/unix"] - start - excluded
            curve.append({"step": r["step"], "train_s": train_s, "avg_at_k": r["eval/avg_at_k"],
                          "split": {**{k: round(v, 4) for k, v in parts.items()},
                                    "other_s": round(train_s - sum(parts.values()), 4)}})
    return curve


def summarize(ours_curve, trl_curve, target: float) -> Dict[str, Any]:
    """Both times to the target and ratio = TRL / ours (> 1: ours is faster)."""
    ours, trl = time_to_target(ours_curve, target), time_to_target(trl_curve, target)
    out: Dict[str, Any] = {"target_avg_at_k": target, "ours_reached": ours, "trl_reached": trl,
                           "ours_best": max((p["avg_at_k"] for p in ours_curve), default=None),
                           "trl_best": max((p["avg_at_k"] for p in trl_curve), default=None)}
    # The ratio is (TRL's seconds per rollout step x its steps) / (ours x ours): the two
    # factors apart, the first a property of the implementations, the second of the algorithms
    # (dynamic sampling, dual clip) and of the held-out evaluation's noise.
    for name, curve in (("ours", ours_curve), ("trl", trl_curve)):
        last = curve[-1] if curve else None
        if last is not None and last["step"] > 0:
            out[f"{name}_seconds_per_step"] = last["train_s"] / last["step"]
            out[f"{name}_budget_s"] = last["train_s"]  # to its last evaluation
    if "ours_seconds_per_step" in out and "trl_seconds_per_step" in out:
        out["per_step_ratio"] = out["trl_seconds_per_step"] / max(out["ours_seconds_per_step"], 1e-9)
    if ours is not None and trl is not None:
        out["ratio"] = trl["train_s"] / max(ours["train_s"], 1e-9)
        out["steps_to_target"] = {"ours": ours["step"], "trl": trl["step"]}
    return out


def combine_seeds(per_seed: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The seeds' `summarize` outputs as one result: ratio = sum of TRL's times to target /
    sum of ours over the seeds where both reached it; per-step ratio from the summed seconds
    per step; `unreached` lists the seeds where either did not reach it (left out)."""
    both = [r for r in per_seed if r.get("ours_reached") and r.get("trl_reached")]
    out: Dict[str, Any] = {"seeds_reached_by_both": len(both), "seeds_run": len(per_seed),
                           "unreached": [r["seed"] for r in per_seed if r not in both]}
    if both:
        ours = sum(r["ours_reached"]["train_s"] for r in both)
        trl = sum(r["trl_reached"]["train_s"] for r in both)
        out.update(ours=ours / len(both), baseline=trl / len(both), ratio=trl / max(ours, 1e-9),
                   steps_to_target={"ours": [r["ours_reached"]["step"] for r in both],
                                    "trl": [r["trl_reached"]["step"] for r in both]})
    # A bound beside it: a run that never reached the target counted at its whole budget
    # (its true time is longer), over the seeds where at least one trainer reached it.
    either = [r for r in per_seed if r.get("ours_reached") or r.get("trl_reached")]
    if either:
        def spent(r: Dict[str, Any], who: str) -> float:
            reached = r.get(f"{who}_reached")
            return reached["train_s"] if reached else r.get(f"{who}_budget_s", float("nan"))
        out["ratio_unreached_at_budget"] = (sum(spent(r, "trl") for r in either)
                                            / max(sum(spent(r, "ours") for r in either), 1e-9))
    timed = [r for r in per_seed if "ours_seconds_per_step" in r and "trl_seconds_per_step" in r]
    if timed:
        ours_s = sum(r["ours_seconds_per_step"] for r in timed) / len(timed)
        trl_s = sum(r["trl_seconds_per_step"] for r in timed) / len(timed)
        out.update(ours_seconds_per_step=ours_s, trl_seconds_per_step=trl_s, per_step_ratio=trl_s / max(ours_s, 1e-9))
    return out


def _read_jsonl(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written while we read
            break
    return rows


def _load_cfg(overrides: Sequence[str]):
    from dapo_mega.config import load_config

    return load_config(list(overrides))


# ============================================================================ phase 1: warm start
def phase_warmstart(work: Path, overrides: Sequence[str]) -> Dict[str, Any]:
    """SFT warm start with dapo-mega's own Session, exported to WORK/warm_hf, evaluated."""
    from dapo_mega.session import Session
    from dapo_mega.weights.convert import export_learner_to_hf, read_hf_config_dict

    cfg = _load_cfg(list(overrides) + [f"trainer.output_dir={work}", "trainer.run_name=warmstart",
                                       "trainer.total_steps=0"])
    t0 = time.perf_counter()
    s = Session.start(cfg)
    try:
        t1 = time.perf_counter()
        s.warm_start()
        sft_s = time.perf_counter() - t1
        out = work / "warm_hf"
        export_learner_to_hf(s.learner.model_chunks, s.learner.info, s.layout, out,
                             hf_config=read_hf_config_dict(s.model_dir), hf_side_dir=s.model_dir)
        s.sync_weights()
        metrics = s.role.evaluate()
    finally:
        s.close()
    result = {"hf_dir": str(out), "sft_steps": cfg.trainer.sft_warmup_steps, "sft_seconds": sft_s,
              "total_seconds": time.perf_counter() - t0, "avg_at_k": metrics["eval/avg_at_k"]}
    (work / "warmstart.json").write_text(json.dumps(result, indent=2))
    return result


def warm_start_key(overrides: Sequence[str]) -> str:
    """Cache key of a warm start: a hash of the overrides that produce it (eval.* settings
    only change how its accuracy is measured, not the weights)."""
    import hashlib

    kept = sorted(o for o in overrides if not o.startswith("eval."))
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:12]


def ensure_warm_start(overrides: Sequence[str], quick: bool) -> Dict[str, Any]:
    """The warm start for `overrides` (produced by `phase_warmstart` in a subprocess once,
    then read from WARM_START_CACHE/<key>/warmstart.json)."""
    work = WARM_START_CACHE / warm_start_key(overrides)
    done = work / "warmstart.json"
    if not done.exists():
        work.mkdir(parents=True, exist_ok=True)
        _phase(["warmstart", "--work", str(work), "--", *overrides], work, "warmstart", 3600)
    result = json.loads(done.read_text())
    result["cached_in"] = str(work)
    return result


# ============================================================================ phase 2: dapo-mega
def _kill_group(proc: subprocess.Popen) -> None:
    """Stop a phase we started (its own session: the trainer and its engine processes)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=20)


def run_dapo_mega(work: Path, hf_dir: str, overrides: Sequence[str], max_steps: int, eval_interval: int,
                  target: float, timeout_s: float) -> Dict[str, Any]:
    """`dapo-mega train` from the warm start, stopped once an eval reaches the target."""
    run_dir = work / "dapo_mega"
    argv = [sys.executable, "-m", "dapo_mega.cli", "train", *overrides, f"model.hf_path={hf_dir}",
            "trainer.sft_warmup_steps=0", f"trainer.total_steps={max_steps}",
            f"trainer.eval_interval={eval_interval}", f"trainer.save_interval={max_steps}",
            f"trainer.output_dir={work}", "trainer.run_name=dapo_mega", "trainer.resume=false"]
    log = open(work / "dapo_mega.log", "wb")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    stopped_at_target = False
    try:
        while proc.poll() is None:
            if time.perf_counter() - t0 > timeout_s:
                break
            curve = dapo_mega_eval_curve(_read_jsonl(run_dir / "metrics.jsonl"))
            if time_to_target(curve[1:], target) is not None:
                stopped_at_target = True
                break
            time.sleep(0.5)
    finally:
        _kill_group(proc)
        log.close()
    curve = dapo_mega_eval_curve(_read_jsonl(run_dir / "metrics.jsonl"))
    if not curve:
        tail = (work / "dapo_mega.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"dapo-mega train produced no eval rows (exit {proc.returncode}):\n{tail}")
    return {"curve": curve, "total_seconds": time.perf_counter() - t0, "stopped_at_target": stopped_at_target,
            "exit_code": proc.returncode}


# ============================================================================ phase 3: TRL
def phase_trl(work: Path, hf_dir: str, overrides: Sequence[str], max_steps: int, eval_interval: int,
              target: float) -> Dict[str, Any]:
    """TRL GRPOTrainer with loss_type="dapo" from the same weights; see the module docstring."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dapo_mega.data import PromptIterator, build_datasets, format_prompt, verification_prefix
    from dapo_mega.engines.fleet import EngineFleet
    from dapo_mega.evaluate import evaluate_problems
    from dapo_mega.reward import build_verifier, compute_rewards
    from dapo_mega.weights.sync import WeightSyncer

    cfg = _load_cfg(overrides)
    a, template = cfg.algo, cfg.data.prompt_template
    updates_per_step = a.train_batch_size // a.mini_batch_size
    train, held_out, revision = build_datasets(cfg.data)
    held_out = held_out[:cfg.eval.max_problems] if cfg.eval.max_problems else held_out
    # the prompts in dapo-mega's order (same iterator, seed and shuffle)
    ordered = PromptIterator(train, seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                             revision=revision).next_batch(max_steps * a.train_batch_size)
    dataset = Dataset.from_list([{"prompt": format_prompt(p, template), "ground_truth": p.ground_truth,
                                  "answer_prefix": verification_prefix(p, template)} for p in ordered])
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    verifier = build_verifier(a.verifier)

    def prompt_ids(p) -> List[int]:
        return list(tokenizer(format_prompt(p, template), add_special_tokens=False).input_ids)

    # TRL tokenizes plain-text prompts with the tokenizer's defaults: make sure the model
    # sees the same ids as dapo-mega's engines do.
    trl_ids = list(tokenizer(text=[format_prompt(ordered[0], template)])["input_ids"][0])
    if trl_ids != prompt_ids(ordered[0]):
        raise RuntimeError(f"TRL would tokenize prompts differently: {trl_ids} vs {prompt_ids(ordered[0])}")

    def dapo_reward(prompts, completions, completion_ids, ground_truth, answer_prefix, **_):
        batch = compute_rewards(verifier, completions, ground_truth, [len(c) for c in completion_ids], a,
                                answer_prefixes=answer_prefix)
        return batch.reward.tolist()

    fleet = EngineFleet(cfg.rollout, str(hf_dir), work / "trl_engine_logs", num_threads=max(1, os.cpu_count() or 2))
    engine = fleet.start_on_this_node("bench_e2e_trl", 1)[0]
    syncer = WeightSyncer([engine], mode="colocated", bucket_mb=cfg.rollout.weight_sync_bucket_mb)
    curve: List[Dict[str, float]] = []

    class HeldOutEval(TrainerCallback):
        """Every eval_interval rollout steps: pause the clock, sync weights, evaluate."""

        def __init__(self):
            self.start = self.excluded = 0.0

        def evaluate(self, model_, step: int) -> float:
            t = time.perf_counter()
            state = {k: v.detach() for k, v in model_.state_dict().items()}
            syncer.sync(iter(state.items()), weight_version=str(step))
            result = evaluate_problems([engine], held_out, cfg, SimpleNamespace(encode=prompt_ids), verifier)
            train_s = t - self.start - self.excluded
            split = {"generate_score_s": round(generation_s[0], 4),
                     "learner_s": round(max(train_s, 0.0) - generation_s[0], 4)}
            curve.append({"step": step, "train_s": max(train_s, 0.0), "avg_at_k": result.avg_at_k, "split": split})
            print(f"[trl] step {step}: avg@{result.k} = {result.avg_at_k:.4f} after {train_s:.1f} s", flush=True)
            self.excluded += time.perf_counter() - t
            return result.avg_at_k

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.start = time.perf_counter()
            self.evaluate(model, 0)
            self.start, self.excluded = time.perf_counter(), 0.0
            generation_s[0] = 0.0

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % (eval_interval * updates_per_step) == 0:
                step = state.global_step // updates_per_step
                if self.evaluate(model, step) >= target and step > 0:
                    control.should_training_stop = True
            return control

    args = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=a.mini_batch_size * a.n_samples_per_prompt,
        gradient_accumulation_steps=1, steps_per_generation=updates_per_step, num_generations=a.n_samples_per_prompt,
        max_completion_length=a.max_response_length, temperature=a.temperature, top_p=a.top_p,
        top_k=max(a.top_k, 0), learning_rate=a.lr, lr_scheduler_type="constant_with_warmup",
        warmup_steps=a.lr_warmup_steps * updates_per_step, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2, max_grad_norm=a.grad_clip, beta=0.0, epsilon=a.clip_ratio_low,
        epsilon_high=a.clip_ratio_high, loss_type="dapo", scale_rewards="group" if a.normalize_adv_std else "none",
        num_iterations=1, mask_truncated_completions=a.overlong_filter,
        max_steps=max_steps * updates_per_step, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, seed=cfg.trainer.seed, shuffle_dataset=False, disable_tqdm=True)
    callback = HeldOutEval()
    trainer = GRPOTrainer(model=model, reward_funcs=dapo_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[callback])
    # Where TRL's step time goes: `_generate_and_score_completions` (generation, rewards,
    # old log-probs) against the rest (the updates), as ours splits rollout / learner / sync.
    generation_s = [0.0]
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*a, **kw):
        t = time.perf_counter()
        try:
            return generate_and_score(*a, **kw)
        finally:
            generation_s[0] += time.perf_counter() - t

    trainer._generate_and_score_completions = timed_generate_and_score
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        syncer.close()
        fleet.close()
    result = {"curve": curve, "trl_train_seconds": time.perf_counter() - t0,
              "updates_per_rollout_step": updates_per_step,
              "config": {"loss_type": args.loss_type, "beta": args.beta, "epsilon": args.epsilon,
                         "epsilon_high": args.epsilon_high, "num_generations": args.num_generations,
                         "max_completion_length": args.max_completion_length, "learning_rate": args.learning_rate,
                         "temperature": args.temperature, "per_device_train_batch_size": args.per_device_train_batch_size,
                         "steps_per_generation": args.steps_per_generation}}
    (work / "trl_result.json").write_text(json.dumps(result, indent=2))
    return result


# ============================================================================ orchestration
def trl_version() -> Optional[str]:
    """TRL's version, or None when it is not installed (it is not a dependency)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trl")
    except PackageNotFoundError:
        return None


def _phase(argv: List[str], work: Path, name: str, timeout_s: float) -> None:
    """Run one phase of this file in a fresh interpreter (own session, killed on timeout)."""
    log = open(work / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv], stdout=log,
                            stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _kill_group(proc)
        log.close()
    if proc.returncode != 0:
        tail = (work / f"{name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"phase {name} failed (exit {proc.returncode}):\n{tail}")


def run(quick: bool = False, keep_work: bool = False) -> Dict[str, Any]:
    sizes = QUICK if quick else FULL
    overrides = COMMON_OVERRIDES + sizes["overrides"]
    base = {"name": "e2e_trl", "metric": "seconds to target held-out avg@k", "baseline_name": "TRL GRPOTrainer (dapo)",
            "higher_is_better": False, "quick": quick, "overrides": overrides, "max_steps": sizes["max_steps"],
            "eval_interval": sizes["eval_interval"], "seeds": list(sizes["seeds"]),
            "ours_rollout_overrides": ROLLOUT_OVERRIDES}
    version = trl_version()
    if version is None:
        return {**base, "status": "skipped", "reason": "trl is not installed (pip install trl -c constraints-cpu.txt)",
                "ours": float("nan"), "baseline": float("nan"), "ratio": float("nan")}
    t0 = time.perf_counter()
    warm = ensure_warm_start(overrides, quick)
    target = round(warm["avg_at_k"] + sizes["delta"], 4)
    per_seed = []
    for seed in sizes["seeds"]:
        work = Path(tempfile.mkdtemp(prefix=f"dapo_bench_e2e_s{seed}_"))
        seeded = overrides + [f"trainer.seed={seed}"]
        try:
            ours = run_dapo_mega(work, warm["hf_dir"], seeded + ROLLOUT_OVERRIDES, sizes["max_steps"],
                                 sizes["eval_interval"], target, timeout_s=3600)
            _phase(["trl", "--work", str(work), "--hf", warm["hf_dir"], "--max-steps", str(sizes["max_steps"]),
                    "--eval-interval", str(sizes["eval_interval"]), "--target", str(target), "--", *seeded],
                   work, "trl", 3600)
            trl = json.loads((work / "trl_result.json").read_text())
        finally:
            if not keep_work:
                shutil.rmtree(work, ignore_errors=True)
            else:
                print(f"work directory kept: {work}")
        per_seed.append({"seed": seed, **summarize(ours["curve"], trl["curve"], target),
                         "ours_curve": ours["curve"], "trl_curve": trl["curve"], "trl_config": trl["config"],
                         "ours_total_seconds": ours["total_seconds"], "trl_total_seconds": trl["trl_train_seconds"]})
    combined = combine_seeds(per_seed)
    result = {**base, "trl_version": version, "warm_start": warm, "delta": sizes["delta"], "target_avg_at_k": target,
              **combined, "per_seed": per_seed, "bench_seconds": time.perf_counter() - t0}
    for key in ("ours", "baseline", "ratio"):
        result.setdefault(key, float("nan"))
    if "per_step_ratio" in combined:
        result["rows"] = [{"name": "e2e_trl (per step)", "metric": "seconds per rollout step",
                           "ours": combined["ours_seconds_per_step"], "baseline_name": "TRL GRPOTrainer (dapo)",
                           "baseline": combined["trl_seconds_per_step"], "ratio": combined["per_step_ratio"],
                           "higher_is_better": False}]
    if combined["unreached"]:
        result["note"] = (f"seeds {combined['unreached']}: dapo-mega or TRL did not reach avg@k {target} within "
                          f"{sizes['max_steps']} rollout steps; left out of the ratio")
    path = RESULTS.with_name("e2e_trl_quick.json") if quick else RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return result


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: List[str] = []
    if "--" in argv:
        overrides, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("phase", nargs="?", default="all", choices=["all", "warmstart", "trl"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep-work", action="store_true", help="keep the temporary run directories")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--hf")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--eval-interval", type=int)
    parser.add_argument("--target", type=float)
    args = parser.parse_args(argv)
    if args.phase == "warmstart":
        print(json.dumps(phase_warmstart(args.work, overrides), indent=2))
    elif args.phase == "trl":
        phase_trl(args.work, args.hf, overrides, args.max_steps, args.eval_interval, args.target)
    else:
        print(json.dumps(run(args.quick, args.keep_work), indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
