"""Soft overlong punishment (DAPO paper §3.4, Eq. 13).

    R_length(y) = 0                              if |y| ≤ L_max − L_cache
                = ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| ≤ L_max
                = −1                             if L_max < |y|

It is *added* to the correctness reward (±1), so a truncated wrong answer scores −2.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch


def compute_overlong_penalty(
    response_lengths: Union[torch.Tensor, Sequence[int]],
    max_response_length: int,
    overlong_buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Length penalty of each response (DAPO Eq. 13), scaled by `penalty_factor`.

    Args:
        response_lengths: [N] response lengths |y| in tokens.
        max_response_length: L_max.
        overlong_buffer_length: L_cache, the length of the linear ramp before L_max.
            0 means no ramp: 0 up to L_max, −factor beyond.
        penalty_factor: multiplies the penalty (1.0 in the paper).

    Returns:
        [N] float32 penalties in [−penalty_factor, 0]. A response of exactly L_max tokens
        (what an engine returns when it truncates) gets −penalty_factor.
    """
    lengths = torch.as_tensor(response_lengths, dtype=torch.float64)
    if lengths.dim() != 1:
        raise ValueError(f"response_lengths must be [N], got shape {tuple(lengths.shape)}")
    if overlong_buffer_length < 0 or max_response_length < overlong_buffer_length:
        raise ValueError(f"need 0 <= overlong_buffer_length ({overlong_buffer_length}) <= "
                         f"max_response_length ({max_response_length})")
    expected = max_response_length - overlong_buffer_length
    if overlong_buffer_length > 0:
        ramp = (expected - lengths) / overlong_buffer_length
    else:
        ramp = torch.zeros_like(lengths)
    penalty = torch.clamp(ramp, max=0.0)
    # beyond L_max the paper's third case; the ramp alone would go below −1.
    penalty = torch.where(lengths > max_response_length, torch.full_like(penalty, -1.0), penalty)
    return (penalty * penalty_factor).to(torch.float32)
