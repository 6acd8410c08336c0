"""Token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary,
z[..., v] for v in [r·V/tp, (r+1)·V/tp). With temperature τ (applied as the engines apply
it: logits / τ before the softmax) and the padding rows v ≥ vocab_size masked out:

    log p(y)  = z_y − m − log Σ_v exp(z_v − m)              (1)  vocab_parallel_cross_entropy
    H         = log S − (1/S) Σ_v e_v (z_v − m)             (2)  entropy
                with m = max_v z_v, e_v = exp(z_v − m), S = Σ_v e_v

Every Σ_v and max_v is a local reduction followed by an all-reduce over the TP group, so
only [B, S] tensors cross ranks. (1) is differentiable (megatron's custom autograd);
(2) is a metric and is computed without gradient.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

# A finite stand-in for −∞ on padding rows: exp(−1e9 − m) is exactly 0 in fp32, and unlike
# −∞ it keeps 0·z finite in the entropy sum.
_MASKED_LOGIT = -1.0e9


def _tp_group_and_rank():
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def prepare_vocab_parallel_logits(logits: torch.Tensor, temperature: float, vocab_size: int) -> torch.Tensor:
    """fp32 logits / τ with padded-vocabulary entries of this rank's slice masked.

    logits: [..., V_local] this rank's slice of the padded vocabulary.
    """
    _, rank, _ = _tp_group_and_rank()
    local = logits.shape[-1]
    scaled = logits.float() / float(temperature)
    first = rank * local
    if first + local > vocab_size:
        vocab_ids = torch.arange(first, first + local, device=logits.device)
        scaled = scaled.masked_fill(vocab_ids >= vocab_size, _MASKED_LOGIT)
    return scaled


def vocab_parallel_log_probs(scaled_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Eq. (1): log p(labels) [B, S] from prepared vocab-parallel logits [B, S, V_local]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # megatron's kernel works on [S, B, V] or [B, S, V] alike (it reduces the last dim) and
    # modifies its input in place on some versions: give it its own copy.
    return -vocab_parallel_cross_entropy(scaled_logits.clone(), labels)


@torch.no_grad()
def vocab_parallel_entropy(scaled_logits: torch.Tensor) -> torch.Tensor:
    """Eq. (2): entropy [B, S] of the softmax over the full vocabulary, from [B, S, V_local]."""
    group, _, world = _tp_group_and_rank()
    logits_max = scaled_logits.max(dim=-1).values
    if world > 1:
        torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = scaled_logits - logits_max.unsqueeze(-1)
    exp = shifted.exp()
    sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)])
    if world > 1:
        torch.distributed.all_reduce(sums, group=group)
    sum_exp, sum_exp_shifted = sums[0], sums[1]
    return sum_exp.log() - sum_exp_shifted / sum_exp


def compute_token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_size: int,
                            with_entropy: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of `labels` [B, S] and (optionally) the entropy [B, S] at every position.

    logits: [B, S, V_local] vocab-parallel logits as GPTModel returns them
    (`parallel_output=True`); labels: [B, S] next-token ids (already shifted by one).
    """
    scaled = prepare_vocab_parallel_logits(logits, temperature, vocab_size)
    log_probs = vocab_parallel_log_probs(scaled, labels)
    entropy = vocab_parallel_entropy(scaled) if with_entropy else None
    return log_probs, entropy
