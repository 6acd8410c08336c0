"""Per-step rollout metrics computed from ledger records, against hand counts."""

import math

from dapo_mega.records.ledger import LedgerRecord
from dapo_mega.rollout.metrics import compute_age_metrics, compute_rollout_metrics


def rec(pid, correct, reason, length=3, truncated=False, age=0, rnd=0):
    return LedgerRecord(run_id="r", step=1, prompt_id=pid, dataset_revision="x", sample_index=0, seed=None,
                        policy_version_min=0, policy_version_max=0, learner_version=age, age=age, engine_id="e",
                        queue_delay_s=0.0, generation_latency_s=0.0, response_length=length, truncated=truncated,
                        reward=1.0 if correct else -1.0, correct=correct, reward_components="{}", verifier="dapo",
                        verifier_version="1", reject_reason=reason, response_text="", prompt_text="", gen_round=rnd)


def test_group_rates_lengths_and_reasons():
    records = [rec("a", True, "all_correct_group"), rec("a", True, "all_correct_group"),
               rec("b", False, "all_wrong_group", length=10, truncated=True), rec("b", False, "all_wrong_group"),
               rec("c", True, "kept", length=1), rec("c", False, "kept", length=5),
               rec("d", False, "kept"), rec("d", True, "verifier_error")]
    m = compute_rollout_metrics(records, seconds=2.0)
    # 4 groups: a all correct, b all wrong, c and d mixed -> kept.
    assert m["rollout/all_correct_rate"] == 0.25 and m["rollout/all_wrong_rate"] == 0.25
    assert m["rollout/kept_group_frac"] == 0.5
    # 4 correct of 8; rewards +1 x4, -1 x4.
    assert m["rollout/accuracy"] == 0.5 and m["rollout/reward_mean"] == 0.0
    # lengths 3,3,10,3,1,5,3,3 -> sum 31, mean 3.875, max 10; one truncated of 8.
    assert m["rollout/generated_tokens"] == 31 and math.isclose(m["rollout/response_length_mean"], 3.875)
    assert m["rollout/response_length_max"] == 10 and m["rollout/clip_rate"] == 0.125
    assert m["rollout/tokens_per_s"] == 15.5
    # trained: 4 samples of c and d; generated per trained = 8 / 4.
    assert m["rollout/kept_samples"] == 4 and m["rollout/samples_per_trained_sample"] == 2.0
    assert m["rollout/reject/all_correct_group"] == 2 and m["rollout/verifier_errors"] == 1


def test_age_buckets():
    records = [rec("a", True, "kept", age=0), rec("a", False, "kept", age=0), rec("b", True, "kept", age=1),
               rec("c", False, "stale", age=4), rec("d", True, "all_correct_group", age=1)]
    m = compute_age_metrics(records, num_stale_groups=1)
    assert m["age/0/num_samples"] == 2 and m["age/0/accuracy"] == 0.5
    assert m["age/1/num_samples"] == 1 and m["age/1/reward_mean"] == 1.0
    assert m["age/3+/num_samples"] == 1 and m["rollout/age_max"] == 4
    assert m["rollout/stale_groups"] == 1


def test_rollout_entropy_estimate_is_minus_mean_logprob_over_tokens():
    from types import SimpleNamespace

    from dapo_mega.rollout.metrics import rollout_entropy_estimate

    # tokens weigh equally: (-(-0.5 - 1.5) - (-1.0)) / 3 = 1.0, not the mean of per-sample means
    samples = [SimpleNamespace(logprobs=[-0.5, -1.5]), SimpleNamespace(logprobs=[-1.0]), SimpleNamespace(logprobs=None)]
    assert math.isclose(rollout_entropy_estimate(samples), 1.0)
    assert rollout_entropy_estimate([SimpleNamespace(logprobs=None)]) is None
    # ledger records carry no log-probs: no key rather than a made-up value
    assert "rollout/entropy_mc" not in compute_rollout_metrics([rec("a", True, "kept")], seconds=1.0)


def test_rollout_entropy_estimate_converges_to_the_sampling_entropy():
    from types import SimpleNamespace

    import numpy as np

    from dapo_mega.rollout.metrics import rollout_entropy_estimate

    p = np.array([0.5, 0.25, 0.125, 0.125])  # entropy = 1.75 bits = 1.2130 nats
    draws = np.random.default_rng(0).choice(4, size=200_000, p=p)
    estimate = rollout_entropy_estimate([SimpleNamespace(logprobs=list(np.log(p[draws])))])
    assert abs(estimate - float(-(p * np.log(p)).sum())) < 0.01


def test_accuracy_counts_verdicts_only_and_the_step_line_says_when_there_are_none():
    """A bare score is no verdict (issue #37, item 7): accuracy and the all-correct /
    all-wrong rates count verdicts only; a step without any prints no acc and says so."""
    from dataclasses import replace

    from dapo_mega.records.console import format_console_line

    scored = [replace(rec("a", None, "kept"), reward=0.1), replace(rec("a", None, "kept"), reward=0.0)]
    m = compute_rollout_metrics(scored, seconds=1.0)
    assert "rollout/accuracy" not in m and m["rollout/verdict_rate"] == 0.0
    assert m["rollout/all_correct_rate"] == 0.0 and m["rollout/all_wrong_rate"] == 0.0
    line = format_console_line({"step": 1, **m, "rollout/score_filtered_groups": 1.0})
    assert " acc " not in line and "verdicts 0.00, filter on score" in line, line
    mixed = compute_rollout_metrics(scored + [rec("b", True, "kept"), rec("b", False, "kept")], seconds=1.0)
    assert mixed["rollout/accuracy"] == 0.5 and mixed["rollout/verdict_rate"] == 0.5
    assert "acc 0.500" in format_console_line({"step": 1, **mixed}) and "verdicts 0.50" in \
        format_console_line({"step": 1, **mixed})
