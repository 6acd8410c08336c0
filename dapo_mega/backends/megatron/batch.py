"""Training samples, data-parallel sharding and padded micro-batches for the learner.

A sample is a prompt followed by a response. A row of a micro-batch is right-padded:

    position  0 .. P-1 | P .. P+R-1 | P+R .. S-1
    tokens    prompt   | response   | pad (token 0)

Position t predicts token t+1, so the response token at P+j is scored by the logits at
P+j−1: `labels[t] = tokens[t+1]` and `response_mask[t] = 1` for t in [P−1, P+R−1) where the
sample's loss_mask is 1. With right padding the causal mask alone keeps padding out of
every real token's attention, so no explicit attention mask is needed (padding is never
attended to by earlier positions, and padded positions carry no loss). Packing several
samples into one row is not done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch


@dataclass
class TrainSample:
    """One sampled response to a prompt, as the trainer hands it to the learner."""

    prompt_ids: List[int]
    response_ids: List[int]
    advantage: float = 0.0
    old_log_probs: Optional[List[float]] = None
    """Learner log-probs of the response tokens under the old policy (filled by train_step)."""
    engine_log_probs: Optional[List[float]] = None
    """Log-probs the rollout engine reported while sampling (for TIS / use_engine_logprobs)."""
    loss_mask: Optional[List[int]] = None
    """Per response token, 1 = carries loss (default all 1; overlong filtering zeroes it)."""

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def response_loss_mask(self) -> List[int]:
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.response_ids)


@dataclass
class MicroBatch:
    """Padded tensors of one micro-batch; rows are samples, columns token positions."""

    tokens: torch.Tensor
    """[B, S] int64 input ids (pad = 0)."""
    position_ids: torch.Tensor
    """[B, S] int64 0..S-1."""
    labels: torch.Tensor
    """[B, S] int64 next token (tokens shifted left by one; 0 at the end)."""
    response_mask: torch.Tensor
    """[B, S] float 1 where labels[t] is a response token carrying loss."""
    advantages: torch.Tensor
    """[B] float."""
    old_log_probs: torch.Tensor
    """[B, S] float, aligned with labels (0 outside response_mask)."""
    engine_log_probs: Optional[torch.Tensor]
    """[B, S] float or None."""
    sample_indices: List[int]
    """Index of each row's sample in the list given to the learner; −1 for filler rows."""
    prompt_lengths: List[int]
    response_lengths: List[int]


def shard_for_data_parallel(indices: Sequence[int], dp_rank: int, dp_size: int) -> List[int]:
    """This DP rank's share of `indices`: a contiguous block, sizes differing by at most one.

    Every rank is given the same full list and takes its block deterministically.
    """
    n = len(indices)
    base, extra = divmod(n, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return list(indices[start:start + base + (1 if dp_rank < extra else 0)])


def count_loss_tokens(samples: Sequence[TrainSample], indices: Sequence[int]) -> int:
    """Response tokens that carry loss among `samples[indices]` (the token-mean denominator)."""
    return sum(sum(samples[i].response_loss_mask()) for i in indices)


def plan_micro_batches(samples: Sequence[TrainSample], indices: Sequence[int], micro_batch_tokens: int,
                       uniform: bool = False, seq_multiple: int = 1) -> List[List[int]]:
    """Group `indices` (in order) into micro-batches whose padded size rows·S fits the budget.

    uniform=True (pipeline parallel: every micro-batch must have the same [B, S] shape)
    pads to the longest sample of the whole list and puts the same number of rows in each
    micro-batch (the last one is completed with filler rows, index −1).
    """
    def padded(length: int) -> int:
        return -(-length // seq_multiple) * seq_multiple

    if not indices:
        return [[-1]]
    longest = max(padded(samples[i].length) for i in indices)
    if longest > micro_batch_tokens:
        raise ValueError(f"a sample of {longest} tokens exceeds megatron.micro_batch_tokens={micro_batch_tokens}")
    if uniform:
        rows = max(1, micro_batch_tokens // longest)
        groups = [list(indices[k:k + rows]) for k in range(0, len(indices), rows)]
        groups[-1] += [-1] * (rows - len(groups[-1]))
        return groups
    groups: List[List[int]] = []
    current: List[int] = []
    current_max = 0
    for i in indices:
        length = padded(samples[i].length)
        if current and max(current_max, length) * (len(current) + 1) > micro_batch_tokens:
            groups.append(current)
            current, current_max = [], 0
        current.append(i)
        current_max = max(current_max, length)
    groups.append(current)
    return groups


def collate_micro_batch(samples: Sequence[TrainSample], rows: Sequence[int], seq_len: Optional[int] = None,
                        seq_multiple: int = 1) -> MicroBatch:
    """Pad the samples `rows` (−1 = filler row, no loss) into a MicroBatch.

    seq_len: columns (default: longest row, rounded up to `seq_multiple`).
    old_log_probs / engine_log_probs of a sample are placed on its response_mask columns
    (missing ones are zeros, to be filled later by the learner).
    """
    real = [samples[i] for i in rows if i >= 0]
    longest = max((s.length for s in real), default=2)
    seq = seq_len or -(-max(longest, 2) // seq_multiple) * seq_multiple
    batch = len(rows)
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    labels = torch.zeros(batch, seq, dtype=torch.long)
    mask = torch.zeros(batch, seq)
    old = torch.zeros(batch, seq)
    has_engine = any(s.engine_log_probs is not None for s in real)
    engine = torch.zeros(batch, seq) if has_engine else None
    adv = torch.zeros(batch)
    prompt_lengths, response_lengths = [], []
    for row, index in enumerate(rows):
        if index < 0:
            prompt_lengths.append(0)
            response_lengths.append(0)
            continue
        s = samples[index]
        ids = list(s.prompt_ids) + list(s.response_ids)
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p < 1:
            raise ValueError(f"sample {index} has an empty prompt; the first response token needs a context")
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[row, : len(ids) - 1] = tokens[row, 1: len(ids)]
        cols = slice(p - 1, p + r - 1)
        mask[row, cols] = torch.tensor(s.response_loss_mask(), dtype=torch.float32)
        if s.old_log_probs is not None:
            old[row, cols] = torch.tensor(s.old_log_probs, dtype=torch.float32)
        if engine is not None and s.engine_log_probs is not None:
            engine[row, cols] = torch.tensor(s.engine_log_probs, dtype=torch.float32)
        adv[row] = float(s.advantage)
        prompt_lengths.append(p)
        response_lengths.append(r)
    position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(batch, -1).contiguous()
    return MicroBatch(tokens=tokens, position_ids=position_ids, labels=labels, response_mask=mask, advantages=adv,
                      old_log_probs=old, engine_log_probs=engine, sample_indices=list(rows),
                      prompt_lengths=prompt_lengths, response_lengths=response_lengths)


def response_values(values: torch.Tensor, micro_batch: MicroBatch, row: int) -> torch.Tensor:
    """The [R] entries of a [B, S] tensor that belong to row `row`'s response tokens."""
    p, r = micro_batch.prompt_lengths[row], micro_batch.response_lengths[row]
    return values[row, p - 1: p + r - 1]
