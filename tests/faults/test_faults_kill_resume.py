"""SIGKILL of `dapo-mega train` in generation, in training, in a checkpoint save and right
after one (before the step's metrics row: the resume writes it from the checkpoint); restart.

One run is killed four times at deterministic points (see test_faults_common.py) and
restarted after each kill; a second run of the same config goes straight through. The
restarted run must resume from the last complete checkpoint each time, end with every step
once in metrics.jsonl and in the ledger, and end with the same rollouts, losses, weights
and optimizer state as the straight run. That last part holds because rollouts are
reproducible: each prompt's request carries a sampling seed made from (trainer.seed, step,
round, prompt id), so a step redone after a resume samples the same tokens.
"""

from __future__ import annotations

import signal

import pytest
import torch
from test_faults_common import load_checkpoint_tensors, read_metric_rows, run_trainer

from dapo_mega.records.ledger import read_records

RUN = ["trainer.total_steps=4", "trainer.save_interval=1", "trainer.keep_last_k=5"]


def _latest(run_dir):
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def _steps(run_dir):
    return [r["step"] for r in read_metric_rows(run_dir)]


def _killed(result, phase):
    assert result.returncode == -signal.SIGKILL, f"expected the {phase} kill:\n{result.stdout[-3000:]}"
    assert "[fault] SIGKILL" in result.stdout


def _ledger_by_step(run_dir):
    out = {}
    for r in read_records(run_dir):
        out.setdefault(r.step, []).append((r.prompt_id, r.gen_round, r.sample_index, r.response_text, r.reward,
                                           r.policy_version_min, r.reject_reason))
    return {step: sorted(rows) for step, rows in out.items()}


@pytest.mark.slow
def test_sigkill_in_each_phase_resumes_to_the_straight_run(tmp_path):
    chain = tmp_path / "chain"

    first = run_trainer(tmp_path, "chain", RUN, faults=["kill:generate:2"])
    _killed(first, "generation")
    assert _latest(chain) == "step_000001" and _steps(chain) == [1]

    second = run_trainer(tmp_path, "chain", RUN, faults=["kill:train:3"])
    assert "at step 1, policy version 1" in second.stdout, second.stdout[-3000:]
    _killed(second, "training")
    assert _latest(chain) == "step_000002" and _steps(chain) == [1, 2]

    third = run_trainer(tmp_path, "chain", RUN, faults=["kill:save:3"])
    assert "at step 2, policy version 2" in third.stdout, third.stdout[-3000:]
    _killed(third, "checkpoint save")
    leftovers = [p.name for p in (chain / "checkpoints").iterdir() if ".tmp-" in p.name]
    assert leftovers and leftovers[0].startswith("step_000003"), "the kill must hit step 3's save in progress"
    assert _latest(chain) == "step_000002" and _steps(chain) == [1, 2]

    fourth = run_trainer(tmp_path, "chain", RUN, faults=["kill:saved:3"])
    assert "at step 2, policy version 2" in fourth.stdout  # the half-written step 3 was ignored
    _killed(fourth, "after-save")
    assert _latest(chain) == "step_000003" and _steps(chain) == [1, 2]  # step 3 saved, its row not written

    last = run_trainer(tmp_path, "chain", RUN)
    assert last.returncode == 0, last.stdout[-3000:]
    assert "at step 3, policy version 3" in last.stdout and "step 3's row was not written" in last.stdout

    straight = tmp_path / "straight"
    ref = run_trainer(tmp_path, "straight", RUN)
    assert ref.returncode == 0, ref.stdout[-3000:]

    # Every step once, in order, with its version, in metrics and ledger.
    rows, ref_rows = read_metric_rows(chain), read_metric_rows(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("records/restored_from_checkpoint") for r in rows] == [None, None, 1, None]
    ledger, ref_ledger = _ledger_by_step(chain), _ledger_by_step(straight)
    assert sorted(ledger) == [1, 2, 3, 4]
    for step, recs in ledger.items():
        keys = [(pid, rnd, k) for pid, rnd, k, *_ in recs]
        assert len(keys) == len(set(keys)) == 16, f"step {step}: a sample lost or repeated"
        assert all(version == step - 1 for *_, version, _ in recs)
    assert not [p for p in (chain / "checkpoints").iterdir() if ".tmp-" in p.name]

    # Same rollouts (tokens decoded to text, rewards), same losses, same final state.
    assert ledger == ref_ledger
    for row, ref_row in zip(rows, ref_rows):
        for key in ("loss/pg", "actor/grad_norm", "rollout/reward_mean", "train/num_updates"):
            assert row[key] == pytest.approx(ref_row[key], rel=1e-5, abs=1e-6), (row["step"], key)
    final = load_checkpoint_tensors(chain / "checkpoints" / "step_000004")
    ref_final = load_checkpoint_tensors(straight / "checkpoints" / "step_000004")
    assert final.keys() == ref_final.keys() and any(k.startswith("optimizer.") for k in final)
    for name, tensor in ref_final.items():
        assert torch.allclose(final[name], tensor, rtol=1e-5, atol=1e-7), name
    # ...and the run did train: the weights moved away from step 1's.
    first_ckpt = load_checkpoint_tensors(chain / "checkpoints" / "step_000001")
    assert not torch.equal(first_ckpt["output_layer.weight"], final["output_layer.weight"])
