"""Per-step records of a run: metrics.jsonl, the console line, wandb, and curves.png.

Each named eval set (`eval.sets`) adds `eval/<name> 0.123` to the console line after the
unnamed set's `eval` column, and its `eval/<name>/avg_at_k` line to the accuracy panel.

`RunRecorder` is used by the driver rank only (dapo_mega/driver/roles.py). On resume it
first cuts `metrics.jsonl` back to the checkpointed step, so a step that ran after the last
checkpoint and before a crash appears once, not twice.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

from dapo_mega import log
from dapo_mega.run_dir import atomic_path, write_text_atomic

logger = log.get(__name__)

CONSOLE_COLUMNS = (
    # (metric key, column format); a column whose metric the row lacks is left out
    ("rollout/reward_mean", "reward {:+.3f}"),
    ("rollout/accuracy", "acc {:.3f}"),
    ("rollout/kept_group_frac", "kept {:.2f}"),
    ("rollout/response_length_mean", "len {:6.1f}"),
    ("rollout/entropy_mc", "ent {:.3f}"),  # rollout policy entropy estimate, −mean log p (rollout/metrics.py)
    ("loss/pg", "loss {:+.4f}"),
    ("actor/grad_norm", "gnorm {:.3f}"),
)
TIME_COLUMNS = (("time/rollout_s", "gen {:5.1f}s"), ("time/train_s", "train {:5.1f}s"), ("time/sync_s", "sync {:4.1f}s"))
"""A training row prints every column (the fixed format in the README); the step-0 row, which
holds only the evaluation, prints the step, the version and the evaluation."""

PLOT_PANELS = [
    ("reward", ["rollout/reward_mean"]),
    ("accuracy", ["rollout/accuracy", "eval/avg_at_k"]),
    ("response length", ["rollout/response_length_mean", "rollout/response_length_p90"]),
    ("kept-group fraction", ["rollout/kept_group_frac"]),
    ("seconds per phase", ["time/rollout_s", "time/train_s", "time/sync_s", "time/eval_s"]),
    ("clip fraction", ["loss/clip_frac_low", "loss/clip_frac_high"]),
    ("entropy (nats/token)", ["rollout/entropy_mc", "actor/entropy"]),
    ("truncated fraction", ["rollout/clip_rate"]),
]


def named_eval_sets(rows: List[Dict[str, Any]]) -> List[str]:
    """The named eval sets whose `eval/<name>/avg_at_k` the rows hold, in first-seen order."""
    names: Dict[str, None] = {}
    for row in rows:
        for key in row:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "eval" and parts[2] == "avg_at_k":
                names.setdefault(parts[1], None)
    return list(names)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(run_dir: Path) -> List[Dict[str, Any]]:
    """All rows of `<run_dir>/metrics.jsonl` (a torn last line from a crash is ignored)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows: List[Dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(run_dir: Path, last_step: int) -> int:
    """Keep only rows with step <= last_step (atomically); returns how many were dropped."""
    rows = read_metrics(run_dir)
    kept = [r for r in rows if int(r.get("step", 0)) <= last_step]
    path = Path(run_dir) / "metrics.jsonl"
    if path.exists():
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(rows) - len(kept)


class RunRecorder:
    """metrics.jsonl + one console line per step + wandb (offline by default) + curves.png."""

    def __init__(self, run_dir: Path, run_name: str, config_dict: Dict[str, Any], resume_step: int,
                 wandb_mode: str = "offline", wandb_project: str = "dapo-mega",
                 wandb_run_id: Optional[str] = None, plot: bool = True, run_id: str = ""):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.plot = plot
        self.run_id = run_id
        """The run's unique id (`run_identity`), in every metrics row when set."""
        dropped = truncate_metrics(self.run_dir, resume_step)
        if dropped:
            logger.info(f"[records] resuming at step {resume_step}: dropped {dropped} metric rows of "
                        "steps that ran after the last checkpoint")
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._wandb = None
        self.wandb_run_id = wandb_run_id
        if wandb_mode != "disabled":
            self._wandb = self._start_wandb(run_name, config_dict, wandb_mode, wandb_project, wandb_run_id)

    def _start_wandb(self, run_name, config_dict, mode, project, run_id):
        try:
            import wandb
        except ImportError:  # wandb is a core dependency, but a run must not die for a logger
            logger.info("[records] wandb is not installed: metrics go to metrics.jsonl only")
            return None
        os.environ.setdefault("WANDB_SILENT", "true")
        run_id = run_id or uuid.uuid4().hex[:8]
        self.wandb_run_id = run_id
        # After a SIGKILL the killed run's wandb service can hold the id for a while
        # ("run ID ... is in use"): retry, then go on without wandb rather than die for a logger.
        last_error: Optional[Exception] = None
        for attempt in range(8):
            try:
                return wandb.init(project=project, name=run_name, id=run_id, resume="allow", mode=mode,
                                  dir=str(self.run_dir), config=config_dict, settings=wandb.Settings(console="off"))
            except Exception as exc:  # wandb raises its own error types for this
                last_error = exc
                if "in use" not in str(exc):
                    break
                time.sleep(min(2.0 * (attempt + 1), 8.0))
        logger.info(f"[records] wandb could not start ({last_error}); metrics go to metrics.jsonl only")
        return None

    def log_step(self, step: int, metrics: Dict[str, Any]) -> None:
        row = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}, "time/unix": time.time()}
        if self.run_id:
            row["run_id"] = self.run_id
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        print(format_console_line(row), flush=True)
        if self.plot:
            plot_curves(self.run_dir)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def format_console_line(row: Dict[str, Any]) -> str:
    """The fixed-format line rank 0 prints per step (columns the row lacks are left out; a
    NaN the row holds is printed as nan)."""

    def has(key: str) -> bool:
        return isinstance(row.get(key), (int, float))

    parts = [f"step {int(row['step']):>5d}", f"v{int(row.get('policy_version', 0)):<4d}"]
    parts += [fmt.format(float(row[key])) for key, fmt in CONSOLE_COLUMNS if has(key)]
    times = [fmt.format(float(row[key])) for key, fmt in TIME_COLUMNS if has(key)]
    if times:
        parts.append(" ".join(times))
    eval_value = row.get("eval/avg_at_k")
    parts.append(f"eval {eval_value:.3f}" if isinstance(eval_value, (int, float)) else "eval   -  ")
    parts += [f"eval/{name} {float(row[f'eval/{name}/avg_at_k']):.3f}" for name in named_eval_sets([row])
              if has(f"eval/{name}/avg_at_k")]
    return " | ".join(parts)


def plot_curves(run_dir: Path, out_name: str = "curves.png") -> Optional[Path]:
    """Draw the curves a user looks at first into `<run_dir>/curves.png`; a dashed vertical
    line in every panel marks each step from which a resume changed a field that shapes the
    data or the update (`config_history.jsonl`, `run_identity`), named in the first panel."""
    from dapo_mega.run_identity import history_of_current_run

    rows = read_metrics(run_dir)
    if not rows:
        return None
    changes = [c for c in history_of_current_run(run_dir) if c.get("shapes_training")]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 4
    rows_of_panels = -(-len(PLOT_PANELS) // columns)
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(5 * columns, 4 * rows_of_panels))
    per_set = [f"eval/{name}/avg_at_k" for name in named_eval_sets(rows)]  # one line per named eval set
    for ax, (title, keys) in zip(axes.flat, PLOT_PANELS):
        for key in keys + (per_set if title == "accuracy" else []):
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    mark_config_changes(list(axes.flat), changes)
    fig.tight_layout()
    out = Path(run_dir) / out_name
    with atomic_path(out, durable=False) as tmp:  # a figure, redrawn every step
        fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    return out


def mark_config_changes(axes: List[Any], changes: List[Dict[str, Any]]) -> None:
    """A dashed vertical line at each change's step on every axis; the first axis names the
    fields (`field old -> new`) beside their line."""
    by_step: Dict[int, List[str]] = {}
    for c in changes:
        by_step.setdefault(int(c["step"]), []).append(f"{c['field']} {json.dumps(c['old'])} -> {json.dumps(c['new'])}")
    for step, texts in sorted(by_step.items()):
        for ax in axes:
            ax.axvline(step, color="tab:red", linestyle="--", linewidth=0.9, alpha=0.8)
        if axes:
            axes[0].annotate("\n".join(texts), xy=(step, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                             fontsize=6, color="tab:red", va="top", ha="right")
