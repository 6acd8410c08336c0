"""The rollout ledger: one row per generated sample, one parquet shard per step.

`<run_dir>/ledger/step_00000012.parquet` holds every sample generated or consumed in step
12 (kept or rejected, with the reason), with the fields of DESIGN.md "Records". A shard is
written to a temporary file and renamed, so a crash never leaves half a shard, and
rewriting a step after a resume replaces its shard instead of duplicating rows.

A row is read off a `ScoredSample` (rollout/samples.py) by `ledger_record`, field by field
under the same names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import List, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from dapo_mega.rollout.samples import ScoredSample

REJECT_REASONS = ("kept", "all_correct_group", "all_wrong_group", "stale", "verifier_error",
                  "surplus_carried", "aborted")


@dataclass
class LedgerRecord:
    run_id: str
    step: int
    prompt_id: str
    dataset_revision: str
    sample_index: int
    seed: Optional[int]
    """`sampling_seed` of the request that produced the sample (the embedded engine seeds
    sample j of a request with seed + j); None when the run sets no seed."""
    policy_version_min: int
    """Oldest weight version that produced a token of this sample (engine spans)."""
    policy_version_max: int
    learner_version: int
    """Version of the learner that consumed (or rejected) the sample."""
    age: int
    """learner_version - policy_version_min."""
    engine_id: str
    queue_delay_s: float
    generation_latency_s: float
    response_length: int
    truncated: bool
    reward: float
    correct: bool
    reward_components: str
    """JSON object of the reward's parts (correctness, overlong penalty, ...)."""
    verifier: str
    verifier_version: str
    reject_reason: str
    response_text: str
    prompt_text: str
    gen_round: int = 0


_TYPES = {int: pa.int64(), float: pa.float64(), bool: pa.bool_(), str: pa.string(),
          "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string(),
          "Optional[int]": pa.int64()}
SCHEMA = pa.schema([(f.name, _TYPES[f.type]) for f in fields(LedgerRecord)])


def ledger_record(sample: ScoredSample, run_id: str) -> LedgerRecord:
    """The ledger row of a sample that has been scored and stamped by its consumer."""
    return LedgerRecord(
        run_id=run_id, step=sample.step, prompt_id=sample.prompt_id, dataset_revision=sample.dataset_revision,
        sample_index=sample.sample_index, seed=sample.seed, policy_version_min=sample.policy_version_min,
        policy_version_max=sample.policy_version_max, learner_version=sample.learner_version, age=sample.age,
        engine_id=sample.engine_id, queue_delay_s=sample.queue_delay_s,
        generation_latency_s=sample.generation_latency_s, response_length=sample.response_length,
        truncated=sample.truncated, reward=sample.reward, correct=sample.correct,
        reward_components=json.dumps(sample.score.components()), verifier=sample.score.verifier,
        verifier_version=sample.score.verifier_version, reject_reason=sample.reject_reason,
        response_text=sample.response_text, prompt_text=sample.prompt_text, gen_round=sample.gen_round)


def ledger_dir(run_dir: os.PathLike) -> Path:
    return Path(run_dir) / "ledger"


def shard_path(run_dir: os.PathLike, step: int) -> Path:
    return ledger_dir(run_dir) / f"step_{step:08d}.parquet"


def prepare_writer() -> None:
    """Load what the first `write_step` would load (pyarrow imports pandas on its first
    array, ~0.3 s): the driver calls this at start-up, not inside its first step."""
    pa.array([0], type=pa.int64())


def write_step(run_dir: os.PathLike, step: int, records: Sequence[LedgerRecord]) -> Path:
    """Write (or replace) the shard of `step` atomically."""
    path = shard_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    for r in records:
        if r.step != step:
            raise ValueError(f"record of step {r.step} written into step {step}")
        if r.reject_reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {r.reject_reason!r}")
    # Column by column: `asdict` deep-copies every field of every row (most of a step's driver time).
    table = pa.Table.from_pydict({name: [getattr(r, name) for r in records] for name in SCHEMA.names}, schema=SCHEMA)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


def read_ledger(run_dir: os.PathLike, steps: Optional[Sequence[int]] = None) -> pa.Table:
    """All shards of a run (or of `steps`), concatenated in step order."""
    paths = sorted(ledger_dir(run_dir).glob("step_*.parquet"))
    if steps is not None:
        wanted = {shard_path(run_dir, s).name for s in steps}
        paths = [p for p in paths if p.name in wanted]
    if not paths:
        return SCHEMA.empty_table()
    return pa.concat_tables([pq.read_table(p, schema=SCHEMA) for p in paths])


def read_records(run_dir: os.PathLike, steps: Optional[Sequence[int]] = None) -> List[LedgerRecord]:
    return [LedgerRecord(**row) for row in read_ledger(run_dir, steps).to_pylist()]
