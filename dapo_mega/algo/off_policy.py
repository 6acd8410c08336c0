"""Off-policy correction: per-token weights for the engine/learner mismatch.

The engine sampled every response token o_t from π_engine; the loss's old policy is the
learner's π_old (recomputed on the learner: another kernel, dtype or packing, and in
asynchronous mode weights up to `max_staleness` versions newer). With

    Δ_t = log π_old(o_t) − log π_engine(o_t),     ρ_t = exp(Δ_t)

each mode gives every response token a weight w_t ≥ 0 (detached) that multiplies its
clipped DAPO loss (`compute_policy_loss(tis_weights=...)`); w_t = 0 masks the token:

    none      w_t = 1
    tis       w_t = min(ρ_t, C)                              token-level truncated IS
    mis       w_t = ρ_seq · 1[lo ≤ ρ_seq ≤ hi],  ρ_seq = exp(Σ_t Δ_t)
                                                             sequence-level masked IS
    geo_mask  w_t = 1[lo ≤ ρ_geo ≤ hi],          ρ_geo = exp((1/|o|) Σ_t Δ_t)
                                                             geometric-mean sequence mask
    icepop    w_t = ρ_t · 1[lo ≤ ρ_t ≤ hi]                   token mask (IcePop)
    geo_mask_tis
              w_t = 1[lo ≤ ρ_geo ≤ hi] · min(ρ_t, C)         geometric sequence mask
                                                             times token-level TIS

Sources of each convention:

* tis: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"; verl `rollout_is=token` with `rollout_is_threshold`.
* mis: verl's Seq-MIS preset `decoupled_seq_is_rs` (`rollout_is=sequence` with threshold
  2.0 plus `rollout_rs=seq_sum_k1` with bounds "0.5_2.0": the sequence ratio is the weight,
  and a sequence outside the bounds is rejected rather than truncated; inside them the
  truncation at 2.0 never bites). verl docs/algo/rollout_corr_math.md §3.3.2 "Seq-MIS:
  rejects (masks) sequences with ρ(τ) > C instead of clipping". SkyRL's product mask.
* geo_mask: verl `rollout_rs=seq_mean_k1` (Geo-RS, §3.3.3, no IS weight: a pure mask that
  does not fall into the "length trap" of the product over 20k tokens); SkyRL
  `sequence_mask_metric=geometric` with `geo_mask_low/high` (defaults 0.99 / 1.01, ours).
* geo_mask_tis: verl's rollout correction with both parts, `rollout_is=token` (threshold C)
  and `rollout_rs=geometric` (bounds lo / hi): the rejection mask times the truncated token
  weight, verl's "IS weights" and "rejection sampling" applied together.
* icepop: Ring-1T (arXiv 2510.18855) IcePop, M(k) = k if k ∈ [α, β] else 0 (α 0.5, β 5):
  the ratio weights the token inside the band, and the token is dropped outside it.

Bounds are inclusive (a ratio exactly at a bound is kept, as in verl and SkyRL). Ratios are
compared in log space, so nothing overflows; Δ is clamped to ±20 nats before exp, as verl
does. Positions outside `response_mask` get weight 1 (neutral; the loss masks them).

The denominator: by default a masked token keeps its place in the token-mean denominator
(Eq. 12 of DAPO), a weight of 0, as IcePop's equation (which keeps the 1/|o_i|
normalisation) and TIS's truncation write it; the update is scaled by the kept fraction,
which `off_policy/masked_token_frac` reports. `algo.masked_tokens_in_denominator=false`
leaves it out, as verl and slime do (the rejected token leaves the loss mask): the mini-batch's
denominator is fixed before the forward pass that computes π_old, so the learner scales the
accumulated gradient by all / kept tokens instead (`MegatronLearner._leave_masked_tokens_out`).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from dapo_mega.algo.mismatch import age_bucket_label

OFF_POLICY_MODES = ("none", "tis", "mis", "geo_mask", "icepop", "geo_mask_tis")

_LOG_RATIO_CLAMP = 20.0


def _log_ratio(learner_log_probs: torch.Tensor, engine_log_probs: torch.Tensor,
               response_mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Δ (0 off the mask, float64 for exact sums) and the bool mask."""
    if learner_log_probs.shape != engine_log_probs.shape:
        raise ValueError(f"learner log-probs {tuple(learner_log_probs.shape)} and engine log-probs "
                         f"{tuple(engine_log_probs.shape)} must have the same [B, T] shape")
    mask = torch.ones_like(learner_log_probs, dtype=torch.bool) if response_mask is None else response_mask.bool()
    delta = (learner_log_probs.detach().double() - engine_log_probs.detach().double())
    return torch.where(mask, delta, torch.zeros_like(delta)), mask


def _check_bounds(low: float, high: float) -> Tuple[float, float]:
    if not 0 < low <= 1.0 <= high:
        raise ValueError(f"bounds must satisfy 0 < low <= 1 <= high, got [{low}, {high}]")
    return math.log(low), math.log(high)


def _finish(weights: torch.Tensor, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Weight 1 off the mask, in `like`'s dtype, detached."""
    weights = torch.where(mask, weights, torch.ones_like(weights))
    return weights.to(like.dtype).detach()


def compute_tis_weights(
    train_log_probs: torch.Tensor,
    engine_log_probs: torch.Tensor,
    cap: float,
    response_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """tis: w_t = min(ρ_t, cap) = exp(min(Δ_t, log cap)) (truncated importance sampling).

    Args:
        train_log_probs: [B, T] old-policy log-probs recomputed by the learner.
        engine_log_probs: [B, T] log-probs the rollout engine reported when sampling.
        cap: truncation C (> 0), e.g. 2.0.
        response_mask: optional [B, T]; masked positions get weight 1.0.

    Returns:
        [B, T] weights in `train_log_probs`' dtype, detached (constants of the loss).
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    delta, mask = _log_ratio(train_log_probs, engine_log_probs, response_mask)
    return _finish(torch.exp(torch.clamp(delta, max=math.log(cap))), mask, train_log_probs)


def compute_mis_weights(learner_log_probs: torch.Tensor, engine_log_probs: torch.Tensor,
                        response_mask: torch.Tensor, low: float = 0.5, high: float = 2.0) -> torch.Tensor:
    """mis: w_t = ρ_seq · 1[low ≤ ρ_seq ≤ high] for every token of the sequence, with
    ρ_seq = exp(Σ_t Δ_t) over the sequence's response tokens (verl Seq-MIS).

    Shapes: [B, T] in, [B, T] out (a row is one sequence). A row without response tokens
    has ρ_seq = 1 and its (padding) positions weight 1.
    """
    log_low, log_high = _check_bounds(low, high)
    delta, mask = _log_ratio(learner_log_probs, engine_log_probs, response_mask)
    log_seq = delta.sum(dim=-1, keepdim=True)
    keep = (log_seq >= log_low) & (log_seq <= log_high)
    seq_weight = torch.where(keep, torch.exp(log_seq.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)),
                             torch.zeros_like(log_seq))
    return _finish(seq_weight.expand_as(delta), mask, learner_log_probs)


def compute_geo_mask_weights(learner_log_probs: torch.Tensor, engine_log_probs: torch.Tensor,
                             response_mask: torch.Tensor, low: float = 0.99, high: float = 1.01) -> torch.Tensor:
    """geo_mask: w_t = 1[low ≤ ρ_geo ≤ high] for every token of the sequence, with
    ρ_geo = exp(mean_t Δ_t), the geometric mean of the sequence's token ratios (verl Geo-RS,
    SkyRL geometric sequence mask). No importance weight: 1 or 0.

    Shapes: [B, T] in, [B, T] out.
    """
    log_low, log_high = _check_bounds(low, high)
    delta, mask = _log_ratio(learner_log_probs, engine_log_probs, response_mask)
    tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    log_geo = delta.sum(dim=-1, keepdim=True) / tokens
    keep = (log_geo >= log_low) & (log_geo <= log_high)
    return _finish(keep.to(delta.dtype).expand_as(delta), mask, learner_log_probs)


def compute_icepop_weights(learner_log_probs: torch.Tensor, engine_log_probs: torch.Tensor,
                           response_mask: torch.Tensor, low: float = 0.5, high: float = 5.0) -> torch.Tensor:
    """icepop: w_t = ρ_t · 1[low ≤ ρ_t ≤ high] (IcePop's M(ρ_t; α, β), Ring-1T).

    Shapes: [B, T] in, [B, T] out.
    """
    log_low, log_high = _check_bounds(low, high)
    delta, mask = _log_ratio(learner_log_probs, engine_log_probs, response_mask)
    keep = (delta >= log_low) & (delta <= log_high)
    ratio = torch.exp(delta.clamp(max=log_high))  # no overflow where the token is dropped anyway
    return _finish(torch.where(keep, ratio, torch.zeros_like(delta)), mask, learner_log_probs)


def compute_geo_mask_tis_weights(learner_log_probs: torch.Tensor, engine_log_probs: torch.Tensor,
                                 response_mask: torch.Tensor, cap: float, low: float = 0.99,
                                 high: float = 1.01) -> torch.Tensor:
    """geo_mask_tis: w_t = 1[low ≤ ρ_geo ≤ high] · min(ρ_t, cap): the geo_mask rejection times
    tis's truncated token weight (verl `rollout_is=token` + `rollout_rs=geometric`).

    Shapes: [B, T] in, [B, T] out.
    """
    keep = compute_geo_mask_weights(learner_log_probs, engine_log_probs, response_mask, low, high)
    return (keep * compute_tis_weights(learner_log_probs, engine_log_probs, cap, response_mask)).detach()


def compute_off_policy_weights(mode: str, learner_log_probs: torch.Tensor, engine_log_probs: torch.Tensor,
                               response_mask: torch.Tensor, *, tis_cap: Optional[float] = None,
                               low: Optional[float] = None, high: Optional[float] = None
                               ) -> Optional[torch.Tensor]:
    """The [B, T] weights of `mode` (see the module docstring), or None for `none`.

    `tis_cap` is C of tis and geo_mask_tis; `low` / `high` the bounds of mis, geo_mask (and
    geo_mask_tis) and icepop.
    """
    if mode == "none":
        return None
    if mode in ("tis", "geo_mask_tis") and tis_cap is None:
        raise ValueError(f"off-policy correction {mode} needs its cap (algo.tis_cap)")
    if mode == "tis":
        return compute_tis_weights(learner_log_probs, engine_log_probs, tis_cap, response_mask)
    if mode == "geo_mask_tis":
        if low is None or high is None:
            raise ValueError("off-policy correction geo_mask_tis needs its bounds (algo.geo_mask_low, _high)")
        return compute_geo_mask_tis_weights(learner_log_probs, engine_log_probs, response_mask, tis_cap, low, high)
    functions = {"mis": compute_mis_weights, "geo_mask": compute_geo_mask_weights, "icepop": compute_icepop_weights}
    if mode not in functions:
        raise ValueError(f"unknown off-policy correction {mode!r}; use one of {OFF_POLICY_MODES}")
    if low is None or high is None:
        raise ValueError(f"off-policy correction {mode} needs its bounds (low, high)")
    return functions[mode](learner_log_probs, engine_log_probs, response_mask, low, high)


# ----------------------------------------------------------------------------- metrics
CORRECTION_COLUMNS = ("tokens", "masked_tokens", "weight_sum", "seqs", "masked_seqs")
"""Columns of a correction statistics tensor; every column adds up over micro-batches and ranks."""


def empty_correction_stats(num_age_buckets: int = 1) -> torch.Tensor:
    """[K, 5] zeros: the statistics of no token."""
    if num_age_buckets < 1:
        raise ValueError(f"num_age_buckets must be >= 1, got {num_age_buckets}")
    return torch.zeros(num_age_buckets, len(CORRECTION_COLUMNS), dtype=torch.float64)


@torch.no_grad()
def compute_correction_stats(weights: torch.Tensor, response_mask: torch.Tensor, ages: Optional[torch.Tensor] = None,
                             num_age_buckets: int = 1) -> torch.Tensor:
    """What a correction did to the masked tokens, per age bucket (as `compute_mismatch_stats`).

    Args:
        weights: [B, T] the weights the loss applied (`compute_off_policy_weights`).
        response_mask: [B, T]; tokens where it is 0 are left out (and rows without any).
        ages: [B] int, each row's age in policy versions (None: all 0); row b goes to
            bucket min(ages[b], K − 1).
        num_age_buckets: K.

    Returns:
        [K, 5] float64 (`CORRECTION_COLUMNS`): tokens, tokens with weight 0, Σ weight,
        sequences, sequences with at least one token of weight 0 (verl's
        `rollout_rs_seq_masked_fraction` convention).
    """
    if weights.shape != response_mask.shape:
        raise ValueError(f"weights {tuple(weights.shape)} and mask {tuple(response_mask.shape)} differ in shape")
    rows = weights.shape[0]
    ages = torch.zeros(rows, dtype=torch.long) if ages is None else ages.cpu().long()
    if ages.shape != (rows,):
        raise ValueError(f"ages must be [B] = [{rows}], got {tuple(ages.shape)}")
    mask = response_mask.bool().cpu()
    w = weights.detach().double().cpu()
    masked = mask & (w == 0)
    has_tokens = mask.any(dim=-1)
    bucket = ages.clamp(min=0, max=num_age_buckets - 1)
    stats = empty_correction_stats(num_age_buckets)
    for k in range(num_age_buckets):
        rows_k = (bucket == k) & has_tokens
        sel = mask & rows_k[:, None]
        stats[k, 0] = float(sel.sum())
        stats[k, 1] = float((masked & rows_k[:, None]).sum())
        stats[k, 2] = float(w[sel].sum())
        stats[k, 3] = float(rows_k.sum())
        stats[k, 4] = float((masked.any(dim=-1) & rows_k).sum())
    return stats


def summarize_correction(stats: torch.Tensor, prefix: str = "off_policy") -> Dict[str, float]:
    """Metrics of a [K, 5] correction statistics tensor: over every token, then per age
    bucket that holds tokens (`age_bucket_label`, the same buckets as `mismatch/...`):

        off_policy/masked_token_frac   response tokens given weight 0
        off_policy/masked_seq_frac     sequences with at least one token of weight 0
        off_policy/weight_mean         mean weight the loss applied
        off_policy/age_0/...           the same three for age-0 sequences, and so on

    No key when no token was corrected (no engine log-probs).
    """
    metrics: Dict[str, float] = {}
    parts = [(prefix, stats.sum(0))] + [(f"{prefix}/{age_bucket_label(k, stats.shape[0])}", stats[k])
                                        for k in range(stats.shape[0])]
    for name, row in parts:
        tokens, seqs = float(row[0]), float(row[3])
        if tokens <= 0:
            continue
        metrics.update({f"{name}/masked_token_frac": float(row[1]) / tokens,
                        f"{name}/masked_seq_frac": float(row[4]) / max(seqs, 1.0),
                        f"{name}/weight_mean": float(row[2]) / tokens})
    return metrics


TIS_METRICS = ("tis/weight_mean", "tis/truncated_frac", "tis/log_ratio_mean", "tis/mismatch_kl")


@torch.no_grad()
def summarize_tis_weights(
    train_log_probs: torch.Tensor,
    engine_log_probs: torch.Tensor,
    cap: float,
    response_mask: torch.Tensor,
) -> Dict[str, torch.Tensor]:
    """Token means of the importance ratio ρ_t = π_old^learner(o_t) / π_old^engine(o_t).

    Shapes as `compute_tis_weights`. Each value is a mean over the response tokens of this
    call (aggregate micro-batches by weighting each with its response-token count):

        tis/weight_mean     mean min(ρ, cap), the weight the loss applies
        tis/truncated_frac  fraction with ρ > cap (weight truncated)
        tis/log_ratio_mean  mean log ρ (> 0: the learner finds the samples likelier)
        tis/mismatch_kl     mean ρ − 1 − log ρ, the k3 estimate of KL(π_engine ‖ π_learner)
                            under the engine's samples (0 when the two agree)
    """
    mask = response_mask.bool()
    count = mask.sum().clamp(min=1).to(torch.float32)
    log_ratio = torch.where(mask, (train_log_probs - engine_log_probs).float(), torch.zeros_like(train_log_probs))
    log_ratio = torch.clamp(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weights = torch.clamp(ratio, max=cap)

    def token_mean(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32)).sum() / count

    return {"tis/weight_mean": token_mean(weights), "tis/truncated_frac": token_mean(ratio > cap),
            "tis/log_ratio_mean": token_mean(log_ratio), "tis/mismatch_kl": token_mean(ratio - 1.0 - log_ratio)}
