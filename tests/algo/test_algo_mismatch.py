"""The engine/learner log-prob mismatch (algo/mismatch.py) against values worked by hand."""

import math

import pytest
import torch

from dapo_mega.algo import compute_mismatch_stats, empty_mismatch_stats, merge_mismatch_stats, summarize_mismatch

# Row 0 (age 0): Δ = learner - engine = [0.5, 0.0, -0.2]
# Row 1 (age 3, the last of 2 buckets): Δ = [-0.8, 0.0], its third token masked out (garbage there)
LEARNER = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
ENGINE = torch.tensor([[-1.5, -2.0, -0.3], [-0.2, -1.0, -60.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
AGES = torch.tensor([0, 3])


def k3(d):
    return math.exp(d) - 1.0 - d


def test_statistics_by_age_bucket_by_hand():
    stats = compute_mismatch_stats(LEARNER, ENGINE, MASK, AGES, num_age_buckets=2)
    assert stats.shape == (2, 4) and stats.dtype == torch.float64
    assert stats[0].tolist() == pytest.approx([3, 0.7, 0.5, k3(0.5) + k3(0.0) + k3(-0.2)], abs=1e-6)
    assert stats[1].tolist() == pytest.approx([2, 0.8, 0.8, k3(-0.8)], abs=1e-6)


def test_summary_by_hand():
    m = summarize_mismatch(compute_mismatch_stats(LEARNER, ENGINE, MASK, AGES, num_age_buckets=2))
    k3_young, k3_old = k3(0.5) + k3(-0.2), k3(-0.8)          # 0.16745202, 0.24932896
    assert m["mismatch/tokens"] == 5
    assert m["mismatch/logp_abs_mean"] == pytest.approx(1.5 / 5)
    assert m["mismatch/logp_abs_max"] == pytest.approx(0.8)
    assert m["mismatch/k3_kl"] == pytest.approx((k3_young + k3_old) / 5)  # 0.08335620
    assert m["mismatch/age_0/logp_abs_mean"] == pytest.approx(0.7 / 3)
    assert m["mismatch/age_0/logp_abs_max"] == pytest.approx(0.5)
    assert m["mismatch/age_0/k3_kl"] == pytest.approx(0.16745202 / 3, abs=1e-7)
    assert m["mismatch/age_1plus/tokens"] == 2 and m["mismatch/age_1plus/logp_abs_mean"] == pytest.approx(0.4)
    assert m["mismatch/age_1plus/k3_kl"] == pytest.approx(0.24932896 / 2, abs=1e-7)


def test_one_bucket_holds_every_age_and_empty_buckets_have_no_keys():
    m = summarize_mismatch(compute_mismatch_stats(LEARNER, ENGINE, MASK, AGES, num_age_buckets=4))
    assert {k.split("/")[1] for k in m if k.count("/") == 2} == {"age_0", "age_3plus"}
    one = summarize_mismatch(compute_mismatch_stats(LEARNER, ENGINE, MASK, AGES))
    assert one["mismatch/age_0/tokens"] == 5 and one["mismatch/age_0/logp_abs_mean"] == pytest.approx(0.3)
    assert summarize_mismatch(empty_mismatch_stats(3)) == {}


def test_merge_adds_sums_and_keeps_the_larger_max():
    a = compute_mismatch_stats(LEARNER[:1], ENGINE[:1], MASK[:1], AGES[:1], 2)
    b = compute_mismatch_stats(LEARNER[1:], ENGINE[1:], MASK[1:], AGES[1:], 2)
    both = compute_mismatch_stats(LEARNER, ENGINE, MASK, AGES, 2)
    assert torch.allclose(merge_mismatch_stats(a, b), both)
    # two parts in one bucket: counts and sums add, the max is the larger one (not the sum)
    c = compute_mismatch_stats(LEARNER[:1], ENGINE[:1], MASK[:1], None, 1)
    merged = merge_mismatch_stats(c, c)
    assert merged[0].tolist() == pytest.approx([6, 1.4, 0.5, 2 * (k3(0.5) + k3(-0.2))], abs=1e-6)


def test_garbage_is_finite_and_shapes_are_checked():
    huge = compute_mismatch_stats(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), torch.tensor([[1]]))
    assert huge[0, 1] == pytest.approx(1e4) and math.isfinite(float(huge[0, 3]))  # k3 clamped, |Δ| kept
    with pytest.raises(ValueError, match="shapes differ"):
        compute_mismatch_stats(LEARNER, ENGINE[:, :2], MASK)
    with pytest.raises(ValueError, match="ages must be"):
        compute_mismatch_stats(LEARNER, ENGINE, MASK, torch.tensor([0, -1]))
