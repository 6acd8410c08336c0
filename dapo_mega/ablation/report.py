"""The ablation's results: `ablation.md`, `ablation.json` and `ablation.png`, from the runs'
`metrics.jsonl` files alone (so a table can be rebuilt at any time, also from Slurm runs).

Per run (`summarize_run`), from the rows of RL steps (step >= 1):

    final_avg_at_k      eval/avg_at_k of the last evaluated step (the run's end)
    best_avg_at_k       the highest eval/avg_at_k of any RL step
    steps_to_target     first step whose eval/avg_at_k >= ablation.target (None: never)
    final_by_set        per named eval set (eval.sets): eval/<name>/avg_at_k of the last
                        evaluated step, a column `final avg@k (<name>)` of the table
    samples_per_trained Σ rollout/num_samples / Σ rollout/kept_samples (dynamic sampling
                        generates more than it trains on)
    response_length     mean of rollout/response_length_mean
    entropy_end         rollout/entropy_mc over the last 20% of steps (at least one): the
                        rollout policy's per-token entropy estimate, −mean log p(token)
    clip_frac_low/high  mean of loss/clip_frac_low / loss/clip_frac_high
    truncated_frac      mean of rollout/clip_rate (responses cut at max_response_length)
    router_agreement    a mixture of experts: mean of moe/router_agreement (the learner's own
                        router choosing the engines' experts); columns only when a run has it
    logp_mismatch       mean of mismatch/logp_abs_mean (|engine - learner| log-prob per token)

Per rung: each as mean ± the t-interval over seeds (`stats.mean_interval`), and the
difference of final avg@k to the rung it is compared with (ladder: the previous rung;
sweep: the first) as Welch's interval, marked `*` when it excludes zero. Only finished
runs count; the table says how many seeds each row has.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from dapo_mega.ablation.rungs import AblationPlan, PlannedRun
from dapo_mega.ablation.stats import Difference, Interval, mean_interval, welch_interval
from dapo_mega.run_files.checkpoints import atomic_path, write_text_atomic

if TYPE_CHECKING:
    from dapo_mega.records.metrics import Row

EVAL_KEY = "eval/avg_at_k"
ENTROPY_KEY = "rollout/entropy_mc"
SUMMARY_FIELDS = ("final_avg_at_k", "best_avg_at_k", "steps_to_target", "samples_per_trained", "response_length",
                  "entropy_end", "clip_frac_low", "clip_frac_high", "truncated_frac", "rollouts_per_step",
                  "length_limit", "peak_memory_gib", "router_agreement", "logp_mismatch")
MOE_COLUMNS = (("router_agreement", "router agreement", 4), ("logp_mismatch", "log-prob mismatch", 5))
"""Columns of a mixture's runs (summary field, header, digits): shown when any run has them."""
CURVES = (  # (metric key, panel title) of ablation.png
    (EVAL_KEY, "held-out avg@k"),
    ("rollout/accuracy", "rollout accuracy"),
    ("rollout/response_length_mean", "mean response length (tokens)"),
    (ENTROPY_KEY, "rollout entropy (−mean log p, nats/token)"),
)


@dataclass
class RunSummary:
    """The numbers of one finished run (None: the run has no such metric)."""

    seed: int
    run_dir: str
    final_avg_at_k: Optional[float] = None
    best_avg_at_k: Optional[float] = None
    steps_to_target: Optional[int] = None
    samples_per_trained: Optional[float] = None
    response_length: Optional[float] = None
    entropy_end: Optional[float] = None
    clip_frac_low: Optional[float] = None
    clip_frac_high: Optional[float] = None
    truncated_frac: Optional[float] = None
    rollouts_per_step: Optional[float] = None
    """The resource envelope beside the comparison: responses generated per step, ..."""
    length_limit: Optional[float] = None
    """... the response length limit (algo.max_response_length, from the run's config.yaml), ..."""
    peak_memory_gib: Optional[float] = None
    """... and the driver's peak memory over the run's phases (CUDA reserved on a GPU, else RSS)."""
    router_agreement: Optional[float] = None
    logp_mismatch: Optional[float] = None
    curves: Dict[str, List[Tuple[int, float]]] = field(default_factory=dict)
    final_by_set: Dict[str, float] = field(default_factory=dict)
    """Named eval set -> its eval/<name>/avg_at_k at the last step that evaluated it."""


@dataclass
class RungResult:
    """One row of the table."""

    name: str
    runs: List[RunSummary]
    missing_seeds: List[int]
    """Seeds planned for the rung whose run has not finished."""
    stats: Dict[str, Optional[Interval]] = field(default_factory=dict)
    reached_target: int = 0
    compared_with: Optional[str] = None
    final_diff: Optional[Difference] = None
    """Welch interval of final avg@k minus that of `compared_with`."""


def _mean(values: Sequence[float]) -> Optional[float]:
    xs = [v for v in values if v is not None and math.isfinite(v)]
    return sum(xs) / len(xs) if xs else None


def _series(rows: List[Row], key: str) -> List[Tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]


def summarize_run(rows: List[Row], seed: int, run_dir: str, target: Optional[float]) -> RunSummary:
    """A run's numbers from its metrics rows (see the module docstring)."""
    rl = [r for r in rows if int(r.get("step", 0)) >= 1]
    evals = _series(rl, EVAL_KEY)
    s = RunSummary(seed=seed, run_dir=run_dir)
    if evals:
        s.final_avg_at_k = max(evals)[1]  # the highest step's value
        s.best_avg_at_k = max(v for _, v in evals)
        if target is not None:
            s.steps_to_target = next((step for step, v in sorted(evals) if v >= target), None)
    generated = sum(float(r.get("rollout/num_samples") or 0.0) for r in rl)
    kept = sum(float(r.get("rollout/kept_samples") or 0.0) for r in rl)
    s.samples_per_trained = generated / kept if kept > 0 else None
    s.response_length = _mean([v for _, v in _series(rl, "rollout/response_length_mean")])
    entropy = [v for _, v in sorted(_series(rl, ENTROPY_KEY))]
    if entropy:
        s.entropy_end = _mean(entropy[-max(1, len(entropy) // 5):])
    s.clip_frac_low = _mean([v for _, v in _series(rl, "loss/clip_frac_low")])
    s.clip_frac_high = _mean([v for _, v in _series(rl, "loss/clip_frac_high")])
    s.truncated_frac = _mean([v for _, v in _series(rl, "rollout/clip_rate")])
    s.router_agreement = _mean([v for _, v in _series(rl, "moe/router_agreement")])
    s.logp_mismatch = _mean([v for _, v in _series(rl, "mismatch/logp_abs_mean")])
    s.rollouts_per_step = _mean([v for _, v in _series(rl, "rollout/num_samples")])
    s.peak_memory_gib = peak_memory_gib(rl)
    s.curves = {key: _series(rows, key) for key, _ in CURVES}
    from dapo_mega.records.metrics import named_eval_sets

    for name in named_eval_sets(rl):
        s.final_by_set[name] = max(_series(rl, f"eval/{name}/avg_at_k"))[1]  # the highest step's value
    config = Path(run_dir) / "config.yaml"
    if config.is_file():
        from dapo_mega.config import from_yaml

        s.length_limit = float(from_yaml(config.read_text()).algo.max_response_length)
    return s


def peak_memory_gib(rows: List[Row]) -> Optional[float]:
    """The largest per-phase peak in metrics rows: CUDA reserved where recorded, else RSS."""
    for suffix in ("cuda_reserved_peak_gib", "rss_peak_gib"):
        values = [float(v) for r in rows for k, v in r.items()
                  if k.startswith("mem/") and k.endswith(suffix) and isinstance(v, (int, float))]
        if values:
            return max(values)
    return None


def collect(plan: AblationPlan, is_done=None) -> List[RungResult]:
    """Every rung's finished runs, statistics and comparison (is_done(run) -> bool decides
    which runs count; default: latest checkpoint at the run's total_steps)."""
    from dapo_mega.ablation.runner import is_finished, total_steps_of
    from dapo_mega.records.metrics import read_metrics

    cfg = plan.config
    target, level = cfg.get("target"), float(cfg.get("level", 0.95))
    done = is_done or (lambda run: is_finished(run.run_dir, total_steps_of(run)))
    results: List[RungResult] = []
    for name in plan.rungs:
        runs: List[RunSummary] = []
        missing: List[int] = []
        for run in plan.runs_of(name):
            if done(run):
                runs.append(summarize_run(read_metrics(Path(run.run_dir)), run.seed, run.run_dir, target))
            else:
                missing.append(run.seed)
        results.append(rung_statistics(name, runs, missing, level))
    compare_rungs(results, str(cfg.get("mode", "ladder")), level)
    return results


def rung_statistics(name: str, runs: List[RunSummary], missing: List[int], level: float) -> RungResult:
    stats = {f: mean_interval([getattr(r, f) for r in runs if getattr(r, f) is not None], level)
             for f in SUMMARY_FIELDS}
    for set_name in eval_set_names([RungResult(name, runs, missing)]):
        stats[f"final_avg_at_k/{set_name}"] = mean_interval([r.final_by_set[set_name] for r in runs
                                                             if set_name in r.final_by_set], level)
    reached = sum(1 for r in runs if r.steps_to_target is not None)
    return RungResult(name=name, runs=runs, missing_seeds=missing, stats=stats, reached_target=reached)


def eval_set_names(results: List[RungResult]) -> List[str]:
    """The named eval sets any run of `results` evaluated, in first-seen order."""
    names: Dict[str, None] = {}
    for row in results:
        for run in row.runs:
            names.update(dict.fromkeys(run.final_by_set))
    return list(names)


def compare_rungs(results: List[RungResult], mode: str, level: float) -> None:
    """Ladder: each rung vs the previous one; sweep: each rung vs the first."""
    for i, row in enumerate(results[1:], start=1):
        ref = results[i - 1] if mode == "ladder" else results[0]
        row.compared_with = ref.name
        row.final_diff = welch_interval([r.final_avg_at_k for r in ref.runs if r.final_avg_at_k is not None],
                                        [r.final_avg_at_k for r in row.runs if r.final_avg_at_k is not None], level)


# --------------------------------------------------------------------------- rendering
def format_interval(iv: Optional[Interval], digits: int = 3) -> str:
    """"0.412 ± 0.031"; the mean alone for one seed; "–" without data."""
    if iv is None:
        return "–"
    if not math.isfinite(iv.half_width):
        return f"{iv.mean:.{digits}f}"
    return f"{iv.mean:.{digits}f} ± {iv.half_width:.{digits}f}"


def format_difference(d: Optional[Difference], digits: int = 3) -> str:
    """"+0.050 [+0.010, +0.090] *" (* = the interval excludes zero); "–" with < 2 seeds a side."""
    if d is None:
        return "–"
    mark = " *" if d.excludes_zero else ""
    return f"{d.diff:+.{digits}f} [{d.low:+.{digits}f}, {d.high:+.{digits}f}]{mark}"


def render_table(results: List[RungResult], mode: str, level: float, target: Optional[float]) -> str:
    """The markdown table (one row per rung) with a legend."""
    pct = f"{100 * level:g}%"
    vs = "previous rung" if mode == "ladder" else "first rung"
    target_col = f"steps to avg@k ≥ {target:g}" if target is not None else "steps to target"
    sets = eval_set_names(results)
    head = ["rung", "seeds", "final avg@k", "best avg@k", *(f"final avg@k ({n})" for n in sets),
            f"Δ final vs {vs} ({pct} Welch)", target_col,
            "generated / trained", "response length", "entropy (end)", "clip low", "clip high", "truncated",
            "rollouts / step", "length limit", "peak memory (GiB)"]
    moe = [c for c in MOE_COLUMNS if any(row.stats.get(c[0]) is not None for row in results)]
    head += [title for _, title, _ in moe]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results:
        n = len(row.runs)
        seeds = f"{n}" + (f" (missing {', '.join(map(str, row.missing_seeds))})" if row.missing_seeds else "")
        if target is None:
            steps = "–"
        else:
            steps = format_interval(row.stats.get("steps_to_target"), 1) + f" ({row.reached_target}/{n})"
        cells = [row.name, seeds, format_interval(row.stats.get("final_avg_at_k")),
                 format_interval(row.stats.get("best_avg_at_k")),
                 *(format_interval(row.stats.get(f"final_avg_at_k/{n}")) for n in sets),
                 format_difference(row.final_diff) if row.compared_with else "(reference)", steps,
                 format_interval(row.stats.get("samples_per_trained"), 2),
                 format_interval(row.stats.get("response_length"), 1),
                 format_interval(row.stats.get("entropy_end")),
                 format_interval(row.stats.get("clip_frac_low"), 4),
                 format_interval(row.stats.get("clip_frac_high"), 4),
                 format_interval(row.stats.get("truncated_frac")),
                 format_interval(row.stats.get("rollouts_per_step"), 0),
                 format_interval(row.stats.get("length_limit"), 0),
                 format_interval(row.stats.get("peak_memory_gib"), 2),
                 *(format_interval(row.stats.get(key), digits) for key, _, digits in moe)]
        lines.append("| " + " | ".join(cells) + " |")
    legend = (f"Mean ± {pct} t-interval over seeds (Student, n−1 degrees of freedom). Final avg@k (name): "
              "the named eval set's (eval.sets) avg@k at the run's last evaluation. Δ: difference of "
              f"final held-out avg@k to the {vs}, Welch's {pct} interval; `*` marks an interval that excludes "
              "zero. Steps to target: mean over the seeds that reached it (reached/finished), at the "
              "resolution of trainer.eval_interval. Entropy: "
              "−mean log p of the sampled tokens under the rollout policy over the last 20% of steps. "
              "Clip low/high: fraction of tokens clipped by 1−ε_low / 1+ε_high. Truncated: fraction of "
              "responses cut at max_response_length. The resource envelope: responses generated per step, "
              "the response length limit, and the driver's peak memory over the run's phases (GiB; CUDA "
              "reserved on a GPU, else resident set)."
              + (" Router agreement (a mixture of experts): the share of the engines' token-expert choices the "
                 "learner's own router makes too, mean over steps; log-prob mismatch: mean |engine − learner| "
                 "log-prob per sampled token." if moe else ""))
    return "\n".join(lines) + "\n\n" + legend + "\n"


def render_markdown(plan: AblationPlan, results: List[RungResult], elapsed_s: Optional[float] = None) -> str:
    cfg = plan.config
    mode, level, target = str(cfg.get("mode", "ladder")), float(cfg.get("level", 0.95)), cfg.get("target")
    title = f"# Ablation `{cfg.get('name')}`" + (" (quick)" if cfg.get("quick") else "")
    how = ("each rung adds its overrides to the previous rung's" if mode == "ladder"
           else "each rung changes the base alone")
    parts = [title, "", f"Mode: {mode} ({how}). Train overrides: `{' '.join(plan.train_overrides) or '(none)'}`.",
             f"Base: `{' '.join(cfg.get('base') or []) or '(none)'}`."]
    from dapo_mega.ablation.runner import total_run_seconds

    run_seconds = total_run_seconds(plan.directory)
    if run_seconds is not None:
        parts.append(f"Wall clock of the runs (local, warm start included, every invocation): {run_seconds / 60:.1f} min.")
    if elapsed_s is not None:
        parts.append(f"Wall clock of this invocation: {elapsed_s / 60:.1f} min.")
    parts += ["", render_table(results, mode, level, target), "Rungs:", ""]
    for rung in cfg.get("rungs", []):
        if rung["name"] in plan.rungs:
            parts.append(f"- `{rung['name']}`: `{' '.join(rung['overrides']) or '(base)'}`")
    return "\n".join(parts) + "\n"


def to_json(plan: AblationPlan, results: List[RungResult], elapsed_s: Optional[float] = None) -> Dict[str, object]:
    def interval(iv: Optional[Interval]) -> Optional[Dict[str, Optional[float]]]:
        return None if iv is None else {"mean": iv.mean, "half_width": _finite(iv.half_width), "n": iv.n,
                                        "std": _finite(iv.std)}

    rungs = []
    for row in results:
        runs = [{k: v for k, v in asdict(r).items() if k != "curves"} for r in row.runs]
        diff = None
        if row.final_diff is not None:
            diff = {"diff": row.final_diff.diff, "low": row.final_diff.low, "high": row.final_diff.high,
                    "df": _finite(row.final_diff.df), "excludes_zero": row.final_diff.excludes_zero}
        rungs.append({"name": row.name, "runs": runs, "missing_seeds": row.missing_seeds,
                      "stats": {k: interval(v) for k, v in row.stats.items()}, "reached_target": row.reached_target,
                      "compared_with": row.compared_with, "final_avg_at_k_difference": diff})
    from dapo_mega.ablation.runner import total_run_seconds

    return {"config": plan.config, "train_overrides": plan.train_overrides, "directory": plan.directory,
            "rungs": rungs, "elapsed_s": elapsed_s, "run_seconds": total_run_seconds(plan.directory),
            "written_unix": time.time()}


def _finite(x: float) -> Optional[float]:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def plot_ablation(results: List[RungResult], out: Path, level: float = 0.95) -> Optional[Path]:
    """Curves per rung (mean over seeds) with a band of the t-interval at each step."""
    if not any(row.runs for row in results):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes, CURVES):
        for i, row in enumerate(results):
            by_step: Dict[int, List[float]] = {}
            for run in row.runs:
                for step, value in run.curves.get(key, []):
                    by_step.setdefault(step, []).append(value)
            if not by_step:
                continue
            steps = sorted(by_step)
            ivs = [mean_interval(by_step[s], level) for s in steps]
            means = [iv.mean for iv in ivs]
            color = colors[i % len(colors)]
            ax.plot(steps, means, marker="o", markersize=3, color=color, label=f"{row.name} (n={len(row.runs)})")
            lo = [iv.low if math.isfinite(iv.half_width) else iv.mean for iv in ivs]
            hi = [iv.high if math.isfinite(iv.half_width) else iv.mean for iv in ivs]
            ax.fill_between(steps, lo, hi, color=color, alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    return out


def write_report(plan: AblationPlan, elapsed_s: Optional[float] = None, is_done=None) -> Tuple[Path, List[RungResult]]:
    """ablation.md, ablation.json and ablation.png in the ablation directory."""
    results = collect(plan, is_done)
    directory = Path(plan.directory)
    md = directory / "ablation.md"
    write_text_atomic(md, render_markdown(plan, results, elapsed_s))
    write_text_atomic(directory / "ablation.json", json.dumps(to_json(plan, results, elapsed_s), indent=1))
    plot_ablation(results, directory / "ablation.png", float(plan.config.get("level", 0.95)))
    return md, results


__all__ = ["RunSummary", "RungResult", "PlannedRun", "collect", "format_difference", "format_interval",
           "render_table", "summarize_run", "write_report"]
