"""Run state: the counters of a run, their checkpoint and resume, and the run's record files.

`TrainerState` is what a checkpoint carries besides weights and optimizer state (step,
policy version, data cursor, rollout carry-over, wandb id). `RunState` owns it on every
learner rank: `resume` loads the latest complete checkpoint of the run directory (collective),
`save` writes one (collective), `should_eval` / `should_save` say when. The driver's record
files live here too: `write_ledger` (one parquet shard per step, rows read off the step's
ScoredSamples) and `prune_records_after` (on resume, ledger shards and evaluation files of
steps after the checkpoint are redone, not kept twice).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from dapo_mega.rollout.ledger import ledger_dir, ledger_record, write_step
from dapo_mega.rollout.samples import ScoredSample


@dataclass
class TrainerState:
    """What a checkpoint must carry besides weights and optimizer state."""

    step: int = 0
    """Last completed step."""
    policy_version: int = 0
    """Optimizer steps the learner has taken and synced into the engines."""
    data_cursor: Optional[Dict[str, Any]] = None
    """The prompt iterator's position (driver)."""
    rollout_carry: Optional[Dict[str, Any]] = None
    """Groups dynamic sampling kept for the next step (driver)."""
    wandb_run_id: Optional[str] = None
    warm_started: bool = False


class RunState:
    """The trainer state of one run on one learner rank, and when to evaluate and save."""

    def __init__(self, run_dir: Path, trainer_cfg: Any):
        self.run_dir = Path(run_dir)
        self.cfg = trainer_cfg
        self.state = TrainerState()
        self.resumed = False
        """True when `resume` found a checkpoint."""
        self.checkpoint: Optional[Path] = None

    def resume(self, learner: Any) -> bool:
        """Load the latest complete checkpoint (weights, optimizer, RNG, trainer state) when
        `trainer.resume` is on and there is one. Collective. Returns whether it did."""
        from dapo_mega.backends.megatron.checkpoint import load_checkpoint
        from dapo_mega.run_dir import find_latest_checkpoint

        latest = find_latest_checkpoint(self.run_dir) if self.cfg.resume else None
        if latest is None:
            return False
        raw = load_checkpoint(learner, latest)
        self.state = TrainerState(**{k: raw[k] for k in asdict(TrainerState()) if k in raw})
        self.resumed, self.checkpoint = True, latest
        return True

    def save(self, learner: Any, step: int, driver_state: Dict[str, Any]) -> None:
        """Checkpoint `step` with the trainer state (collective); `driver_state` holds what only
        the driver knows (data cursor, rollout carry-over), {} on the other ranks."""
        from dapo_mega.backends.megatron.checkpoint import save_checkpoint

        save_checkpoint(learner, self.run_dir, step, {**asdict(self.state), **driver_state},
                        keep_last_k=self.cfg.keep_last_k)

    def should_eval(self, step: int) -> bool:
        n = self.cfg.eval_interval
        return n > 0 and (step % n == 0 or step == self.cfg.total_steps)

    def should_save(self, step: int) -> bool:
        n = self.cfg.save_interval
        return (n > 0 and step % n == 0) or step == self.cfg.total_steps


def write_ledger(run_dir: Path, run_id: str, step: int, samples: Sequence[ScoredSample]) -> Path:
    """The ledger shard of `step`: one row per sample the step generated or dropped."""
    return write_step(run_dir, step, [ledger_record(s, run_id) for s in samples])


def prune_records_after(run_dir: Path, step: int) -> None:
    """On resume: ledger shards and evaluation files of steps after `step` go (they are redone)."""
    for path in ledger_dir(run_dir).glob("step_*.parquet"):
        if int(path.stem.split("_")[1]) > step:
            path.unlink()
    eval_dir = Path(run_dir) / "eval"
    if eval_dir.exists():
        for path in eval_dir.glob("step_*.json"):
            if int(path.stem.split("_")[1]) > step:
                path.unlink()
