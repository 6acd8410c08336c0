"""Soft overlong punishment (Eq. 13) and the dynamic-sampling group filter (Eq. 11)."""

import pytest
import torch

from dapo_mega.algo import (
    ALL_CORRECT_GROUP,
    ALL_WRONG_GROUP,
    KEPT,
    compute_overlong_penalty,
    select_informative_groups,
)


def test_overlong_penalty_small_numbers():
    # L_max = 20, L_cache = 4 → ramp starts after 16 tokens
    # |y|=10 → 0; 16 → 0; 17 → (16-17)/4 = -0.25; 18 → -0.5; 20 → -1; 21 (> L_max) → -1
    pen = compute_overlong_penalty([10, 16, 17, 18, 20, 21], max_response_length=20, overlong_buffer_length=4)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    # factor 0.5 halves every value
    half = compute_overlong_penalty(torch.tensor([17, 21]), 20, 4, penalty_factor=0.5)
    torch.testing.assert_close(half, torch.tensor([-0.125, -0.5]))


def test_overlong_penalty_paper_numbers():
    # L_max = 20480, L_cache = 4096 (expected max 16384): 18432 → (16384-18432)/4096 = -0.5
    pen = compute_overlong_penalty([16384, 18432, 20480], 20480, 4096)
    torch.testing.assert_close(pen, torch.tensor([0.0, -0.5, -1.0]))


def test_overlong_penalty_without_buffer_and_bad_args():
    pen = compute_overlong_penalty([5, 20, 21], 20, 0)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -1.0]))
    with pytest.raises(ValueError):
        compute_overlong_penalty([1], 4, 8)


def test_group_filter_with_correctness():
    # g0: 2 correct of 3 → kept; g1: all correct (rewards differ by the overlong penalty,
    # still dropped: the filter is on accuracy); g2: all wrong; g3: singleton correct
    rewards = torch.tensor([1.0, 1.0, -1.0, 1.0, 0.5, -1.0, -1.0, 1.0])
    correct = torch.tensor([True, True, False, True, True, False, False, True])
    group = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])
    sel = select_informative_groups(rewards, group, correct=correct)
    assert sel.keep_mask.tolist() == [True, True, True, False, False, False, False, False]
    assert sel.num_all_correct == 2 and sel.num_all_wrong == 1
    assert sel.sample_reasons == [KEPT] * 3 + [ALL_CORRECT_GROUP] * 2 + [ALL_WRONG_GROUP] * 2 + [ALL_CORRECT_GROUP]


def test_group_filter_on_rewards_only():
    # g0 rewards [1, 1] uniform positive → all_correct; g1 [-1, -2] differ → kept;
    # g2 [-1, -1] uniform non-positive → all_wrong
    rewards = torch.tensor([1.0, 1.0, -1.0, -2.0, -1.0, -1.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2])
    keep, n_correct, n_wrong, reasons = select_informative_groups(rewards, group)
    assert keep.tolist() == [False, False, True, True, False, False]
    assert (n_correct, n_wrong) == (1, 1)
    assert reasons[0] == ALL_CORRECT_GROUP and reasons[4] == ALL_WRONG_GROUP


def test_group_filter_empty():
    sel = select_informative_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert sel.keep_mask.numel() == 0 and sel.num_all_correct == 0 and sel.num_all_wrong == 0
