"""Token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary,
z[..., v] for v in [r·V/tp, (r+1)·V/tp). With temperature τ (applied as the engines apply
it: logits / τ before the softmax) and the padding rows v ≥ vocab_size masked out:

    log p(y)  = z_y − m − log Σ_v exp(z_v − m)              (1)  vocab_parallel_cross_entropy
    H         = log S − (1/S) Σ_v e_v (z_v − m)             (2)  entropy
                with m = max_v z_v, e_v = exp(z_v − m), S = Σ_v e_v

Every Σ_v and max_v is a local reduction followed by an all-reduce over the TP group, so
only [B, S] tensors cross ranks. (1) is differentiable; (2) is a metric without gradient.
Both are computed LOGPROB_CHUNK_TOKENS positions at a time by one autograd function
(`ChunkedVocabParallelLogProbs`) that keeps only the logsumexp per position for backward and
recomputes each chunk's softmax there: one fp32 [chunk, V_local] tensor at a time, where a
float cast, a masked copy, megatron's cross-entropy copy and the entropy's temporaries of the
whole [B, S, V_local] lived together before (NeMo-RL and slime chunk the same way).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

# A finite stand-in for −∞ on padding rows: exp(−1e9 − m) is exactly 0 in fp32, and unlike
# −∞ it keeps 0·z finite in the entropy sum.
_MASKED_LOGIT = -1.0e9
LOGPROB_CHUNK_TOKENS = 2048
"""Positions per chunk of the log-prob / entropy computation: a [2048, V_local] fp32 tensor
(152k vocabulary at TP 8: 150 MiB) instead of several of the whole packed row."""


def _tp_group_and_rank():
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def compute_token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_size: int,
                            with_entropy: bool = True, chunk_tokens: int = LOGPROB_CHUNK_TOKENS
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of `labels` [B, S] and (optionally) the entropy [B, S] at every position.

    logits: [B, S, V_local] vocab-parallel logits as GPTModel returns them
    (`parallel_output=True`); labels: [B, S] next-token ids (already shifted by one).
    Computed `chunk_tokens` positions at a time (`ChunkedVocabParallelLogProbs`).
    """
    group, rank, world = _tp_group_and_rank()
    return chunked_log_probs_and_entropy(logits, labels, temperature, vocab_size, group, rank, world,
                                         with_entropy=with_entropy, chunk_tokens=chunk_tokens)


def chunked_log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_size: int,
                                  group=None, rank: int = 0, world: int = 1, with_entropy: bool = True,
                                  chunk_tokens: int = LOGPROB_CHUNK_TOKENS
                                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Eq. (1) and (2) over `group` (this rank's vocabulary slice `rank` of `world`), in chunks
    of `chunk_tokens` positions: at most one fp32 [chunk_tokens, V_local] tensor (and its
    exponent) lives at a time, in forward and in backward, instead of several fp32 copies of
    the whole [B, S, V_local] (at 32B, one 22,528-token row at TP 8: 1.8 GiB each)."""
    lp, ent = ChunkedVocabParallelLogProbs.apply(logits, labels, float(temperature), int(vocab_size), group, rank,
                                                 world, bool(with_entropy), int(chunk_tokens))
    return lp, (ent if with_entropy else None)


def _chunk_stats(z: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_size: int, rank: int, world: int,
                 group, with_entropy: bool) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(log p(label), logsumexp, entropy) [n] of one chunk of logits z [n, V_local] (any dtype)."""
    local = z.shape[-1]
    first = rank * local
    scaled = z.float() / temperature
    if first + local > vocab_size:
        scaled[:, max(vocab_size - first, 0):] = _MASKED_LOGIT
    zmax = scaled.max(dim=-1).values
    if world > 1:
        torch.distributed.all_reduce(zmax, op=torch.distributed.ReduceOp.MAX, group=group)
    scaled -= zmax.unsqueeze(-1)                 # shifted in place: the chunk's one fp32 copy
    local_ids = labels - first
    mine = (local_ids >= 0) & (local_ids < local)
    target = scaled.gather(-1, local_ids.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1) * mine
    exp = scaled.exp()
    parts = [exp.sum(dim=-1), target]
    if with_entropy:
        parts.append((exp * scaled).sum(dim=-1))
    del exp
    sums = torch.stack(parts)
    if world > 1:
        torch.distributed.all_reduce(sums, group=group)
    log_sum = sums[0].log()
    lse = zmax + log_sum
    log_p = sums[1] - log_sum
    entropy = log_sum - sums[2] / sums[0] if with_entropy else None
    return log_p, lse, entropy


class ChunkedVocabParallelLogProbs(torch.autograd.Function):
    """log p(labels) (differentiable) and entropy (a metric) from vocab-parallel logits, chunk
    by chunk. Backward recomputes each chunk's softmax from the saved logsumexp (no
    collective): d log p(y) / d z_v = (1[v = y] - p_v) / τ on this rank's slice."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab_size, group, rank, world, with_entropy, chunk_tokens):
        shape = labels.shape
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        n = flat.shape[0]
        log_p = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        with torch.no_grad():
            for a in range(0, n, chunk_tokens):
                b = min(a + chunk_tokens, n)
                lp, ls, ent = _chunk_stats(flat[a:b], flat_labels[a:b], temperature, vocab_size, rank, world, group,
                                           with_entropy)
                log_p[a:b], lse[a:b] = lp, ls
                if with_entropy:
                    entropy[a:b] = ent
        ctx.save_for_backward(logits, labels, lse)
        ctx.args = (temperature, vocab_size, rank, chunk_tokens)
        ctx.mark_non_differentiable(entropy)
        return log_p.view(shape), (entropy.view(shape) if with_entropy else entropy)

    @staticmethod
    def backward(ctx, grad_log_p, _grad_entropy):
        logits, labels, lse = ctx.saved_tensors
        temperature, vocab_size, rank, chunk_tokens = ctx.args
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        grad_flat = grad_log_p.reshape(-1).float()
        local = flat.shape[-1]
        first = rank * local
        grad = torch.empty_like(flat)
        for a in range(0, flat.shape[0], chunk_tokens):
            b = min(a + chunk_tokens, flat.shape[0])
            p = flat[a:b].float() / temperature
            if first + local > vocab_size:
                p[:, max(vocab_size - first, 0):] = _MASKED_LOGIT
            p.sub_(lse[a:b].unsqueeze(-1)).exp_()           # softmax on this slice, in place
            p.neg_()
            local_ids = flat_labels[a:b] - first
            mine = (local_ids >= 0) & (local_ids < local)
            rows = torch.nonzero(mine).squeeze(-1)
            p[rows, local_ids[rows]] += 1.0
            p.mul_((grad_flat[a:b] / temperature).unsqueeze(-1))
            grad[a:b] = p.to(grad.dtype)
        return grad.view_as(logits), None, None, None, None, None, None, None, None
