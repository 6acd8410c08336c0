"""The DAPO policy-gradient loss: decoupled clip, dual clip, token-level aggregation.

DAPO paper (arXiv 2503.14476) Eq. 8 (with Clip-Higher, Eq. 10, and the token-level sum,
Eq. 12), as a loss to minimise (the negated objective):

    L = 1/Σ_i|o_i| · Σ_i Σ_t  −min( r_i,t Â_i,t ,  clip(r_i,t, 1−ε_low, 1+ε_high) Â_i,t )

    r_i,t = π_θ(o_i,t | q, o_i,<t) / π_old(o_i,t | q, o_i,<t)

Departures from the textbook PPO loss, all from the DAPO recipe:

* Clip-Higher (§3.1): the clip range is asymmetric, ε_high (0.28) > ε_low (0.2).
* Dual clip (Ye et al. 2020, used by the reference recipe with c = 10): for Â < 0 the
  clipped loss −Â·max(r, 1−ε_low) grows without bound as r → ∞; it is capped at −Â·c.
* Token-level aggregation (§3.3, Eq. 12): the denominator is the number of response tokens in the
  *whole* batch, passed in as `global_num_tokens`, so that a caller splitting the batch
  into micro-batches (and data-parallel ranks) and *summing* the per-micro-batch losses
  gets exactly the whole-batch loss. GRPO's sequence-level modes are kept for ablations.
* Optional off-policy correction weights (`tis_weights`, from algo/off_policy.py: TIS, MIS,
  geometric mask, IcePop) correct for the mismatch between the engine's and the learner's
  log-probs of the same old policy; a weight of 0 masks the token.

No KL term, no entropy bonus (the DAPO recipe removes both).

Gradient: for an unclipped token the loss is −Â·r/D, so ∂L/∂log π_θ = −Â·r/D (D the
denominator); for a clipped token it is 0.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# Beyond ±20 nats exp() of the log-ratio over/underflows float32; verl clamps the same way.
_LOG_RATIO_CLAMP = 20.0

Number = Union[int, float, torch.Tensor]


def _as_denominator(value: Optional[Number], local: torch.Tensor, name: str) -> torch.Tensor:
    """The aggregation denominator: `value` when given, else the local count; at least 1.

    A whole batch without tokens (e.g. overlong filtering masked every sample) gives
    loss 0. A Python-number `value` below the local count is a caller bug (it must count
    the whole batch) and raises when the check is free (CPU); device tensors are not
    checked, to avoid a host sync per micro-batch.
    """
    if value is None:
        return local.clamp(min=1.0)
    if isinstance(value, (int, float)):
        if value < 0 or (local.device.type == "cpu" and value < float(local)):
            raise ValueError(f"{name}={value} but this micro-batch alone has {int(local)}; "
                             "pass the count of the whole batch (all micro-batches and DP ranks)")
    denom = torch.as_tensor(value, dtype=local.dtype, device=local.device)
    return denom.clamp(min=1.0)


def compute_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Optional[Number] = None,
    tis_weights: Optional[torch.Tensor] = None,
    global_num_seqs: Optional[Number] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """DAPO clipped policy-gradient loss (Eq. 8/10) with token-level aggregation (Eq. 12).

    Args:
        log_probs: [B, T] log π_θ(o_t) of the current policy (requires grad).
        old_log_probs: [B, T] log π_old(o_t) of the policy that generated the samples.
        advantages: [B] (one per response, Eq. 9) or [B, T] per token.
        response_mask: [B, T] bool/0-1, 1 on response tokens that carry loss. Rows that
            are all 0 (padding rows) contribute nothing.
        clip_ratio_low: ε_low; for Â < 0, ratios below 1−ε_low are clipped.
        clip_ratio_high: ε_high; for Â > 0, ratios above 1+ε_high are clipped. A ratio
            exactly at a bound is *not* clipped (its gradient flows).
        clip_ratio_c: dual-clip constant c > 1; for Â < 0 the per-token loss is
            min(max(−Â·r, −Â·clip(r)), −Â·c), i.e. tokens with r > c get gradient 0.
            None disables it.
        loss_agg_mode:
            "token-mean"          Σ_tokens loss / D_tok, D_tok = `global_num_tokens`
                                  (or the local token count when None). DAPO.
            "seq-mean-token-mean" Σ_seqs (mean over the sequence's tokens) / D_seq.
            "seq-mean-token-sum"  Σ_seqs (sum over the sequence's tokens) / D_seq.
            D_seq = `global_num_seqs`, the number of non-empty responses in the whole batch
            (or the local number of rows with ≥ 1 response token when None).
        global_num_tokens: response tokens of the whole batch (all micro-batches, all DP
            ranks). Used by token-mean; ignored by the seq modes.
        tis_weights: optional [B, T] detached off-policy correction weights
            (`off_policy.compute_off_policy_weights`: truncated IS, or 0 where a mode masks
            the token) multiplying each token's clipped loss.
        global_num_seqs: non-empty responses of the whole batch; used by the seq modes.

    Returns:
        (loss, metrics). loss is a 0-dim tensor. With a global denominator, the sum of the
        losses of any split of the batch into parts equals the whole-batch loss (every
        mode is a sum over tokens or sequences divided by a constant).

        metrics: detached 0-dim float tensors, each a mean over this call's response
        tokens, plus "loss/num_tokens" (that token count) so that an all-reduce of
        value·num_tokens and num_tokens aggregates micro-batches and ranks exactly:
            loss/clip_frac_low   Â<0 and r < 1−ε_low (gradient 0)
            loss/clip_frac_high  Â>0 and r > 1+ε_high (gradient 0)
            loss/dual_clip_frac  Â<0 and r > c (gradient 0; 0 when dual clip is off)
            loss/approx_kl       k3 estimator of KL(π_old ‖ π_θ): r − 1 − log r
                                 (non-negative, unbiased under samples from π_old)
            loss/ratio_mean      mean r
            loss/num_tokens      response tokens in this call
    """
    _check_loss_inputs(log_probs, old_log_probs, response_mask, loss_agg_mode, clip_ratio_c)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(log_probs.dtype).expand_as(log_probs)
    mask = response_mask.bool()

    # where() rather than multiply: padding may hold ±inf/NaN log-probs, and the unselected
    # branch of where() receives no gradient.
    log_ratio = torch.where(mask, log_probs - old_log_probs.detach(), torch.zeros_like(log_probs))
    log_ratio = torch.clamp(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)

    adv = advantages.detach()
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    token_loss = torch.maximum(loss_unclipped, loss_clipped)  # pessimistic bound, Eq. 8/10
    if clip_ratio_c is not None:
        dual_bound = -adv * clip_ratio_c
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, dual_bound), token_loss)
    if tis_weights is not None:
        if tis_weights.shape != log_probs.shape:
            raise ValueError(f"tis_weights must be [B, T] like log_probs, got {tuple(tis_weights.shape)}")
        token_loss = token_loss * tis_weights.detach().to(token_loss.dtype)
    token_loss = torch.where(mask, token_loss, torch.zeros_like(token_loss))
    loss = _aggregate(token_loss, mask.to(log_probs.dtype), loss_agg_mode, global_num_tokens, global_num_seqs)
    return loss, _clip_metrics(ratio, log_ratio, adv, mask, clip_ratio_low, clip_ratio_high, clip_ratio_c)


def _check_loss_inputs(log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       loss_agg_mode: str, clip_ratio_c: Optional[float]) -> None:
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [B, T], got {tuple(log_probs.shape)}")
    if old_log_probs.shape != log_probs.shape or response_mask.shape != log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)} and "
                         f"response_mask {tuple(response_mask.shape)} must have the same [B, T] shape")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; use one of {LOSS_AGG_MODES}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")


def _aggregate(token_loss: torch.Tensor, fmask: torch.Tensor, loss_agg_mode: str,
               global_num_tokens: Optional[Number], global_num_seqs: Optional[Number]) -> torch.Tensor:
    """The masked per-token losses summed and divided as `loss_agg_mode` says (Eq. 12 for token-mean)."""
    if loss_agg_mode == "token-mean":
        return token_loss.sum() / _as_denominator(global_num_tokens, fmask.sum(), "global_num_tokens")
    seq_tokens = fmask.sum(dim=-1)
    seq_loss = token_loss.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_loss = seq_loss / seq_tokens.clamp(min=1.0)
    local_seqs = (seq_tokens > 0).to(fmask.dtype).sum()
    return seq_loss.sum() / _as_denominator(global_num_seqs, local_seqs, "global_num_seqs")


@torch.no_grad()
def _clip_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                  clip_ratio_low: float, clip_ratio_high: float,
                  clip_ratio_c: Optional[float]) -> Dict[str, torch.Tensor]:
    """compute_policy_loss's metrics: token means over this call's response tokens."""
    local_tokens = mask.to(ratio.dtype).sum()
    count = local_tokens.clamp(min=1.0)

    def token_mean(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, values.to(ratio.dtype), torch.zeros_like(ratio)).sum() / count

    negative = adv < 0
    clipped_high = (adv > 0) & (ratio > 1.0 + clip_ratio_high)
    clipped_low = negative & (ratio < 1.0 - clip_ratio_low)
    dual_clipped = negative & (ratio > clip_ratio_c) if clip_ratio_c is not None else torch.zeros_like(mask)
    return {
        "loss/clip_frac_low": token_mean(clipped_low),
        "loss/clip_frac_high": token_mean(clipped_high),
        "loss/dual_clip_frac": token_mean(dual_clipped),
        "loss/approx_kl": token_mean(ratio - 1.0 - log_ratio),
        "loss/ratio_mean": token_mean(ratio),
        "loss/num_tokens": local_tokens.detach().clone(),
    }
