"""Off-policy correction weights (algo/off_policy.py) against values worked by hand.

One batch of 4 sequences x 3 tokens; the engine's log-probs are all −1 and the learner's
are −1 + Δ, so the log-ratio Δ_t = log π_old − log π_engine of each token is written out:

    row 0  Δ = [ 0.2, −0.1, 0.3]          Σ = 0.4    mean = 0.1333
    row 1  Δ = [−0.9,  0.1, (5.0 padding)] Σ = −0.8   mean = −0.4
    row 2  Δ = [ 0.5,  0.5, 1.7]          Σ = 2.7    mean = 0.9
    row 3  Δ = [−0.03, 0.0, 0.0]          Σ = −0.03  mean = −0.01

exp values used below: e^0.2 = 1.2214027582, e^−0.1 = 0.9048374180, e^0.3 = 1.3498588076,
e^−0.9 = 0.4065696597, e^0.1 = 1.1051709181, e^0.5 = 1.6487212707, e^1.7 = 5.4739473917,
e^0.4 = 1.4918246976, e^−0.03 = 0.9704455335; log 0.99 = −0.0100503359.
"""

import pytest
import torch

from dapo_mega.algo import (
    compute_correction_stats,
    compute_off_policy_weights,
    compute_policy_loss,
    summarize_correction,
)
from dapo_mega.algo.off_policy import (
    compute_geo_mask_weights,
    compute_icepop_weights,
    compute_mis_weights,
    compute_tis_weights,
)

F64 = torch.float64
DELTA = torch.tensor([[0.2, -0.1, 0.3], [-0.9, 0.1, 5.0], [0.5, 0.5, 1.7], [-0.03, 0.0, 0.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
ENGINE = torch.full((4, 3), -1.0, dtype=F64)
LEARNER = ENGINE + DELTA


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=F64), atol=1e-9, rtol=0)


def test_tis_truncates_each_token_at_the_cap():
    # min(e^Δ, 2): row 2's e^1.7 = 5.47 -> 2; padding -> 1
    close(compute_tis_weights(LEARNER, ENGINE, 2.0, MASK),
          [[1.2214027582, 0.9048374180, 1.3498588076], [0.4065696597, 1.1051709181, 1.0],
           [1.6487212707, 1.6487212707, 2.0], [0.9704455335, 1.0, 1.0]])


def test_mis_weights_kept_sequences_by_their_product_and_masks_the_others():
    # bounds [0.5, 2]: row 0 ρ = e^0.4 = 1.49 kept; row 1 e^−0.8 = 0.449 < 0.5 masked;
    # row 2 e^2.7 = 14.9 > 2 masked; row 3 e^−0.03 = 0.970 kept. Padding stays 1.
    close(compute_mis_weights(LEARNER, ENGINE, MASK, 0.5, 2.0),
          [[1.4918246976] * 3, [0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.9704455335] * 3])
    # the padding token's Δ = 5 is no part of row 1's product: with it row 1 would be e^4.2
    # and still masked, so widen the bounds to [0.4, 2]: e^−0.8 = 0.449 is now kept
    close(compute_mis_weights(LEARNER, ENGINE, MASK, 0.4, 2.0)[1], [0.4493289641, 0.4493289641, 1.0])


def test_geo_mask_keeps_only_sequences_whose_mean_log_ratio_is_in_bounds():
    # bounds [0.99, 1.01] = log [−0.01005, 0.00995]: only row 3 (mean −0.01) is inside;
    # no importance weight: 1 or 0
    close(compute_geo_mask_weights(LEARNER, ENGINE, MASK, 0.99, 1.01),
          [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    # row 1's mean is over its 2 response tokens: e^−0.4 = 0.670 (over 3 with the padding
    # as 0 it would be e^−0.267 = 0.766, kept by [0.68, 1.5])
    close(compute_geo_mask_weights(LEARNER, ENGINE, MASK, 0.65, 1.5)[1], [1.0, 1.0, 1.0])  # e^−0.4 = 0.670
    close(compute_geo_mask_weights(LEARNER, ENGINE, MASK, 0.68, 1.5)[1], [0.0, 0.0, 1.0])  # 0.670 < 0.68


def test_geo_mask_tis_is_the_geometric_mask_times_the_truncated_token_weight():
    # verl rollout_is=token (C 2) + rollout_rs=geometric: bounds [0.65, 1.5] keep rows 0
    # (mean 0.133: e^0.133 = 1.143), 1 (e^−0.4 = 0.670) and 3; row 2 (e^0.9 = 2.46) is masked.
    # A kept row's tokens weigh min(e^Δ, 2); padding stays 1.
    close(compute_off_policy_weights("geo_mask_tis", LEARNER, ENGINE, MASK, tis_cap=2.0, low=0.65, high=1.5),
          [[1.2214027582, 0.9048374180, 1.3498588076], [0.4065696597, 1.1051709181, 1.0],
           [0.0, 0.0, 0.0], [0.9704455335, 1.0, 1.0]])
    with pytest.raises(ValueError, match="tis_cap"):
        compute_off_policy_weights("geo_mask_tis", LEARNER, ENGINE, MASK, low=0.65, high=1.5)


def test_icepop_weights_tokens_inside_the_band_by_their_ratio():
    # bounds [0.5, 5]: e^−0.9 = 0.407 and e^1.7 = 5.47 are dropped, the rest keep e^Δ
    close(compute_icepop_weights(LEARNER, ENGINE, MASK, 0.5, 5.0),
          [[1.2214027582, 0.9048374180, 1.3498588076], [0.0, 1.1051709181, 1.0],
           [1.6487212707, 1.6487212707, 0.0], [0.9704455335, 1.0, 1.0]])


def test_a_ratio_at_a_bound_is_kept_and_huge_ratios_do_not_overflow():
    at_bound = torch.log(torch.tensor([[2.0, 0.5]], dtype=F64))
    zero = torch.zeros(1, 2, dtype=F64)
    close(compute_icepop_weights(at_bound, zero, torch.ones(1, 2), 0.5, 2.0), [[2.0, 0.5]])
    huge = torch.tensor([[1000.0, -1000.0]], dtype=F64)
    for mode in ("mis", "geo_mask", "icepop"):
        w = compute_off_policy_weights(mode, huge, zero, torch.ones(1, 2), low=0.5, high=2.0)
        assert torch.isfinite(w).all() and not w.requires_grad, mode
    assert compute_off_policy_weights("none", huge, zero, torch.ones(1, 2)) is None


def test_dispatcher_and_bad_arguments():
    w = compute_off_policy_weights("icepop", LEARNER, ENGINE, MASK, low=0.5, high=5.0)
    torch.testing.assert_close(w, compute_icepop_weights(LEARNER, ENGINE, MASK, 0.5, 5.0))
    with pytest.raises(ValueError, match="tis_cap"):
        compute_off_policy_weights("tis", LEARNER, ENGINE, MASK)
    with pytest.raises(ValueError, match="unknown"):
        compute_off_policy_weights("seq_tis", LEARNER, ENGINE, MASK, low=0.5, high=2.0)
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        compute_mis_weights(LEARNER, ENGINE, MASK, 1.2, 2.0)


def test_correction_statistics_by_age():
    # icepop [0.5, 5] masks row 1 token 0 and row 2 token 2; ages [0, 1, 1, 3] with K = 2
    # buckets: age_0 = row 0; age_1plus = rows 1, 2, 3
    w = compute_icepop_weights(LEARNER, ENGINE, MASK, 0.5, 5.0)
    stats = compute_correction_stats(w, MASK, torch.tensor([0, 1, 1, 3]), num_age_buckets=2)
    # columns: tokens, masked tokens, Σ weight, sequences, sequences with a masked token
    close(stats, [[3, 0, 3.4760989838, 1, 0],
                  [8, 2, 0.0 + 1.1051709181 + 1.6487212707 * 2 + 0.9704455335 + 2.0, 3, 2]])
    m = summarize_correction(stats)
    assert m["off_policy/masked_token_frac"] == pytest.approx(2 / 11)
    assert m["off_policy/masked_seq_frac"] == pytest.approx(2 / 4)
    assert m["off_policy/age_0/masked_token_frac"] == 0.0
    assert m["off_policy/age_0/weight_mean"] == pytest.approx(3.4760989838 / 3)
    assert m["off_policy/age_1plus/masked_token_frac"] == pytest.approx(2 / 8)
    assert m["off_policy/age_1plus/masked_seq_frac"] == pytest.approx(2 / 3)
    # statistics add up over parts of the batch (micro-batches, ranks)
    parts = [compute_correction_stats(w[r:r + 2], MASK[r:r + 2], torch.tensor([0, 1, 1, 3])[r:r + 2], 2)
             for r in (0, 2)]
    close(parts[0] + parts[1], stats.tolist())
    assert summarize_correction(compute_correction_stats(w, torch.zeros_like(MASK))) == {}


def test_masked_sequences_carry_no_loss_and_no_gradient():
    # ratio 1 (log_probs = old), A = 1 on every row, token-mean over D = 11 tokens:
    # ℓ_t = −w_t; mis [0.5, 2] keeps rows 0 (w = 1.4918246976) and 3 (w = 0.9704455335):
    # L = −(3·1.4918246976 + 3·0.9704455335) / 11 = −0.6715282448
    w = compute_mis_weights(LEARNER, ENGINE, MASK, 0.5, 2.0)
    lp = LEARNER.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(lp, LEARNER, torch.ones(4, dtype=F64), MASK, global_num_tokens=11, tis_weights=w)
    loss.backward()
    assert loss.item() == pytest.approx(-0.6715282448)
    # ∂L/∂log p = −A·r·w / D: rows 1 and 2 (masked) get 0
    close(lp.grad, [[-1.4918246976 / 11] * 3, [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-0.9704455335 / 11] * 3])
