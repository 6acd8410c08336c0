"""The fixed-format line rank 0 prints per step (its columns are shown in the README).

Each named eval set (`eval.sets`) adds `eval/<name> 0.123` after the unnamed set's `eval`
column.
"""

from __future__ import annotations

from typing import Mapping

from dapo_mega.records.metrics import named_eval_sets

CONSOLE_COLUMNS = (
    # (metric key, column format); a column whose metric the row lacks is left out
    ("rollout/reward_mean", "reward {:+.3f}"),
    ("rollout/accuracy", "acc {:.3f}"),
    ("rollout/kept_group_frac", "kept {:.2f}"),
    ("rollout/response_length_mean", "len {:6.1f}"),
    ("rollout/entropy_mc", "ent {:.3f}"),
    ("rollout/turns_mean", "turns {:.2f}"),  # multi-turn samples only (rollout/metrics.py turn_metrics)
    ("rollout/tool_errors", "tool_err {:.0f}"),  # rollout policy entropy estimate, −mean log p (rollout/metrics.py)
    ("loss/pg", "loss {:+.4f}"),
    ("actor/grad_norm", "gnorm {:.3f}"),
)
TIME_COLUMNS = (("time/rollout_s", "gen {:5.1f}s"), ("time/train_s", "train {:5.1f}s"), ("time/sync_s", "sync {:4.1f}s"))
"""A training row prints every column (the fixed format in the README); the step-0 row, which
holds only the evaluation, prints the step, the version and the evaluation."""


def format_console_line(row: Mapping[str, object]) -> str:
    """The fixed-format line rank 0 prints per step (columns the row lacks are left out; a
    NaN the row holds is printed as nan)."""

    def has(key: str) -> bool:
        return isinstance(row.get(key), (int, float))

    parts = [f"step {int(row['step']):>5d}", f"v{int(row.get('policy_version', 0)):<4d}"]
    parts += [fmt.format(float(row[key])) for key, fmt in CONSOLE_COLUMNS if has(key)]
    if has("rollout/verdict_rate") and float(row["rollout/verdict_rate"]) < 1:
        # a bare score is no verdict: acc counts the verdicts, the group filter read the score
        parts.append(f"verdicts {float(row['rollout/verdict_rate']):.2f}"
                     + (", filter on score" if float(row.get("rollout/score_filtered_groups") or 0) > 0 else ""))
    times = [fmt.format(float(row[key])) for key, fmt in TIME_COLUMNS if has(key)]
    if times:
        parts.append(" ".join(times))
    eval_value = row.get("eval/avg_at_k")
    parts.append(f"eval {eval_value:.3f}" if isinstance(eval_value, (int, float)) else "eval   -  ")
    parts += [f"eval/{name} {float(row[f'eval/{name}/avg_at_k']):.3f}" for name in named_eval_sets([row])
              if has(f"eval/{name}/avg_at_k")]
    return " | ".join(parts)
