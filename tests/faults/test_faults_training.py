"""Faults inside a training step of a real `dapo-mega train` run.

* A NaN loss/gradient (every advantage of step 2 NaN): with algo.on_nonfinite=skip the step
  applies no update, says so in metrics.jsonl (train/skipped_updates), and the weights and
  optimizer state saved after it equal those saved before it; the next step trains again.
  With on_nonfinite=stop the run ends with a clear error and the last checkpoint intact.
* A verifier that raises on some responses and never returns on others (it runs in the
  verifier pool; `algo.verifier_timeout_s` bounds it): those samples are scored as failed
  with reason verifier_error, counted per step, and the run goes on.
Both faults share the first run (verifier faults in every step, NaN in step 2).
"""

from __future__ import annotations

import math

import torch
from test_faults_common import TINY_OVERRIDES, load_checkpoint_tensors, read_metric_rows, run_trainer

from dapo_mega.config import load_config
from dapo_mega.data import PromptIterator, build_datasets
from dapo_mega.records.ledger import read_records

RUN = ["trainer.total_steps=3", "trainer.save_interval=1", "trainer.keep_last_k=5"]


def _first_problems(n):
    """The problems the trainer draws first (same data config and cursor as the run)."""
    cfg = load_config(TINY_OVERRIDES)
    train, _, revision = build_datasets(cfg.data)
    it = PromptIterator(train, seed=cfg.data.seed, shuffle=cfg.data.shuffle, revision=revision)
    return it.next_batch(n), {p.id: p.ground_truth for p in train}


def test_nan_step_is_skipped_and_verifier_faults_are_scored_failed(tmp_path):
    first, truth_of = _first_problems(2)
    raise_on, hang_on = first[0].ground_truth, first[1].ground_truth
    result = run_trainer(tmp_path, "skip", RUN + ["algo.on_nonfinite=skip", "algo.verifier_timeout_s=1.0"],
                         faults=["nan:2", f"verifier:{raise_on}:{hang_on}"], timeout_s=400)
    assert result.returncode == 0, result.stdout[-4000:]
    run_dir = tmp_path / "skip"
    rows = read_metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]

    # --- NaN: step 2 skipped both of its updates and reported it; steps 1 and 3 trained.
    assert [r["train/skipped_updates"] for r in rows] == [0, 2, 0]
    assert [r["train/num_updates"] for r in rows] == [2, 0, 2]
    assert rows[1]["loss/pg"] is None  # NaN is written as null, never as a number
    ckpt = [load_checkpoint_tensors(run_dir / "checkpoints" / f"step_{s:06d}") for s in (1, 2, 3)]
    assert ckpt[0].keys() == ckpt[1].keys()
    for name in ckpt[0]:
        assert torch.isfinite(ckpt[1][name]).all(), name
        assert torch.equal(ckpt[0][name], ckpt[1][name]), f"{name} changed in the skipped step"
    assert not torch.equal(ckpt[1]["output_layer.weight"], ckpt[2]["output_layer.weight"])
    assert all(torch.isfinite(t).all() for t in ckpt[2].values())

    # --- verifier: exactly the samples of the faulty ground truths failed, counted per step.
    records = read_records(run_dir)
    assert len(records) == 3 * 16
    for r in records:
        faulty = truth_of[r.prompt_id] in (raise_on, hang_on)
        assert (r.reject_reason == "verifier_error") == faulty, (r.prompt_id, r.reject_reason)
        if faulty:
            assert r.reward <= -1.0 and not r.correct
    for row in rows:
        recs = [r for r in records if r.step == row["step"]]
        raised = sum(truth_of[r.prompt_id] == raise_on for r in recs)
        hung = sum(truth_of[r.prompt_id] == hang_on for r in recs)
        assert row["verifier/num_exceptions"] == raised and row["verifier/num_timeouts"] == hung
        assert row["verifier/num_errors"] == row["rollout/verifier_errors"] == raised + hung
    assert rows[0]["verifier/num_exceptions"] >= 4 and rows[0]["verifier/num_timeouts"] >= 4


def test_nan_step_stops_the_run_when_configured(tmp_path):
    result = run_trainer(tmp_path, "stop", RUN + ["algo.on_nonfinite=stop"], faults=["nan:2"])
    assert result.returncode != 0
    assert "NonFiniteError" in result.stdout and "algo.on_nonfinite=stop" in result.stdout
    run_dir = tmp_path / "stop"
    assert [r["step"] for r in read_metric_rows(run_dir)] == [1]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000001"]
    saved = load_checkpoint_tensors(run_dir / "checkpoints" / "step_000001")
    assert saved and all(torch.isfinite(t).all() for t in saved.values())
    assert not math.isnan(read_metric_rows(run_dir)[0]["loss/pg"])
