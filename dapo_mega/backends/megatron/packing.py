"""Where each training token goes: mini-batch order, data-parallel ranks, packed rows, FP8 shapes.

Pure functions of sample lengths (no torch), shared by the learner (`batch.py`,
`learner.py`), `dapo-mega plan` and the learner benchmark:

    shuffle_groups(num_samples, group_size, seed)          mini-batch order (recipe item 4)
    partition_balanced(weights, k)                         Karmarkar–Karp k-way partition
    pack_rows(lengths, indices, row_tokens, multiple)      first-fit-decreasing packing
    plan_packed_micro_batches(...)                         rows -> micro-batches
    equalized_micro_batch_count(counts, pp, vpp)           micro-batches every DP rank runs
    fp8_token_multiple(enabled, recipe)                    FP8 GEMM shape alignment
    measure_layout(...)                                    padding efficiency, DP imbalance

Why each exists, at the 32B shape (responses from a few hundred to 20,480 tokens):

* Samples arrive group by group (G responses of one prompt). Splitting them in prompt
  order gives consecutive optimizer updates correlated prompts; verl reorders the batch.
  `shuffle_groups` permutes whole groups with a seeded generator, so every rank computes
  the same order and a resumed run the same one.
* A contiguous block of samples per data-parallel rank leaves the slowest rank carrying
  far more tokens than the mean on a long-tailed length distribution. The learner splits
  each mini-batch by token count with the largest-differencing method of Karmarkar and
  Karp (as verl's `get_seqlen_balanced_partitions`, without its equal-count constraint:
  Megatron's DDP does not need equal sample counts per rank). The loss denominator stays
  the token count of the whole mini-batch (learner.py), so the split changes no result.
* Padding every sample of a micro-batch to the longest wastes most tokens when one
  response is 20k long and the others 1k. Packing puts several samples into one row:
  first-fit decreasing into rows of `row_tokens` (on the Transformer Engine spec one THD
  row of `micro_batch_tokens`; on the local spec rows as wide as the longest sample, so
  the local spec's dense [S, S] attention stays as small as padding's).
* Transformer Engine asserts that the product of all but the last dimension of an FP8 GEMM
  input (tokens of the micro-batch on this rank) is divisible by 8; megatron-core aligns to
  16 (32 for MXFP8, `megatron.core.fp8_utils.get_fp8_align_size`). Packed rows are padded
  to that multiple (times TP under sequence parallelism, which splits tokens over TP).
* Ranks are balanced by tokens and packed separately, so their micro-batch counts differ
  (at the 32B shape 2 of 20 mini-batches gave [10, 11, 11, 10, 10, 10, 10, 10]). FP8
  delayed scaling all-reduces amaxes over every TP x DP rank of a stage at each
  grad-enabled forward and in backward: a rank with one micro-batch fewer leaves the
  others in that collective forever. `equalized_micro_batch_count` is the count every DP
  rank runs (the learner pads short ranks with empty micro-batches), rounded up to what
  megatron's interleaved pipeline schedule accepts.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple` (≥ 1)."""
    return -(-value // multiple) * multiple


# ---------------------------------------------------------------------- mini-batch order
def shuffle_groups(num_samples: int, group_size: int, seed: int) -> List[int]:
    """A permutation of range(num_samples) that moves whole groups of `group_size` samples.

    Samples 0..G−1 are group 0, G..2G−1 group 1, ...; a trailing partial group is a group.
    The order within a group is kept. Deterministic in `seed` (Python's Mersenne Twister,
    the same on every rank and every machine).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    groups = [list(range(k, min(k + group_size, num_samples))) for k in range(0, num_samples, group_size)]
    random.Random(seed).shuffle(groups)
    return [i for group in groups for i in group]


# ---------------------------------------------------------------------- data-parallel ranks
def partition_contiguous(num_items: int, k: int) -> List[List[int]]:
    """Contiguous blocks, sizes differing by at most one (the layout before balancing)."""
    base, extra = divmod(num_items, k)
    parts, start = [], 0
    for rank in range(k):
        size = base + (1 if rank < extra else 0)
        parts.append(list(range(start, start + size)))
        start += size
    return parts


def partition_balanced(weights: Sequence[float], k: int) -> List[List[int]]:
    """Split positions 0..n−1 into `k` parts of nearly equal total weight (Karmarkar–Karp).

    The k-way largest differencing method: every item starts as a k-tuple of subsets (the
    item alone in one, the others empty); repeatedly the two tuples with the largest spread
    (max − min subset sum) are merged, the heaviest subset of one joined with the lightest
    of the other, until one tuple remains. O(n log n · k). Items of weight 0 are spread by
    count. Each part lists its positions in ascending order; part sizes may differ. The
    result is deterministic (ties broken by position).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(weights)
    if k == 1:
        return [list(range(n))]
    # A tuple: list of k (sum, count, items) sorted heaviest first. Heap key: -spread.
    heap: List[Tuple[float, int, List[Tuple[float, int, List[int]]]]] = []
    for pos, weight in enumerate(weights):
        subsets = [(float(weight), 1, [pos])] + [(0.0, 0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(weight), pos, subsets))
    while len(heap) > 1:
        _, tie_a, first = heapq.heappop(heap)
        _, tie_b, second = heapq.heappop(heap)
        # heaviest of `first` with lightest of `second`, and so on
        merged = [(a[0] + b[0], a[1] + b[1], a[2] + b[2]) for a, b in zip(first, reversed(second))]
        merged.sort(key=lambda s: (-s[0], -s[1]))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), min(tie_a, tie_b), merged))
    subsets = heap[0][2] if heap else [(0.0, 0, []) for _ in range(k)]
    return [sorted(s[2]) for s in subsets]


# ---------------------------------------------------------------------- packing
def pack_rows(lengths: Sequence[int], indices: Sequence[int], row_tokens: int, multiple: int = 1) -> List[List[int]]:
    """First-fit decreasing: `indices` (into `lengths`) into rows of at most `row_tokens`.

    A row's padded size round_up(Σ lengths, multiple) never exceeds `row_tokens`. Longest
    samples are placed first (ties by position); within a row samples keep placement order.
    Raises ValueError when one sample alone does not fit.
    """
    rows: List[List[int]] = []
    used: List[int] = []
    order = sorted(indices, key=lambda j: (-lengths[j], j))
    shortest = lengths[order[-1]] if order else 0
    open_rows: List[int] = []  # rows that can still take the shortest sample, in row order
    for i in order:
        length = lengths[i]
        if round_up(length, multiple) > row_tokens:
            raise ValueError(f"a sample of {length} tokens (padded to a multiple of {multiple}) exceeds the row "
                             f"of {row_tokens} tokens (megatron.micro_batch_tokens)")
        for k, r in enumerate(open_rows):
            if round_up(used[r] + length, multiple) <= row_tokens:
                rows[r].append(i)
                used[r] += length
                break
        else:
            k, r = len(open_rows), len(rows)
            rows.append([i])
            used.append(length)
            open_rows.append(r)
        # A row that cannot take the shortest sample can take none: skipping it changes no
        # placement and keeps the search linear when samples nearly fill their rows.
        if round_up(used[r] + shortest, multiple) > row_tokens:
            del open_rows[k]
    return rows


def plan_packed_micro_batches(lengths: Sequence[int], indices: Sequence[int], micro_batch_tokens: int,
                              row_tokens: Optional[int] = None, multiple: int = 1,
                              uniform: bool = False) -> Tuple[List[List[List[int]]], int]:
    """Pack `indices` into rows and rows into micro-batches; returns (micro-batches, width).

    row_tokens: width of a row; None = the longest sample padded to `multiple` (rows as
    wide as padding would make them; the local spec). Each micro-batch holds
    micro_batch_tokens // row_tokens rows (the TE spec passes row_tokens =
    micro_batch_tokens: one THD row per micro-batch).
    width: the column count every micro-batch is padded to when `uniform` (pipeline
    parallelism needs one [B, S] shape: the widest row, and every micro-batch completed
    with empty rows); 0 when not uniform (each micro-batch takes its own widest row).
    An empty `indices` gives one micro-batch of one empty row.
    """
    if not indices:
        return [[[]]], (round_up(2, multiple) if uniform else 0)
    if row_tokens is None:
        row_tokens = round_up(max(lengths[i] for i in indices), multiple)
    if row_tokens > micro_batch_tokens:
        raise ValueError(f"a sample of {row_tokens} tokens exceeds megatron.micro_batch_tokens={micro_batch_tokens}")
    rows = pack_rows(lengths, indices, row_tokens, multiple)
    per_micro = max(1, micro_batch_tokens // row_tokens)
    groups = [rows[k:k + per_micro] for k in range(0, len(rows), per_micro)]
    width = 0
    if uniform:
        width = max(round_up(max(sum(lengths[i] for i in row), 2), multiple) for row in rows)
        groups[-1] = groups[-1] + [[] for _ in range(per_micro - len(groups[-1]))]
    return groups, width


def equalized_micro_batch_count(counts: Sequence[int], pp_size: int = 1, vpp_size: Optional[int] = None,
                                group_size: Optional[int] = None) -> int:
    """Micro-batches every data-parallel rank runs in one pass of megatron's schedule.

    counts: the micro-batches each DP rank packed (or only their maximum, which is what the
    learner's all-reduce gives). The result is the largest count (at least 1); with an
    interleaved pipeline it is raised to the smallest M that megatron-core's
    `forward_backward_pipelining_with_interleaving` accepts (schedules.py, 0.16.1
    ~995-1014): with N = `microbatch_group_size_per_vp_stage` (group_size; None =
    megatron's default, pp_size), PP <= N <= M, and M mod N is 0 or at least PP (else
    RuntimeError "dependency bubbles"). With the default N = PP: a multiple of PP.

    Interleaved means pp_size > 1 and vpp_size set: megatron's `get_forward_backward_func`
    picks the interleaved schedule whenever a virtual size is set, 1 included.
    """
    count = max(1, max(counts, default=0))
    if pp_size > 1 and vpp_size is not None:
        group = pp_size if group_size is None else group_size
        if group < pp_size:
            raise ValueError(f"microbatch_group_size_per_vp_stage={group} is below the pipeline size {pp_size}; "
                             "megatron's interleaved schedule refuses it")
        count = max(count, group)
        while 0 < count % group < pp_size:
            count += 1
    return count


def fp8_token_multiple(fp8_enabled: bool, fp8_recipe: str = "delayed") -> int:
    """Alignment of the token dimension of FP8 GEMM inputs (1 when FP8 is off).

    Transformer Engine asserts the product of all but the last dimension is divisible by
    8; megatron-core's `get_fp8_align_size` pads to 16 for the delayed, tensorwise and
    blockwise recipes `megatron.fp8.recipe` takes (32 for MXFP8, which it does not take).
    """
    if fp8_enabled and fp8_recipe not in ("delayed", "tensorwise", "blockwise"):
        raise ValueError(f"megatron.fp8.recipe={fp8_recipe!r}: not one of delayed, tensorwise, blockwise")
    return 16 if fp8_enabled else 1


def token_multiple(tp: int, sequence_parallel: bool, fp8_enabled: bool, fp8_recipe: str = "delayed") -> int:
    """Columns of a micro-batch row must be a multiple of this.

    Sequence parallelism splits the columns over TP ranks (a multiple of TP); FP8 needs each
    rank's token count aligned (`fp8_token_multiple`, times TP under sequence parallelism).
    """
    split = tp if sequence_parallel else 1
    return split * fp8_token_multiple(fp8_enabled, fp8_recipe)


# ---------------------------------------------------------------------- measurement
@dataclass
class LayoutStats:
    """Tokens a learner computes for one mini-batch under a layout, and how evenly ranks carry them."""

    useful_tokens: int
    """Σ sample lengths (prompt + response) over all ranks."""
    computed_tokens: int
    """Σ rows × columns of every micro-batch of every rank (padding included)."""
    padding_efficiency: float
    """useful / computed."""
    rank_tokens: List[int]
    """computed tokens per data-parallel rank."""
    dp_imbalance: float
    """max / mean of rank_tokens (1.0 = perfectly even; the step waits for the slowest rank)."""
    micro_batches: List[int]
    """micro-batches per rank."""

    def to_dict(self) -> Dict[str, object]:
        return {"useful_tokens": self.useful_tokens, "computed_tokens": self.computed_tokens,
                "padding_efficiency": self.padding_efficiency, "rank_tokens": list(self.rank_tokens),
                "dp_imbalance": self.dp_imbalance, "micro_batches": list(self.micro_batches)}


def padded_micro_batches(lengths: Sequence[int], indices: Sequence[int], micro_batch_tokens: int,
                         multiple: int = 1) -> List[List[int]]:
    """Without packing: `indices` in order, one sample per row padded to the micro-batch's longest,
    rows·S ≤ micro_batch_tokens (the layout `batch.plan_micro_batches` builds)."""
    groups: List[List[int]] = []
    current: List[int] = []
    current_max = 0
    for i in indices:
        length = round_up(lengths[i], multiple)
        if current and max(current_max, length) * (len(current) + 1) > micro_batch_tokens:
            groups.append(current)
            current, current_max = [], 0
        current.append(i)
        current_max = max(current_max, length)
    if current:
        groups.append(current)
    return groups


def measure_layout(lengths: Sequence[int], dp: int, micro_batch_tokens: int, packing: bool, balanced: bool,
                   thd: bool = False, multiple: int = 1) -> LayoutStats:
    """Padding efficiency and DP imbalance of one mini-batch of samples of `lengths`.

    packing=False, balanced=False is the layout before this module: contiguous blocks per
    rank, each sample a row padded to the longest of its micro-batch. thd: one packed row
    per micro-batch (Transformer Engine), computed tokens = the row's padded length.
    """
    n = len(lengths)
    parts = partition_balanced(lengths, dp) if balanced else partition_contiguous(n, dp)
    rank_tokens, micro_counts = [], []
    for part in parts:
        computed = 0
        if not part:
            micro_counts.append(0)
            rank_tokens.append(0)
            continue
        if packing:
            groups, _ = plan_packed_micro_batches(lengths, part, micro_batch_tokens,
                                                  row_tokens=micro_batch_tokens if thd else None, multiple=multiple)
            for rows in groups:
                if thd:
                    computed += sum(round_up(sum(lengths[i] for i in row), multiple) for row in rows)
                else:
                    width = max(round_up(sum(lengths[i] for i in row), multiple) for row in rows)
                    computed += width * len(rows)
            micro_counts.append(len(groups))
        else:
            groups = padded_micro_batches(lengths, part, micro_batch_tokens, multiple)
            for group in groups:
                computed += max(round_up(lengths[i], multiple) for i in group) * len(group)
            micro_counts.append(len(groups))
        rank_tokens.append(computed)
    useful = int(sum(lengths))
    computed_total = int(sum(rank_tokens))
    mean = computed_total / max(dp, 1)
    return LayoutStats(useful_tokens=useful, computed_tokens=computed_total,
                       padding_efficiency=useful / computed_total if computed_total else 1.0,
                       rank_tokens=rank_tokens, dp_imbalance=max(rank_tokens) / mean if mean else 1.0,
                       micro_batches=micro_counts)
