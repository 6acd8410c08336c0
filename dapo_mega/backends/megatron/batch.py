"""Training samples, data-parallel shards and micro-batches (padded or packed) for the learner.

A sample is a prompt followed by a response. A micro-batch is [B, S] tokens; a row holds
one sample (padded layout) or several (packed layout), each followed by the next:

    padded   | prompt | response | pad ............................ |
    packed   | prompt | response | prompt | response | prompt | resp | pad |
               sample a            sample b            sample c

Position t predicts token t+1 *of the same sample*, so the response token at P+j of a
sample starting at column c is scored by the logits at c+P+j−1: `labels[t] = tokens[t+1]`
inside a sample (0 on its last token) and `response_mask[t] = 1` for t in
[c+P−1, c+P+R−1) where the sample's loss_mask is 1. `position_ids` restart at 0 for
each sample.

Attention. Padded rows need no mask: with right padding the causal mask alone keeps padding
out of every real token's attention. Packed rows must not let a sample attend to the
samples before it in the row:

* `attention="mask"` (the local layer spec, CPU): an explicit [B, 1, S, S] boolean mask,
  True = masked, that is causal *within* each sample (block-diagonal causal); pad columns
  attend only to themselves. megatron-core's local attention applies it as given. Its
  RoPE reads the column index, not `position_ids`; inside one sample's block only the
  difference of two positions enters the attention score (RoPE is relative), so the
  result equals restarted positions (up to rounding).
* `attention="thd"` (Transformer Engine): one row per micro-batch ([1, T] tokens, the THD
  layout) and `cu_seqlens` [n+1] (int32, segment starts, the trailing pad a segment of its
  own) with `max_seqlen`, for megatron-core's `PackedSeqParams(qkv_format="thd")`; TE's
  fused attention and RoPE restart at each segment.

Per-token advantages ([B, S]) let one row carry samples of different advantages; loss
functions that aggregate per sequence read a sample's tokens through `gather_responses`
([num samples, longest response]), whatever the layout.

Which samples go to which rank and row: `packing.py`. A padding micro-batch
(`build_padding_micro_batch`) holds no sample: every DP rank runs the same number of
micro-batches (FP8 amax all-reduces, the interleaved schedule; packing.py), and it costs
the short ranks one forward/backward that contributes zero loss and zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from dapo_mega.algo.train_sample import TrainSample
from dapo_mega.backends.megatron.packing import (
    padded_micro_batches,
    partition_balanced,
    partition_contiguous,
    plan_packed_micro_batches,
    round_up,
    shuffle_groups,
)
from dapo_mega.config import AlgoConfig

ATTENTION_CAUSAL = "causal"
ATTENTION_MASK = "mask"
ATTENTION_THD = "thd"


@dataclass
class SampleSlot:
    """Where one sample sits in a micro-batch."""

    sample_index: int
    """Index in the sample list given to the learner."""
    row: int
    start: int
    """Column of the sample's first prompt token."""
    prompt_length: int
    response_length: int

    @property
    def response_columns(self) -> slice:
        """Columns whose logits score the response tokens (and whose labels are them)."""
        first = self.start + self.prompt_length - 1
        return slice(first, first + self.response_length)


@dataclass
class MicroBatch:
    """Tensors of one micro-batch; rows of S token positions holding one or more samples."""

    tokens: torch.Tensor
    """[B, S] int64 input ids (pad = 0)."""
    position_ids: torch.Tensor
    """[B, S] int64, restarting at 0 at each sample (pad columns continue from the last)."""
    labels: torch.Tensor
    """[B, S] int64 next token of the same sample (0 on a sample's last token and on pad)."""
    response_mask: torch.Tensor
    """[B, S] float 1 where labels[t] is a response token carrying loss."""
    advantages: torch.Tensor
    """[B, S] float, the sample's advantage on its response_mask columns (0 elsewhere)."""
    old_log_probs: Optional[torch.Tensor]
    """[B, S] float, aligned with labels (0 outside response_mask); None = π_old is the
    policy being trained (the first update of a step: the loss detaches its own log-probs)."""
    engine_log_probs: Optional[torch.Tensor]
    """[B, S] float or None."""
    placements: List[SampleSlot]
    """Every sample of the micro-batch, by row then column."""
    attention: str = ATTENTION_CAUSAL
    """causal (one sample per row, no mask needed), mask or thd (packed; module docstring)."""
    attention_mask: Optional[torch.Tensor] = None
    """[B, 1, S, S] bool, True = masked (attention="mask")."""
    cu_seqlens: Optional[torch.Tensor] = None
    """[segments + 1] int32 cumulative segment lengths of the single row (attention="thd")."""
    max_seqlen: int = 0
    """Longest segment (attention="thd")."""

    @property
    def sample_indices(self) -> List[int]:
        return [p.sample_index for p in self.placements]

    def response_index(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """([samples, longest response] flat indices into a [B, S] tensor, same-shape valid
        mask), in `placements` order; built once per micro-batch (`gather_responses`)."""
        cached = self.__dict__.get("_response_index")
        if cached is None:
            width = self.tokens.shape[1]
            longest = max(1, max((p.response_length for p in self.placements), default=0))
            index, valid = [], []
            for p in self.placements:
                first = p.row * width + p.response_columns.start
                pad = longest - p.response_length
                index.append(list(range(first, first + p.response_length)) + [0] * pad)
                valid.append([True] * p.response_length + [False] * pad)
            cached = (torch.tensor(index, dtype=torch.long).reshape(len(index), longest),
                      torch.tensor(valid, dtype=torch.bool).reshape(len(valid), longest))
            self.__dict__["_response_index"] = cached
        return cached

    @property
    def real_tokens(self) -> int:
        """Prompt + response tokens of the samples (the rest of rows × columns is padding)."""
        return sum(p.prompt_length + p.response_length for p in self.placements)


# ---------------------------------------------------------------------- data-parallel shards
def shard_for_data_parallel(indices: Sequence[int], dp_rank: int, dp_size: int) -> List[int]:
    """This DP rank's share of `indices`: a contiguous block, sizes differing by at most one.

    Every rank is given the same full list and takes its block deterministically.
    """
    return [indices[k] for k in partition_contiguous(len(indices), dp_size)[dp_rank]]


def shard_balanced(samples: Sequence[TrainSample], indices: Sequence[int], dp_rank: int,
                   dp_size: int) -> List[int]:
    """This DP rank's share of `indices`, split by token count (Karmarkar–Karp, packing.py).

    Every rank computes the same partition from the same list; parts are in index order.
    """
    return shards(samples, indices, dp_size, balanced=True)[dp_rank]


def shard_of(samples: Sequence[TrainSample], indices: Sequence[int], dp_rank: int, dp_size: int,
             balanced: bool) -> List[int]:
    """DP rank `dp_rank`'s share of `indices` (`shards`)."""
    return shards(samples, indices, dp_size, balanced)[dp_rank]


def shards(samples: Sequence[TrainSample], indices: Sequence[int], dp_size: int, balanced: bool) -> List[List[int]]:
    """Every DP rank's share of `indices`, the partition made once: by token count
    (`megatron.balance_data_parallel`, Karmarkar–Karp) or contiguous blocks (`shard_for_data_parallel`)."""
    indices = list(indices)
    if balanced:
        return [[indices[k] for k in part] for part in partition_balanced([samples[i].length for i in indices], dp_size)]
    return [shard_for_data_parallel(indices, rank, dp_size) for rank in range(dp_size)]


def step_mini_batches(num_samples: int, algo: AlgoConfig, megatron_seed: int, step: int) -> List[List[int]]:
    """A rollout batch's mini-batches (sample indices), one optimizer update each: its groups of
    G = algo.n_samples_per_prompt samples shuffled (`algo.shuffle_mini_batches`, seeded by
    `megatron_seed` and the rollout `step`: `packing.shuffle_groups`, the same on every rank),
    then cut every algo.mini_batch_size x G samples."""
    group, per_update = algo.n_samples_per_prompt, algo.mini_batch_size * algo.n_samples_per_prompt
    order = (shuffle_groups(num_samples, group, seed=megatron_seed * 1_000_003 + int(step))
             if algo.shuffle_mini_batches else list(range(num_samples)))
    return [order[k:k + per_update] for k in range(0, len(order), per_update)]


def data_parallel_samples(samples: Sequence[TrainSample], mini_batches: Sequence[Sequence[int]], dp_size: int,
                          balanced: bool) -> List[List[int]]:
    """Per DP rank, the samples it trains on in a step: its share of each mini-batch (`shard_of`),
    mini-batch after mini-batch. What the learner takes (`MegatronLearner.train_step`), and so
    what the driver sends each rank of a mixture's routed experts (`driver/expert_handover.py`)."""
    per_batch = [shards(samples, mb, dp_size, balanced) for mb in mini_batches]
    return [[i for parts in per_batch for i in parts[rank]] for rank in range(dp_size)]


def count_loss_tokens(samples: Sequence[TrainSample], indices: Sequence[int]) -> int:
    """Response tokens that carry loss among `samples[indices]` (the token-mean denominator)."""
    return sum(sum(samples[i].response_loss_mask()) for i in indices)


# ---------------------------------------------------------------------- planning
def plan_micro_batches(samples: Sequence[TrainSample], indices: Sequence[int], micro_batch_tokens: int,
                       uniform: bool = False, seq_multiple: int = 1) -> List[List[int]]:
    """Group `indices` (in order), one sample per row, into micro-batches whose padded size
    rows·S fits the budget (the padded layout).

    uniform=True (pipeline parallel: every micro-batch must have the same [B, S] shape)
    pads to the longest sample of the whole list and puts the same number of rows in each
    micro-batch (the last one is completed with filler rows, index −1).
    """
    if not indices:
        return [[-1]]
    lengths = {i: samples[i].length for i in indices}
    longest = max(round_up(n, seq_multiple) for n in lengths.values())
    if longest > micro_batch_tokens:
        raise ValueError(f"a sample of {longest} tokens exceeds megatron.micro_batch_tokens={micro_batch_tokens}")
    if uniform:
        rows = max(1, micro_batch_tokens // longest)
        groups = [list(indices[k:k + rows]) for k in range(0, len(indices), rows)]
        groups[-1] += [-1] * (rows - len(groups[-1]))
        return groups
    return padded_micro_batches(lengths, indices, micro_batch_tokens, seq_multiple)


def plan_packed(samples: Sequence[TrainSample], indices: Sequence[int], micro_batch_tokens: int, thd: bool,
                uniform: bool = False, seq_multiple: int = 1):
    """Packed layout: (micro-batches as lists of rows of sample indices, uniform width or 0).

    thd: one row of up to `micro_batch_tokens` per micro-batch (Transformer Engine); else
    rows as wide as the longest sample, micro_batch_tokens // width rows per micro-batch.
    """
    lengths = {i: samples[i].length for i in indices}
    return plan_packed_micro_batches(lengths, indices, micro_batch_tokens,
                                     row_tokens=micro_batch_tokens if thd else None, multiple=seq_multiple,
                                     uniform=uniform)


# ---------------------------------------------------------------------- collation
def collate_micro_batch(samples: Sequence[TrainSample], rows: Sequence[int], seq_len: Optional[int] = None,
                        seq_multiple: int = 1) -> MicroBatch:
    """Pad the samples `rows` (−1 = filler row, no loss) into a MicroBatch, one per row.

    seq_len: columns (default: longest row, rounded up to `seq_multiple`).
    old_log_probs / engine_log_probs of a sample are placed on its response_mask columns
    (missing ones are zeros, to be filled later by the learner).
    """
    return collate_packed_micro_batch(samples, [[i] if i >= 0 else [] for i in rows], seq_len=seq_len,
                                      seq_multiple=seq_multiple, attention=ATTENTION_CAUSAL)


def collate_packed_micro_batch(samples: Sequence[TrainSample], rows: Sequence[Sequence[int]],
                               seq_len: Optional[int] = None, seq_multiple: int = 1,
                               attention: str = ATTENTION_MASK) -> MicroBatch:
    """Lay the samples of each row side by side into a MicroBatch (module docstring).

    rows: sample indices per row ([] = an empty filler row). seq_len: columns (default: the
    longest row, rounded up to `seq_multiple`). attention: causal (rows must hold at most
    one sample), mask or thd (exactly one row).
    """
    if attention not in (ATTENTION_CAUSAL, ATTENTION_MASK, ATTENTION_THD):
        raise ValueError(f"unknown attention {attention!r}")
    if attention == ATTENTION_CAUSAL and any(len(r) > 1 for r in rows):
        raise ValueError("causal attention needs one sample per row; pack with attention='mask' or 'thd'")
    if attention == ATTENTION_THD and len(rows) != 1:
        raise ValueError(f"the THD layout has one row per micro-batch, got {len(rows)}")
    used = [sum(samples[i].length for i in row) for row in rows]
    seq = seq_len or round_up(max(max(used, default=0), 2), seq_multiple)
    if max(used, default=0) > seq:
        raise ValueError(f"a row of {max(used)} tokens does not fit seq_len={seq}")
    # Rows are built as Python lists and become tensors once: per-sample tensor ops would
    # cost more than the model's forward on a small batch.
    has_engine = any(samples[i].engine_log_probs is not None for row in rows for i in row)
    fields = {name: [] for name in ("tokens", "labels", "positions", "segments", "mask", "adv", "old", "engine")}
    placements: List[SampleSlot] = []
    for r, row in enumerate(rows):
        tokens, labels, positions, segments = [0] * seq, [0] * seq, [0] * seq, [0] * seq
        mask, adv, old, engine = [0.0] * seq, [0.0] * seq, [0.0] * seq, [0.0] * seq
        col = 0
        for k, index in enumerate(row):
            s = samples[index]
            p, n = len(s.prompt_ids), len(s.response_ids)
            if p < 1:
                raise ValueError(f"sample {index} has an empty prompt; the first response token needs a context")
            ids = list(s.prompt_ids) + list(s.response_ids)
            end = col + p + n
            tokens[col:end] = ids
            labels[col:end - 1] = ids[1:]
            positions[col:end] = range(p + n)
            segments[col:end] = [k] * (p + n)
            place = SampleSlot(sample_index=index, row=r, start=col, prompt_length=p, response_length=n)
            cols = place.response_columns
            _put(mask, cols, s.response_loss_mask(), "loss_mask", index)
            adv[cols] = [float(s.advantage)] * n
            if s.old_log_probs is not None:
                _put(old, cols, s.old_log_probs, "old_log_probs", index)
            if has_engine and s.engine_log_probs is not None:
                _put(engine, cols, s.engine_log_probs, "engine_log_probs", index)
            placements.append(place)
            col = end
        # pad columns: positions continue, each its own segment
        first = positions[col - 1] + 1 if col else 0
        positions[col:] = range(first, first + seq - col)
        segments[col:] = range(len(row), len(row) + seq - col)
        for name, values in zip(fields, (tokens, labels, positions, segments, mask, adv, old, engine)):
            fields[name].append(values)
    as_long = {name: torch.tensor(fields[name], dtype=torch.long).reshape(len(rows), seq)
               for name in ("tokens", "labels", "positions", "segments")}
    as_float = {name: torch.tensor(fields[name], dtype=torch.float32).reshape(len(rows), seq)
                for name in ("mask", "adv", "old", "engine")}
    tokens, labels, positions, segments = (as_long[k] for k in ("tokens", "labels", "positions", "segments"))
    mask, adv, old = as_float["mask"], as_float["adv"], as_float["old"]
    engine = as_float["engine"] if has_engine else None
    micro = MicroBatch(tokens=tokens, position_ids=positions, labels=labels, response_mask=mask, advantages=adv,
                       old_log_probs=old, engine_log_probs=engine, placements=placements, attention=attention)
    if attention == ATTENTION_MASK:
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        same = segments.unsqueeze(2) == segments.unsqueeze(1)  # [B, S, S]
        micro.attention_mask = (~(same & causal)).unsqueeze(1)
    elif attention == ATTENTION_THD:
        lengths = [samples[i].length for i in rows[0]]
        if seq > used[0]:
            lengths.append(seq - used[0])
        bounds = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        micro.cu_seqlens, micro.max_seqlen = bounds, max(lengths)
    return micro


def build_padding_micro_batch(like: MicroBatch, uniform: bool, seq_multiple: int = 1) -> MicroBatch:
    """A micro-batch of empty rows: no sample, response_mask all 0 (zero loss, zero gradient,
    but the forward/backward and its collectives run as for any other).

    uniform: the [B, S] shape of `like` (pipeline stages exchange one shape per pass); else
    the smallest, one row of round_up(2, seq_multiple) columns. The attention layout is
    `like`'s.
    """
    rows, seq = like.tokens.shape if uniform else (1, round_up(2, seq_multiple))
    return collate_packed_micro_batch([], [[] for _ in range(rows)], seq_len=seq, seq_multiple=seq_multiple,
                                      attention=like.attention)


def _put(row: List[float], cols: slice, values: Sequence[float], what: str, index: int) -> None:
    """row[cols] = values, one per response token (a list slice would silently resize)."""
    if len(values) != cols.stop - cols.start:
        raise ValueError(f"sample {index}: {what} has {len(values)} entries for {cols.stop - cols.start} "
                         "response tokens")
    row[cols] = [float(x) for x in values]


# ---------------------------------------------------------------------- reading results back
def gather_responses(values: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
    """[num samples, longest response] entries of a [B, S] tensor at each sample's response
    columns, in `placements` order; 0 past the end of a shorter response. Differentiable.

    Loss functions that aggregate per sequence (seq-mean modes) read packed rows this way.
    """
    index, valid = micro_batch.response_index()
    gathered = values.reshape(-1)[index.to(values.device)]
    return torch.where(valid.to(values.device), gathered, torch.zeros_like(gathered))


def response_values(values: torch.Tensor, micro_batch: MicroBatch) -> Dict[int, torch.Tensor]:
    """{sample index: [R] entries of a [B, S] tensor at that sample's response columns}."""
    return {p.sample_index: values[p.row, p.response_columns] for p in micro_batch.placements}
