"""Run state: the counters of a run, their checkpoint and resume, and the run's record files.

`TrainerState` is what a checkpoint carries besides weights and optimizer state (step,
policy version, data cursor, rollout carry-over, wandb id). `RunState` owns it on every
learner rank: `resume` loads the latest complete checkpoint of the run directory (collective),
`save` writes one (collective), `should_eval` / `should_save` say when, and `WallClock` whether
the run must stop early to fit `trainer.wall_time_minutes` (a Slurm job's time limit). The driver's record
files live here too: `write_ledger` (one parquet shard per step, rows read off the step's
ScoredSamples) and `prune_records_after` (on resume, ledger shards and evaluation files of
steps after the checkpoint are redone, not kept twice).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

from dapo_mega.config import TrainerConfig
from dapo_mega.records.ledger import FULL_TEXT, LedgerText, ledger_dir, ledger_record, write_step
from dapo_mega.rollout.samples import ScoredSample
from dapo_mega.run_files.identity import RunIdentity

if TYPE_CHECKING:
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.data.iterator import PromptCursor
    from dapo_mega.models.shape import HfConfigDict


@dataclass
class TrainerState:
    """What a checkpoint must carry besides weights and optimizer state."""

    step: int = 0
    """Last completed step."""
    policy_version: int = 0
    """Optimizer steps the learner has taken and synced into the engines."""
    data_cursor: Optional[PromptCursor] = None
    """The prompt iterator's position (driver)."""
    rollout_carry: Optional[Dict[str, Any]] = None
    """Groups dynamic sampling kept for the next step (driver)."""
    wandb_run_id: Optional[str] = None
    warm_started: bool = False
    metrics_row: Optional[Dict[str, Any]] = None
    """The saved step's metrics row as it stood at the save (driver): a resume writes it when
    the process ended between the save and the row (`records.recorder.RunRecorder`)."""


def would_overrun(elapsed_s: float, longest_step_s: float, last_save_s: float, limit_s: float,
                  margin_s: float) -> bool:
    """Whether one more step (as long as the longest so far) and its save, with the margin,
    would end past `limit_s` after `elapsed_s` (never with no limit)."""
    return limit_s > 0 and elapsed_s + longest_step_s + last_save_s + margin_s > limit_s


@dataclass
class WallClock:
    """The time a run has within its limit (`trainer.wall_time_minutes`), and what a step and
    a save take; `next_step_would_overrun` is the driver's question before each next step."""

    limit_s: float
    margin_s: float
    start: float = field(default_factory=time.monotonic)
    longest_step_s: float = 0.0
    last_save_s: float = 0.0
    last_export_s: float = 0.0
    """The last HF export's seconds (`trainer.hf_export_interval`), counted as part of a save."""

    @classmethod
    def of(cls, trainer_cfg: TrainerConfig) -> "WallClock":
        return cls(limit_s=60.0 * trainer_cfg.wall_time_minutes, margin_s=60.0 * trainer_cfg.stop_margin_minutes)

    def record_step(self, seconds: float) -> None:
        self.longest_step_s = max(self.longest_step_s, seconds)

    def record_save(self, seconds: float) -> None:
        self.last_save_s = seconds

    def record_export(self, seconds: float) -> None:
        self.last_export_s = seconds

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def next_step_would_overrun(self) -> bool:
        return would_overrun(self.elapsed_s(), self.longest_step_s, self.last_save_s + self.last_export_s,
                             self.limit_s, self.margin_s)


class RunState:
    """The trainer state of one run on one learner rank, and when to evaluate and save."""

    def __init__(self, run_dir: Path, trainer_cfg: TrainerConfig):
        self.run_dir = Path(run_dir)
        self.cfg = trainer_cfg
        self.state = TrainerState()
        self.resumed = False
        """True when `resume` found a checkpoint."""
        self.checkpoint: Optional[Path] = None
        self.clock = WallClock.of(trainer_cfg)
        self.identity = RunIdentity(run_id=trainer_cfg.run_name, run_name=trainer_cfg.run_name)
        """The run's id and name (`run_files.identity.settle_run_dir` sets it at start)."""

    @property
    def run_id(self) -> str:
        return self.identity.run_id

    def resume(self, learner: "MegatronLearner") -> bool:
        """Load the latest complete checkpoint (weights, optimizer, RNG, trainer state) when
        `trainer.resume` is on and there is one. Collective. Returns whether it did."""
        from dapo_mega.backends.megatron.checkpoint import load_checkpoint
        from dapo_mega.run_files.checkpoints import resume_checkpoint

        latest = resume_checkpoint(self.run_dir, self.cfg.resume, self.cfg.resume_step)
        if latest is None:
            return False
        raw = load_checkpoint(learner, latest)
        self.state = TrainerState(**{k: raw[k] for k in asdict(TrainerState()) if k in raw})
        self.resumed, self.checkpoint = True, latest
        return True

    def save(self, learner: "MegatronLearner", step: int, driver_state: Dict[str, object]) -> None:
        """Checkpoint `step` with the trainer state (collective); `driver_state` holds what only
        the driver knows (data cursor, rollout carry-over), {} on the other ranks."""
        from dapo_mega.backends.megatron.checkpoint import save_checkpoint

        save_checkpoint(learner, self.run_dir, step, {**asdict(self.state), **driver_state},
                        keep_last_k=self.cfg.keep_last_k, keep_every=self.cfg.keep_every)

    def should_eval(self, step: int) -> bool:
        n = self.cfg.eval_interval
        return n > 0 and (step % n == 0 or step == self.cfg.total_steps)

    def should_save(self, step: int) -> bool:
        n = self.cfg.save_interval
        return (n > 0 and step % n == 0) or step == self.cfg.total_steps

    def should_export_hf(self, step: int) -> bool:
        """Every `trainer.hf_export_interval` steps and after the last one (0: never)."""
        n = self.cfg.hf_export_interval
        return n > 0 and (step % n == 0 or step == self.cfg.total_steps)

    def export_hf(self, learner: "MegatronLearner", step: int, hf_config: HfConfigDict,
                  hf_side_dir: Path) -> Dict[str, float]:
        """The learner's weights as `<run_dir>/hf/step_<N>/` (collective; `weights.convert.export_hf_step`),
        keeping `trainer.hf_export_keep`; its cost as metrics on the driver, {} elsewhere."""
        from dapo_mega.weights.convert import export_hf_step
        from dapo_mega.weights.hf_io import dtype_from_name

        record = export_hf_step(learner.model_chunks, learner.info, learner.layout, self.run_dir, step, hf_config,
                                hf_side_dir, dtype_from_name(self.cfg.hf_export_dtype), self.cfg.hf_export_keep)
        if record is None:
            return {}
        self.clock.record_export(record.seconds)
        return record.metrics()


def write_ledger(run_dir: Path, run_id: str, step: int, samples: Sequence[ScoredSample],
                 text: LedgerText = FULL_TEXT, run_name: str = "", encoder: str = "") -> Path:
    """The ledger shard of `step`: one row per sample the step generated or dropped, its
    texts as `text` keeps them (`LedgerText.of(cfg.trainer)`), each with the run's id and name
    and the prompt encoder's fingerprint."""
    return write_step(run_dir, step, [ledger_record(s, run_id, text, run_name, encoder) for s in samples])


def eval_result_path(run_dir: Path, step: int, set_name: str = "") -> Path:
    """`eval/step_<step>.json` for the unnamed eval set, `eval/step_<step>_<name>.json` for a named one."""
    return Path(run_dir) / "eval" / (f"step_{step:06d}_{set_name}.json" if set_name else f"step_{step:06d}.json")


def prune_records_after(run_dir: Path, step: int) -> None:
    """On resume: ledger shards and evaluation files (every set's) of steps after `step` go (they are redone)."""
    for path in ledger_dir(run_dir).glob("step_*.parquet"):
        if int(path.stem.split("_")[1]) > step:
            path.unlink()
    eval_dir = Path(run_dir) / "eval"
    if eval_dir.exists():
        for path in eval_dir.glob("step_*.json"):
            if int(path.stem.split("_")[1]) > step:
                path.unlink()
