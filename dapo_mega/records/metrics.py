"""`metrics.jsonl`: one JSON row per step, read back by the curves, the ledger report,
`dapo-mega eval` and the ablation table.

A row holds the step, the policy version, every metric of the step (a non-finite float is
written as null), `time/unix` and the run's id. A torn last line, left by a crash in the
middle of a write, is skipped on reading; on resume `truncate_metrics` cuts the file back to
the checkpointed step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List

from dapo_mega.run_files.checkpoints import write_text_atomic

Row = Dict[str, object]
"""One metrics row: `step` and metric names to numbers (or strings, such as `run_id`)."""


def named_eval_sets(rows: List[Row]) -> List[str]:
    """The named eval sets whose `eval/<name>/avg_at_k` the rows hold, in first-seen order."""
    names: Dict[str, None] = {}
    for row in rows:
        for key in row:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "eval" and parts[2] == "avg_at_k":
                names.setdefault(parts[1], None)
    return list(names)


def finite_or_none(value: object) -> object:
    """`value`, or None for a NaN or infinite float (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(run_dir: Path) -> List[Row]:
    """All rows of `<run_dir>/metrics.jsonl` (a torn last line from a crash is ignored)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows: List[Row] = []
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
