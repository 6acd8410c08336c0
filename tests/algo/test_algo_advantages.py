"""Group-relative advantages (DAPO Eq. 9) against hand-worked values."""

import math

import pytest
import torch

from dapo_mega.algo import compute_group_advantages


def test_mixed_group_uses_unbiased_std():
    # group 0: R = [1, -1, -1, 1]; mean 0; Σ(R-mean)^2 = 4; unbiased var = 4/3
    # std = sqrt(4/3) = 1.154700538; A = ±1/1.154700538 = ±0.866025404
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0])
    group = torch.tensor([0, 0, 0, 0])
    adv = compute_group_advantages(rewards, group, eps=0.0)
    expected = torch.tensor([1.0, -1.0, -1.0, 1.0]) / math.sqrt(4.0 / 3.0)
    torch.testing.assert_close(adv, expected)


def test_unequal_group_three_members():
    # R = [1, -1, -1]; mean = -1/3; deviations 4/3, -2/3, -2/3
    # Σdev^2 = 16/9 + 4/9 + 4/9 = 8/3; unbiased var = (8/3)/2 = 4/3; std = 1.154700538
    # A = (4/3)/1.1547 = 1.154700538, (-2/3)/1.1547 = -0.577350269
    adv = compute_group_advantages(torch.tensor([1.0, -1.0, -1.0]), torch.tensor([5, 5, 5]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.154700538, -0.577350269, -0.577350269]))


def test_all_equal_group_and_singleton_are_zero():
    # group 1: [1, 1] → centred 0, std 0 → 0/(0+eps) = 0; group 2 has one member → 0
    rewards = torch.tensor([1.0, 1.0, -1.0, -2.0, -2.0])
    group = torch.tensor([1, 1, 2, 3, 3])
    adv = compute_group_advantages(rewards, group)
    assert torch.equal(adv, torch.zeros(5))
    assert torch.isfinite(adv).all()


def test_non_contiguous_group_ids_and_eps():
    # groups 7: [2, 0] and 3: [1, 3]; each: mean ±1 away, unbiased std = sqrt(2) = 1.414213562
    # A_7 = [1, -1]/(sqrt2 + 0.5) = ±0.522407749 ; A_3 = [-1, 1]/(sqrt2+0.5)
    rewards = torch.tensor([2.0, 1.0, 0.0, 3.0])
    group = torch.tensor([7, 3, 7, 3])
    adv = compute_group_advantages(rewards, group, eps=0.5)
    a = 1.0 / (math.sqrt(2.0) + 0.5)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a]))


def test_without_std_normalisation():
    # R - mean only: [1, -1, -1] → mean -1/3 → [4/3, -2/3, -2/3]
    adv = compute_group_advantages(torch.tensor([1.0, -1.0, -1.0]), torch.zeros(3, dtype=torch.long),
                                   normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([4 / 3, -2 / 3, -2 / 3]))


def test_integer_rewards_empty_input_and_shape_check():
    adv = compute_group_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), eps=0.0)
    # mean 0.5, unbiased std = sqrt(0.5) → ±0.5/0.70710678 = ±0.70710678
    torch.testing.assert_close(adv, torch.tensor([0.70710678, -0.70710678]))
    assert compute_group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0
    with pytest.raises(ValueError):
        compute_group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
