"""Two runs of the default task with one seed train on the same samples: `dapo-mega train` twice with the same settings writes the same ledger, row for row,
apart from what is timing (latencies, queue delays), placement (engine ids) and identity (run
ids).

The synchronous default streams its rounds and aborts the requests in flight once the batch
is full; which of them had finished by then is timing, and must not show. The second run
changes only when requests go: one prompt per request, one request in flight (the first run:
two requests of 4 prompts at once, the second finishing or not before the first fills the
batch). The manager before the rule carried the second request's groups when it had
finished (then dropped them as `stale` next step) and made no rows of them when it had not,
so the two ledgers differed.
"""

import pytest
from helpers.training import RUN_NAME, read_rows, run_train

from dapo_mega.records.ledger import read_records

COMPARED = ["step", "prompt_id", "sample_index", "seed", "gen_round", "response_text", "response_length",
            "truncated", "reward", "correct", "reject_reason", "policy_version_min", "policy_version_max",
            "learner_version", "age", "extracted_answer"]
"""Ledger fields that must repeat (not timing, engine ids or run ids)."""

STEPS = 3
SETTINGS = [f"trainer.total_steps={STEPS}", "trainer.sft_warmup_steps=4", "trainer.seed=3"]
SCHEDULES = {"a": [], "b": ["rollout.prompts_per_request=1", "rollout.requests_per_engine=1"]}


def ledger_rows(run_dir):
    return sorted(tuple(getattr(r, name) for name in COMPARED) for r in read_records(run_dir))


@pytest.mark.slow
def test_two_runs_with_one_seed_write_the_same_ledger(tmp_path):
    for name, schedule in SCHEDULES.items():
        (tmp_path / name).mkdir()
        run_train(tmp_path / name, *SETTINGS, *schedule, tag=name)
    a, b = ledger_rows(tmp_path / "a" / RUN_NAME), ledger_rows(tmp_path / "b" / RUN_NAME)
    assert {r[0] for r in a} == set(range(1, STEPS + 1))
    assert len(a) == len(b)
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    assert not diff, f"{len(diff)} of {len(a)} rows differ; first: {diff[0]}"
    # a streamed synchronous step carries nothing (nothing goes stale): every row is one of the
    # step's decided groups
    for name in SCHEDULES:
        assert all(r["rollout/carried_groups"] == 0 for r in read_rows(tmp_path / name / RUN_NAME) if r["step"] >= 1)
    assert not any(r[COMPARED.index("reject_reason")] == "stale" for r in a)
