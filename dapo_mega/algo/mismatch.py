"""The train/inference log-prob mismatch: how far the engine's log-probs of the tokens it
sampled are from the learner's log-probs of the same tokens.

For a response token o_t sampled by an engine, with Δ_t = log π_learner(o_t) − log π_engine(o_t)
and ρ_t = exp(Δ_t):

    mean |Δ|   token mean of |Δ_t|                       (nats)
    max |Δ|    largest |Δ_t|                             (nats)
    k3 KL      token mean of ρ_t − 1 − Δ_t, the k3 estimator (Schulman 2020) of
               KL(π_engine ‖ π_learner) under the engine's samples; ≥ 0, 0 when the two agree

A sample of age a (policy versions between the oldest weights that produced it and the
learner, `ScoredSample.age`) compares the learner at version v with the engine at v − a:
age 0 is pure numerics (kernels, dtype, packing), or a defect when it is large (weights that
did not arrive, a wrong conversion); older ages add the policy's own drift. So the
statistics are kept per age bucket: bucket k holds age k, the last bucket every age above.

Statistics travel as a [K, 4] float64 tensor (`MISMATCH_COLUMNS`) that adds up over
micro-batches and ranks (`merge_mismatch_stats`: sums add, the max takes the max) before
`summarize_mismatch` turns it into metrics. The same math compares an engine's and the
learner's log-probs of a fixed probe sequence after a weight sync (`driver/weight_probe.py`).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

MISMATCH_COLUMNS = ("tokens", "abs_sum", "abs_max", "k3_sum")
"""Columns of a mismatch statistics tensor: token count, Σ|Δ|, max |Δ|, Σ(ρ − 1 − Δ)."""

_LOG_RATIO_CLAMP = 20.0
"""|Δ| beyond 20 nats is clamped before exp() in k3 (float64 would not overflow, but one
garbage token must not turn the mean into inf); |Δ| itself is kept as is."""


def empty_mismatch_stats(num_age_buckets: int = 1) -> torch.Tensor:
    """[K, 4] zeros: the statistics of no token."""
    if num_age_buckets < 1:
        raise ValueError(f"num_age_buckets must be >= 1, got {num_age_buckets}")
    return torch.zeros(num_age_buckets, len(MISMATCH_COLUMNS), dtype=torch.float64)


@torch.no_grad()
def compute_mismatch_stats(
    learner_log_probs: torch.Tensor,
    engine_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    ages: Optional[torch.Tensor] = None,
    num_age_buckets: int = 1,
) -> torch.Tensor:
    """Mismatch statistics of the masked tokens, per age bucket.

    Args:
        learner_log_probs: [B, T] log π_learner of each sampled token.
        engine_log_probs: [B, T] log π_engine the engine reported for the same tokens.
        response_mask: [B, T]; tokens where it is 0 are left out (padding, prompt).
        ages: [B] int, each row's age in policy versions (None: all 0).
        num_age_buckets: K; row b goes to bucket min(ages[b], K − 1).

    Returns:
        [K, 4] float64: per bucket (tokens, Σ|Δ|, max |Δ|, Σ(ρ − 1 − Δ)) (`MISMATCH_COLUMNS`).
    """
    if learner_log_probs.shape != engine_log_probs.shape or learner_log_probs.shape != response_mask.shape:
        raise ValueError(f"shapes differ: learner {tuple(learner_log_probs.shape)}, engine "
                         f"{tuple(engine_log_probs.shape)}, mask {tuple(response_mask.shape)}")
    rows = learner_log_probs.shape[0]
    if ages is None:
        ages = torch.zeros(rows, dtype=torch.long)
    if ages.shape != (rows,):
        raise ValueError(f"ages must be [B] = [{rows}], got {tuple(ages.shape)}")
    if bool((ages < 0).any()):
        raise ValueError(f"ages must be >= 0, got {ages.tolist()}")
    stats = empty_mismatch_stats(num_age_buckets)
    mask = response_mask.bool().cpu()
    delta = (learner_log_probs.double() - engine_log_probs.double()).cpu()
    delta = torch.where(mask, delta, torch.zeros_like(delta))
    clamped = delta.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    k3 = torch.exp(clamped) - 1.0 - clamped
    bucket = ages.cpu().clamp(max=num_age_buckets - 1)
    for k in range(num_age_buckets):
        sel = mask & (bucket == k)[:, None]
        n = int(sel.sum())
        if n:
            stats[k] = torch.tensor([float(n), float(delta.abs()[sel].sum()), float(delta.abs()[sel].max()),
                                     float(k3[sel].sum())], dtype=torch.float64)
    return stats


def merge_mismatch_stats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The statistics of both token sets: counts and sums add, the max takes the larger."""
    if a.shape != b.shape:
        raise ValueError(f"cannot merge mismatch statistics of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    out = a + b
    out[:, 2] = torch.maximum(a[:, 2], b[:, 2])
    return out


def age_bucket_label(k: int, num_age_buckets: int) -> str:
    """`age_0`, `age_1`, ...; the last bucket `age_<k>plus` (it holds every older age)."""
    return f"age_{k}plus" if k == num_age_buckets - 1 and num_age_buckets > 1 else f"age_{k}"


def summarize_mismatch(stats: torch.Tensor, prefix: str = "mismatch") -> Dict[str, float]:
    """Metrics of a [K, 4] statistics tensor: over every token, then per age bucket that holds
    tokens (`age_bucket_label`). Keys (prefix "mismatch"):

        mismatch/tokens            tokens compared
        mismatch/logp_abs_mean     mean |Δ log p| (nats)
        mismatch/logp_abs_max      max |Δ log p| (nats)
        mismatch/k3_kl             k3 estimate of KL(π_engine ‖ π_learner)
        mismatch/age_0/...         the same four for age-0 tokens, and so on

    No key when no token was compared (an engine that returned no log-probs).
    """
    metrics: Dict[str, float] = {}
    total = stats.sum(0)
    total[2] = stats[:, 2].max()
    parts = [(prefix, total)] + [(f"{prefix}/{age_bucket_label(k, stats.shape[0])}", stats[k])
                                 for k in range(stats.shape[0])]
    for name, row in parts:
        n = float(row[0])
        if n <= 0:
            continue
        metrics.update({f"{name}/tokens": n, f"{name}/logp_abs_mean": float(row[1]) / n,
                        f"{name}/logp_abs_max": float(row[2]), f"{name}/k3_kl": float(row[3]) / n})
    return metrics
