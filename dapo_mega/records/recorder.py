"""`RunRecorder`: what the driver rank writes per step: a `metrics.jsonl` row, the console
line, wandb (offline by default) and `curves.png`.

Used by the driver rank only (dapo_mega/driver/roles.py). On resume it first cuts
`metrics.jsonl` back to the checkpointed step, so a step that ran after the last checkpoint
and before a crash appears once, not twice.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional

from dapo_mega import log
from dapo_mega.records.console import format_console_line
from dapo_mega.records.curves import plot_curves
from dapo_mega.records.metrics import finite_or_none, read_metrics, truncate_metrics

if TYPE_CHECKING:
    from dapo_mega.run_files.identity import ConfigTree

logger = log.get(__name__)


RESTORED_KEY = "records/restored_from_checkpoint"
"""Marks a metrics row written on resume from the checkpoint's copy (`RunRecorder`)."""


class RunRecorder:
    """metrics.jsonl + one console line per step + wandb (offline by default) + curves.png."""

    def __init__(self, run_dir: Path, run_name: str, config_dict: ConfigTree, resume_step: int,
                 wandb_mode: str = "offline", wandb_project: str = "dapo-mega",
                 wandb_run_id: Optional[str] = None, plot: bool = True, run_id: str = "",
                 restore_row: Optional[Dict[str, float]] = None, plot_interval_s: float = 0.0):
        """`restore_row`: the resumed checkpoint's own metrics row (`TrainerState.metrics_row`),
        written when metrics.jsonl lacks step `resume_step` (the run ended between its save and
        its row). `plot_interval_s`: curves.png is redrawn at a step only when this long has
        passed since the last drawing (the first step and `close` always draw)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.plot = plot
        self.plot_interval_s = plot_interval_s
        self._plotted_at: Optional[float] = None
        """time.monotonic() of the last drawing of curves.png; None before the first."""
        self._plot_pending = False
        self.run_id = run_id
        """The run's unique id (`run_files.identity`), in every metrics row when set."""
        dropped = truncate_metrics(self.run_dir, resume_step)
        if dropped:
            logger.info(f"[records] resuming at step {resume_step}: dropped {dropped} metric rows of "
                        "steps that ran after the last checkpoint")
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._wandb = None
        self.wandb_run_id = wandb_run_id
        if wandb_mode != "disabled":
            self._wandb = self._start_wandb(run_name, config_dict, wandb_mode, wandb_project, wandb_run_id)
        if restore_row is not None and resume_step > 0 and not any(
                int(r.get("step", -1)) == resume_step for r in read_metrics(self.run_dir)):
            logger.info(f"[records] step {resume_step}'s row was not written before the run ended: written from "
                        f"its checkpoint ({RESTORED_KEY}=1; figures that came after the save are not in it)")
            self.log_step(resume_step, {**restore_row, RESTORED_KEY: 1})

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

    def log_step(self, step: int, metrics: Dict[str, float]) -> None:
        row = {"step": step, **{k: finite_or_none(v) for k, v in metrics.items()}, "time/unix": time.time()}
        if self.run_id:
            row["run_id"] = self.run_id
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        print(format_console_line(row), flush=True)
        if self.plot:
            self._plot_pending = True
            if self._plotted_at is None or time.monotonic() - self._plotted_at >= self.plot_interval_s:
                self._draw_curves()

    def _draw_curves(self) -> None:
        plot_curves(self.run_dir)
        self._plotted_at, self._plot_pending = time.monotonic(), False

    def close(self) -> None:
        if self._plot_pending:  # the steps since the last drawing
            self._draw_curves()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
