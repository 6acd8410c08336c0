"""Dynamic sampling's group filter (DAPO paper §3.2, the constraint of Eq. 11).

    0 < |{o_i | is_equivalent(a, o_i)}| < G

A group whose G responses are all correct or all wrong has zero advantage everywhere
(Eq. 9) and so contributes no gradient; DAPO drops it and samples more prompts instead.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

KEPT = "kept"
ALL_CORRECT_GROUP = "all_correct_group"
ALL_WRONG_GROUP = "all_wrong_group"


class GroupSelection(NamedTuple):
    """Result of `select_informative_groups`.

    keep_mask: [N] bool, per *sample*: True for every response of a kept group.
    num_all_correct: groups dropped because every response is correct.
    num_all_wrong: groups dropped because every response is wrong.
    sample_reasons: per sample, "kept", "all_correct_group" or "all_wrong_group" (the
        ledger's reject reasons).
    """

    keep_mask: torch.Tensor
    num_all_correct: int
    num_all_wrong: int
    sample_reasons: List[str]


def select_informative_groups(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    correct: Optional[torch.Tensor] = None,
    atol: float = 1e-6,
) -> GroupSelection:
    """Keep the groups whose responses are neither all correct nor all wrong (Eq. 11).

    Args:
        rewards: [N] float rewards.
        group_index: [N] int group (prompt) of each response.
        correct: [N] bool correctness from the verifier. When given, it decides (the
            reference recipe filters on accuracy): a group is kept iff 0 < #correct < G,
            so a group of all-correct answers whose rewards differ only by the overlong
            penalty is still dropped as all_correct. When None, a group is kept iff its
            rewards are not all equal (within `atol`); a uniform group counts as
            all_correct when its reward is > 0, otherwise all_wrong.
        atol: tolerance of "all rewards equal" in the reward-only rule.

    Returns:
        GroupSelection with a per-sample keep mask. A group of one response is always
        uniform, hence dropped.
    """
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError("rewards and group_index must both be [N]")
    n = rewards.numel()
    keep = torch.zeros(n, dtype=torch.bool, device=rewards.device)
    reasons = [KEPT] * n
    if n == 0:
        return GroupSelection(keep, 0, 0, reasons)
    if correct is not None and correct.shape != rewards.shape:
        raise ValueError("correct must be [N] like rewards")
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    counts = torch.zeros(num_groups, dtype=torch.long, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(inverse))
    if correct is not None:
        num_correct = torch.zeros_like(counts).index_add_(0, inverse, correct.long())
        group_all_correct = num_correct == counts
        group_all_wrong = num_correct == 0
    else:
        r = rewards.detach().double()
        gmax = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(
            0, inverse, r, reduce="amax")
        gmin = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(
            0, inverse, r, reduce="amin")
        uniform = (gmax - gmin) <= atol
        group_all_correct = uniform & (gmax > 0)
        group_all_wrong = uniform & ~(gmax > 0)
    group_keep = ~(group_all_correct | group_all_wrong)
    keep = group_keep[inverse]
    all_correct_list = group_all_correct.tolist()
    for i, (g, k) in enumerate(zip(inverse.tolist(), keep.tolist())):
        if not k:
            reasons[i] = ALL_CORRECT_GROUP if all_correct_list[g] else ALL_WRONG_GROUP
    return GroupSelection(keep, int(group_all_correct.sum()), int(group_all_wrong.sum()), reasons)
