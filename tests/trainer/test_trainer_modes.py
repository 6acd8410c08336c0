"""`dapo-mega train` end to end on the tiny config: colocated, disaggregated sync and async.

Each run is the real loop (Megatron learner, embedded engine process, weight sync, ledger,
records) in a subprocess, small enough to take well under a minute. The run directory is
then checked against what DESIGN.md "Records" promises and against the ledger itself:
versions and ages consistent with the mode, one metrics row and one ledger shard per step,
per-step metrics recomputed by hand from the ledger rows.
"""

import json
import math
import re

import pytest
from helpers.training import RECORDS_IN_FULL, RUN_NAME, check_records_of_run, read_rows, records_by_step, run_train

from dapo_mega.config import from_yaml


def test_colocated_sync_end_to_end(tmp_path):
    output = run_train(tmp_path, "trainer.eval_interval=3", *RECORDS_IN_FULL)
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=3, max_staleness=0)
    assert (run_dir / "curves.png").is_file() and list((run_dir / "wandb").glob("offline-run-*"))  # the whole record
    by_step = records_by_step(run_dir)
    printed = re.search(r"held-out problems, revision (\S+);", output).group(1)
    assert {r.dataset_revision for recs in by_step.values() for r in recs} == {printed}  # was '' in every row
    # gen 8 prompts for 4 groups: synchronous rounds stream, decide groups in prompt order and
    # abort the requests in flight once 4 groups are kept; the prompts after the 4th go back to
    # `pending` (a finished request's samples discarded, counted), so nothing is carried and
    # nothing goes stale, and every step's rows are its 4 groups
    rows = read_rows(run_dir)
    by_row = {r["step"]: r for r in rows}
    stale = [sum(r.reject_reason == "stale" for r in by_step[s]) for s in (1, 2, 3)]
    assert stale == [0, 0, 0] and all(by_row[s]["rollout/carried_groups"] == 0 for s in (1, 2, 3))
    assert all(len(by_step[s]) == 4 * 4 == 4 * by_row[s]["rollout/groups_generated"] for s in (1, 2, 3))
    assert all(by_row[s]["rollout/prompts_requested"] >= by_row[s]["rollout/groups_generated"] for s in (1, 2, 3))
    assert all(by_row[s]["rollout/discarded_samples"] == 4 * by_row[s]["rollout/discarded_groups"] for s in (1, 2, 3))
    # evaluation before step 1 and after the last step, with the same problems
    evals = [r for r in rows if "eval/avg_at_k" in r]
    assert [r["step"] for r in evals] == [0, 3]
    for r in evals:
        result = json.loads((run_dir / "eval" / f"step_{r['step']:06d}.json").read_text())
        assert len(result["problems"]) == 8 and result["k"] == 2
        assert r["eval/avg_at_k"] == pytest.approx(sum(p["correct"] / 2 for p in result["problems"]) / 8)
    # the ledger report reads the same run back: its per-step numbers are the trainer's
    from dapo_mega.records.ledger_report import build_report

    report = build_report(run_dir)
    assert [d.step for d in report.steps] == [1, 2, 3]
    for d in report.steps:
        assert d.num_samples == by_row[d.step]["rollout/num_samples"]
        assert d.reward_mean == pytest.approx(by_row[d.step]["rollout/reward_mean"])
        assert d.length_p90 == pytest.approx(by_row[d.step]["rollout/response_length_p90"])
        assert d.metrics_verifier_errors == by_row[d.step]["verifier/num_errors"]
    assert {a.label for a in report.ages} == ({"0", "1"} if sum(stale) else {"0"})  # age 1: only the stale surplus
    # the ledger's seed is the request's sampling_seed, from (trainer.seed, step, round, prompt)
    from dapo_mega.rollout.manager import request_seed

    seed = from_yaml((run_dir / "config.yaml").read_text()).trainer.seed
    fresh = [r for r in by_step[3] if r.reject_reason != "stale"]
    assert fresh and all(r.seed == request_seed(seed, 3, r.gen_round, r.prompt_id) for r in fresh)
    # the console line: one fixed-format line per step; step 0 holds only the evaluation
    lines = [line for line in output.splitlines() if line.startswith("step ")]
    assert len(lines) == 4 and lines[-1].startswith("step     3 | v3 ")
    assert lines[0].startswith("step     0 | v0    | eval ") and not any(re.search(r"\bnan\b", x) for x in lines)
    # known library warnings are in the run's log, once each, not on the console
    assert "Apex is not installed" not in output and "all_gather_into_tensor" not in output
    logged = (run_dir / "logs" / "warnings.log").read_text()
    assert "Apex is not installed" in logged and len(logged.splitlines()) == len(set(logged.splitlines()))


@pytest.mark.slow
def test_disaggregated_sync_end_to_end_evaluating_beside_the_next_step(tmp_path):
    """Disaggregated, eval.overlap=auto evaluates beside the next step (driver/eval_beside.py):
    step 0's and step 2's evaluations run while steps 1 and 3 generate and train, each on the
    weights of its own step only (the next sync waits for it), and each lands in its step's row;
    the last step's is inline."""
    output = run_train(tmp_path, "cluster.mode=disaggregated", "cluster.max_staleness=0", "trainer.eval_interval=2")
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=3, max_staleness=0)
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for step in (0, 2, 3):
        result = json.loads((run_dir / "eval" / f"step_{step:06d}.json").read_text())
        assert result["settings"]["weight_versions"] == [step]  # not one token from the next step's weights
        assert rows[step]["eval/avg_at_k"] == pytest.approx(
            sum(p["pass_rate"] for p in result["problems"]) / len(result["problems"]))
    assert "eval/beside_s" in rows[0] and "eval/beside_s" in rows[2] and "eval/beside_s" not in rows[3]
    assert "time/eval_s" in rows[1] and "time/eval_s" in rows[3]  # the wait before step 1's sync; step 3 inline
    assert "eval/avg_at_k" not in rows[1]
    assert output.count("(beside the next step, ") == 2


@pytest.mark.slow
def test_disaggregated_async_staleness_one(tmp_path):
    # with a sequence-level off-policy correction (algo/off_policy.py), as the async recipe's
    # stale samples call for; wide bounds, so what it masks is the tiny model's business
    run_train(tmp_path, "cluster.mode=disaggregated", "cluster.max_staleness=1", "algo.gen_batch_size=4",
              "algo.off_policy_correction=mis", "algo.mis_low=0.01", "algo.mis_high=100")
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=3, max_staleness=1)
    by_step = records_by_step(run_dir)
    # generation of step s+1 starts while step s trains, on the weights of version s-1:
    # the first tokens of step 2 and 3 are one version behind the learner that trains on them
    assert any(r.age == 1 for s in (2, 3) for r in by_step[s] if r.reject_reason == "kept")
    rows = {r["step"]: r for r in read_rows(run_dir)}
    for step in (1, 2, 3):
        kept = [r for r in by_step[step] if r.reject_reason in ("kept", "verifier_error", "stale")]
        assert rows[step]["rollout/age_max"] == max(r.age for r in kept)
        assert 0.0 <= rows[step]["off_policy/masked_seq_frac"] <= 1.0 and math.isfinite(rows[step]["loss/pg"])
        assert rows[step]["off_policy/weight_mean"] > 0.0  # mis weights the kept sequences by their ratio
        ages = {}
        for r in kept:
            ages.setdefault(min(r.age, 3), []).append(r)
        for age, recs in ages.items():
            label = "3+" if age == 3 else str(age)
            assert rows[step][f"age/{label}/num_samples"] == len(recs)
            assert rows[step][f"age/{label}/accuracy"] == pytest.approx(sum(r.correct for r in recs) / len(recs))


@pytest.mark.slow
def test_tensor_parallel_two_learners(tmp_path):
    """`cluster.num_learner_processes=2`: the trainer spawns two torchrun ranks (TP = 2);
    rank 0 drives the engine, both ranks train and send their weight shards."""
    output = run_train(tmp_path, "cluster.num_learner_processes=2", "megatron.tensor_model_parallel_size=2",
                       "trainer.total_steps=2", "trainer.sft_warmup_steps=10", timeout_s=400)
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=2, max_staleness=0)
    assert sum(line.startswith("step ") for line in output.splitlines()) == 2   # rank 0 logs, once per step
    rows = read_rows(run_dir)
    assert all(math.isfinite(r["actor/grad_norm"]) for r in rows)


@pytest.mark.slow
def test_disaggregated_queue_of_one_with_an_age_limit_of_zero(tmp_path):
    """cluster.max_staleness=1 (generation runs a version ahead) and max_sample_age=0: what
    was generated ahead is dropped as stale when consumed and refilled at the learner's
    version, so every trained sample is on-policy, and the refills are in the metrics."""
    run_train(tmp_path, "cluster.mode=disaggregated", "cluster.max_staleness=1", "cluster.max_sample_age=0",
              "algo.gen_batch_size=4")
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=3, max_staleness=1, age_limit=0)
    by_step = records_by_step(run_dir)
    assert all(r.age == 0 for recs in by_step.values() for r in recs if r.reject_reason == "kept")
    rows = {r["step"]: r for r in read_rows(run_dir)}
    assert sum(rows[s]["rollout/refilled_groups"] for s in (2, 3)) > 0 and rows[1]["rollout/refilled_groups"] == 0
    assert sum(rows[s]["rollout/stale_groups"] for s in (2, 3)) > 0
