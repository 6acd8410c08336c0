"""Ledger report on a hand-built ledger with known counts (every expected value by hand)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mega.records.ledger import LedgerRecord, write_step
from dapo_mega.records.ledger_report import (
    build_report,
    compute_age_buckets,
    compute_step_diagnostics,
    flag_suspicious,
    is_near_empty,
    render_markdown,
    repeats_prompt,
    sample_high_reward,
    write_report,
)

REPO = Path(__file__).resolve().parents[2]


def rec(step, prompt_id, index, correct, length, reason, age=0, truncated=False, text=" 12",
        prompt_text="Q: 5+7\nAnswer:", gen_round=0):
    learner_version = step - 1
    return LedgerRecord(
        run_id="hand", step=step, prompt_id=prompt_id, dataset_revision="r1", sample_index=index, seed=None,
        policy_version_min=learner_version - age, policy_version_max=learner_version - age,
        learner_version=learner_version, age=age, engine_id="e0", queue_delay_s=0.0, generation_latency_s=0.1,
        response_length=length, truncated=truncated, reward=1.0 if correct else -1.0, correct=correct,
        reward_components=json.dumps({"correctness": 1.0 if correct else -1.0}), verifier="dapo",
        verifier_version="v1", reject_reason=reason, response_text=text, prompt_text=prompt_text,
        gen_round=gen_round)


def hand_ledger():
    """Step 1 (age 0): A all correct, B all wrong (one truncated), C mixed with one
    verifier error and two near-empty correct answers. Step 2: D mixed (age 1, the correct
    answer restates the prompt), E all wrong and stale (age 4). Step 3: three prompts
    whose one correct answer is the same long sentence (copied)."""
    step1 = [rec(1, "A", i, True, 10, "all_correct_group") for i in range(4)]
    step1 += [rec(1, "B", i, False, 20, "all_wrong_group", truncated=(i == 0), text=" 3") for i in range(4)]
    step1 += [rec(1, "C", 0, True, 5, "kept", text="\\boxed{}", prompt_text="Q: 1+1\nAnswer:"),
              rec(1, "C", 1, True, 1, "kept", text="", prompt_text="Q: 1+1\nAnswer:"),
              rec(1, "C", 2, False, 25, "verifier_error", text=" 9", prompt_text="Q: 1+1\nAnswer:"),
              rec(1, "C", 3, False, 35, "kept", text=" 8", prompt_text="Q: 1+1\nAnswer:")]
    step2 = [rec(2, "D", 0, True, 16, "kept", age=1, text="Q: 3+4 Answer: 7", prompt_text="Q: 3+4\nAnswer:")]
    step2 += [rec(2, "D", i, False, 6, "kept", age=1, text=" 1", prompt_text="Q: 3+4\nAnswer:") for i in (1, 2, 3)]
    step2 += [rec(2, "E", i, False, 6, "stale", age=4, text=" 2", prompt_text="Q: 9-1\nAnswer:") for i in range(4)]
    copied = "I am confident the result is right"
    step3 = []
    for p in ("F", "G", "H"):
        step3 += [rec(3, p, 0, True, 30, "kept", text=copied, prompt_text=f"Q: {p}\nAnswer:"),
                  rec(3, p, 1, False, 3, "kept", text=" 0", prompt_text=f"Q: {p}\nAnswer:")]
    return step1, step2, step3


def test_step_diagnostics_match_hand_counts():
    step1, step2, step3 = hand_ledger()
    metrics = [{"step": 1, "verifier/num_errors": 2.0}, {"step": 2, "rollout/reward_mean": 0.0}]
    s1, s2, s3 = compute_step_diagnostics(step1 + step2 + step3, metrics)
    assert (s1.step, s1.num_samples, s1.num_groups) == (1, 12, 3)
    assert s1.all_correct_group_rate == pytest.approx(1 / 3) and s1.all_wrong_group_rate == pytest.approx(1 / 3)
    # lengths sorted: 1 5 10 10 10 10 20 20 20 20 25 35
    assert s1.length_mean == pytest.approx(186 / 12)
    assert s1.length_p50 == pytest.approx(15.0)            # (10 + 20) / 2
    assert s1.length_p90 == pytest.approx(20 + 0.9 * 5)    # position 9.9 between 20 and 25
    assert s1.length_max == 35
    assert s1.truncation_rate == pytest.approx(1 / 12)
    assert s1.verifier_errors == 1 and s1.metrics_verifier_errors == 2.0
    assert s1.reward_mean == pytest.approx(0.0) and s1.pass_rate == pytest.approx(0.5)
    assert s1.reject_counts == {"all_correct_group": 4, "all_wrong_group": 4, "kept": 3, "verifier_error": 1}
    assert s2.num_groups == 2 and s2.all_correct_group_rate == 0.0 and s2.all_wrong_group_rate == 0.5
    assert s2.metrics_verifier_errors is None and s2.reject_counts == {"kept": 4, "stale": 4}
    assert s3.num_groups == 3 and s3.all_correct_group_rate == 0.0 and s3.all_wrong_group_rate == 0.0
    assert s3.length_p50 == pytest.approx(16.5) and s3.truncation_rate == 0.0


def test_age_buckets_match_hand_counts():
    step1, step2, step3 = hand_ledger()
    ages = {a.label: a for a in compute_age_buckets(step1 + step2 + step3)}
    # trained rows only (kept groups): A and B (uniform, rejected) and E (stale) are left out,
    # so age 0 is not pulled down by the all-wrong groups dynamic sampling drops
    assert list(ages) == ["0", "1"]
    assert ages["0"].num_samples == 10                     # C (step 1), F, G, H (step 3)
    assert ages["0"].pass_rate == pytest.approx(5 / 10) and ages["0"].reward_mean == pytest.approx(0.0)
    assert ages["1"].num_samples == 4 and ages["1"].pass_rate == 0.25 and ages["1"].reward_mean == -0.5


def test_exploit_flags():
    assert is_near_empty("", 1) and is_near_empty("\\boxed{}", 5) and is_near_empty("Answer: $$", 6)
    assert not is_near_empty(" 12", 3) and not is_near_empty("\\boxed{7}", 6)
    assert repeats_prompt("Q: 3+4 Answer: 7", "Q: 3+4\nAnswer:")
    assert repeats_prompt("what is the sum of the two numbers", "Q: what is the sum of the two numbers?")
    assert not repeats_prompt(" 7", "Q: 3+4\nAnswer:") and not repeats_prompt("The sum is seven.", "Q: 3+4\nAnswer:")
    step1, step2, step3 = hand_ledger()
    high = [r for r in step1 + step2 + step3 if r.correct]
    flags = {(r.step, r.prompt_id, r.sample_index): f for r, f in zip(high, flag_suspicious(high))}
    assert flags[(1, "C", 0)] == ["near_empty"] and flags[(1, "C", 1)] == ["near_empty"]
    assert flags[(2, "D", 0)] == ["repeats_prompt"]
    assert all(flags[(3, p, 0)] == ["copied"] for p in "FGH")
    assert all(flags[(1, "A", i)] == [] for i in range(4))      # short answers of one prompt: no flag
    # a short answer shared by many prompts ("12" is the answer of many sums) is not a copy
    many = [rec(1, f"P{i}", 0, True, 3, "kept", text=" 12") for i in range(10)]
    assert flag_suspicious(many) == [[] for _ in many]
    assert flag_suspicious(many, copy_min_chars=2) == [["copied"] for _ in many]


def test_stratified_sample():
    step1, step2, step3 = hand_ledger()
    records = step1 + step2 + step3
    sample, suspicious, n_high = sample_high_reward(records, per_stratum=100)
    assert n_high == 10 and len(sample) == 10                 # every high-reward response once
    assert sorted((s.step, s.prompt_id, s.sample_index) for s in suspicious) == \
        [(1, "C", 0), (1, "C", 1), (2, "D", 0), (3, "F", 0), (3, "G", 0), (3, "H", 0)]
    # steps 1..3 in three buckets of one step each; the lengths of the 10 responses
    # (1 5 10 10 10 10 16 30 30 30) cut at their tertiles (positions 3 and 6: 10 and 16)
    assert {(s.step, s.step_bucket, s.length_bucket) for s in sample} == \
        {(1, "1-1", "<= 10"), (2, "2-2", "(10, 16]"), (3, "3-3", "> 16")}
    one, _, _ = sample_high_reward(records, per_stratum=1)
    assert len(one) == 3                                      # one per stratum
    by_stratum = {s.step_bucket: s for s in one}
    assert by_stratum["1-1"].flags == ["near_empty"]          # flagged responses are drawn first
    assert by_stratum["2-2"].flags == ["repeats_prompt"] and by_stratum["3-3"].flags == ["copied"]
    two, _, _ = sample_high_reward(records, per_stratum=2, seed=5)
    assert sorted(s.sample_index for s in two if s.step == 1) == [0, 1]   # both near-empty before A's
    only_reward, _, n = sample_high_reward(records, min_reward=2.0)
    assert only_reward == [] and n == 0


def test_report_files_and_cli(tmp_path):
    run_dir = tmp_path / "run"
    for shard in hand_ledger():
        write_step(run_dir, shard[0].step, shard)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "verifier/num_errors": 2.0}) + "\n")
    report = build_report(run_dir)
    assert report.num_records == 26 and report.num_high_reward == 10
    assert report.reject_totals == {"all_correct_group": 4, "all_wrong_group": 4, "kept": 13, "stale": 4,
                                    "verifier_error": 1}
    assert report.flag_counts == {"copied": 3, "near_empty": 2, "repeats_prompt": 1}
    text = render_markdown(report)
    assert "| 1 | 12 | 3 | 0.333 | 0.333 | +0.000 | 0.500 | 15.5 | 15 | 24.5 | 35 | 0.083 | 1 / 2 |" in text
    paths = write_report(report, tmp_path / "direct")
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in paths["sample"].read_text().splitlines()]
    assert sum(1 for r in rows if r["flags"]) == 6

    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "ledger_report.py"), str(run_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "# Ledger report" in proc.stdout and "| 1 | 4 | -0.500 | 0.250 |" in proc.stdout and "| 3+ |" not in proc.stdout
    assert "Samples trained on only (kept groups" in proc.stdout
    assert (out / "ledger_report.md").read_text() == text
    assert (out / "ledger_report.png").stat().st_size > 1000
    empty = subprocess.run([sys.executable, str(REPO / "tools" / "ledger_report.py"), str(tmp_path / "none")],
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "no ledger shards" in empty.stdout
