"""`curves.png`: the curves a user looks at first, redrawn from `metrics.jsonl` (at most
every `trainer.plot_interval_s`, and at the end of a run).

Each named eval set (`eval.sets`) adds its `eval/<name>/avg_at_k` line to the accuracy panel;
a dashed vertical line marks each step from which a resume changed a field that shapes
training (`config_history.jsonl`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence

from dapo_mega.records.metrics import named_eval_sets, read_metrics
from dapo_mega.run_files.checkpoints import atomic_path

if TYPE_CHECKING:
    from matplotlib.axes import Axes

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


def plot_curves(run_dir: Path, out_name: str = "curves.png") -> Optional[Path]:
    """Draw the curves a user looks at first into `<run_dir>/curves.png`; a dashed vertical
    line in every panel marks each step from which a resume changed a field that shapes the
    data or the update (`config_history.jsonl`, `run_files.identity`), named in the first panel."""
    from dapo_mega.run_files.identity import history_of_current_run

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


def mark_config_changes(axes: Sequence["Axes"], changes: Sequence[Mapping[str, object]]) -> None:
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
