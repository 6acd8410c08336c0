"""Group-relative advantages (GRPO / DAPO, no critic).

DAPO paper (arXiv 2503.14476) Eq. 9:

    Â_i,t = (R_i − mean({R_j}_{j=1..G})) / std({R_j}_{j=1..G})

the same value for every token t of response o_i. The std is the *unbiased* sample std
(divides by G−1), as `torch.std` in the verl reference recipe computes it; ε is added to it
so that a group of equal rewards (std 0) gives advantage 0 instead of 0/0.
"""

from __future__ import annotations

import torch


def compute_group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> torch.Tensor:
    """Group-relative advantage of each response (DAPO Eq. 9).

    Args:
        rewards: [N] float, the scalar reward R_i of each response.
        group_index: [N] int, the prompt (group) each response belongs to; any integer ids,
            groups need not be contiguous or equally sized.
        eps: added to the group std before dividing.
        normalize_std: divide by (std + eps) as GRPO/DAPO do; False keeps R − mean only
            (Dr. GRPO style).

    Returns:
        [N] float advantages, in the dtype of `rewards` (float32 when rewards are integer).
        std is the unbiased sample std (÷ (G−1)), matching `torch.std` in verl. A group
        of one response has no baseline to compare against and gets advantage 0.
    """
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must both be [N]")
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    if rewards.numel() == 0:
        return rewards.clone()
    # float64 accumulation: sums of many ±1 rewards must not lose the mean's precision.
    r64 = rewards.detach().double()
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    counts = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(r64))
    sums = torch.zeros_like(counts).index_add_(0, inverse, r64)
    means = sums / counts
    centred = r64 - means[inverse]
    if normalize_std:
        sq = torch.zeros_like(counts).index_add_(0, inverse, centred * centred)
        # unbiased variance; groups of one are zeroed below, clamp avoids 0/0 there.
        std = (sq / (counts - 1).clamp(min=1)).sqrt()
        centred = centred / (std[inverse] + eps)
    singleton = counts[inverse] == 1
    centred = torch.where(singleton, torch.zeros_like(centred), centred)
    return centred.to(rewards.dtype)
