"""A mixture's routed-expert reports as the learner ranks hold them: each data-parallel rank
those of its own samples, in one integer buffer on the host (issue #46 item 2).

The engines report the experts each token was routed to (SGLang's `meta_info.routed_experts`,
base64 of int32 [positions, num_hidden_layers, top_k]; a sample keeps them as one byte a choice,
still base64: `rollout.samples.compact_routed_experts`). A step's reports are large: the
Qwen3-30B-A3B recipe's 8192 samples at the plan's mean length (4,164 positions) x 48 layers x
top-8 hold 13.1 GB of one-byte expert ids, 17.5 GB as base64 (`plan/hand_over.py`). A learner
rank trains on its DP rank's share of the samples only (`batch.data_parallel_samples`), so
the driver takes the reports out of the samples it broadcasts and hands each DP rank its
share (`driver/expert_handover.py`) as one shard (`pack_expert_shard`):

    header   int64 [2 + 2n]    the samples of the whole step that carry a report, n, then
                               (sample index, positions) of each of the shard's n reports
    payload  uint8 [bytes]     the n reports back to back, each [positions, num_layers,
                               top_k] expert ids of `expert_id_dtype` (uint8 up to 256
                               experts, int16 beyond)

which the rank reads back (`unpack_expert_shard`) as `RoutedExperts`: per sample a view into
that one buffer, on the host; `routing.RouterWatch` moves a micro-batch's to the device as its
routers run. A report counts only when its size is [prompt + response - 1, num_layers, top_k]
of the learner's model (`decode_routed_experts`); any other is no report.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from dapo_mega.algo.train_sample import TrainSample
from dapo_mega.models.shape import ModelShape

__all__ = ["ExpertShard", "RoutedExperts", "decode_routed_experts", "expert_id_dtype", "pack_expert_shard",
           "reported_samples", "unpack_expert_shard"]

_COMPACT = {"u8": np.uint8, "u16": np.uint16}


def _split(data: str):
    """(element dtype, base64 body) of a report: the compact forms name theirs, SGLang's is int32."""
    if data.startswith(("u8:", "u16:")):
        kind, _, body = data.partition(":")
        return np.dtype(_COMPACT[kind]), body
    return np.dtype(np.int32), data


def decode_routed_experts(data: Optional[str], positions: int, num_layers: int, top_k: int) -> Optional[np.ndarray]:
    """[positions, num_layers, top_k] of an engine's report (SGLang's base64 int32, or the
    compact form a sample keeps: `rollout.samples.compact_routed_experts`), or None when there
    is none or its size is not that (a report of another model or another span of positions)."""
    if not data or positions <= 0:
        return None
    dtype, body = _split(data)
    raw = np.frombuffer(base64.b64decode(body), dtype=dtype)
    if raw.size != positions * num_layers * top_k:
        return None
    return raw.reshape(positions, num_layers, top_k)


def _report_size(data: Optional[str]) -> int:
    """Expert ids a report holds, read from its base64 length without decoding it (-1: none)."""
    if not data:
        return -1
    dtype, body = _split(data)
    decoded = len(body) // 4 * 3 - (body.endswith("=") + body.endswith("=="))
    return decoded // dtype.itemsize if decoded % dtype.itemsize == 0 else -1


def _fits(sample: TrainSample, data: Optional[str], shape: ModelShape) -> bool:
    """The report has the size of this sample's positions (all fed tokens: prompt + response - 1)."""
    positions = sample.length - 1
    return positions > 0 and _report_size(data) == positions * shape.num_layers * shape.num_experts_per_tok


def expert_id_dtype(num_experts: int) -> np.dtype:
    """The integer type of one expert id in a shard: one byte up to 256 experts, two beyond."""
    if num_experts > np.iinfo(np.int16).max + 1:
        raise ValueError(f"{num_experts} experts: an expert id does not fit int16")
    return np.dtype(np.uint8 if num_experts <= 256 else np.int16)


def reported_samples(samples: Sequence[TrainSample], reports: Sequence[Optional[str]], shape: ModelShape) -> int:
    """Samples whose report counts (`_fits`), without decoding any."""
    return sum(_fits(s, r, shape) for s, r in zip(samples, reports))


@dataclass
class ExpertShard:
    """What one data-parallel rank receives of a step's reports (module docstring)."""

    header: torch.Tensor
    """int64 [2 + 2n]: reported samples of the step, n, then (sample index, positions) per report."""
    payload: torch.Tensor
    """uint8: the n reports' expert ids back to back."""

    @property
    def nbytes(self) -> int:
        return self.header.numel() * self.header.element_size() + self.payload.numel()


def pack_expert_shard(samples: Sequence[TrainSample], reports: Sequence[Optional[str]], indices: Sequence[int],
                      shape: ModelShape, reported: int) -> ExpertShard:
    """The shard of the samples `indices` (one DP rank's: `batch.data_parallel_samples`):
    `reports[i]` is sample i's report as the driver holds it (base64; None: none), decoded
    here one at a time into the shard's one buffer; `reported`: samples of the whole step
    with a report (`reported_samples`), so that every rank counts the same."""
    dtype = expert_id_dtype(shape.num_experts)
    per_position = shape.num_layers * shape.num_experts_per_tok
    kept = [i for i in sorted(set(indices)) if _fits(samples[i], reports[i], shape)]
    positions = [samples[i].length - 1 for i in kept]
    payload = np.empty(sum(positions) * per_position * dtype.itemsize, dtype=np.uint8)
    offset = 0
    for i, n in zip(kept, positions):
        report = decode_routed_experts(reports[i], n, shape.num_layers, shape.num_experts_per_tok)
        size = n * per_position * dtype.itemsize
        payload[offset:offset + size] = report.astype(dtype, copy=False).reshape(-1).view(np.uint8)
        offset += size
    header = [reported, len(kept)] + [v for pair in zip(kept, positions) for v in pair]
    return ExpertShard(header=torch.tensor(header, dtype=torch.int64), payload=torch.from_numpy(payload))


@dataclass
class RoutedExperts:
    """One data-parallel rank's routed-expert reports of a step, on the host."""

    reports: Dict[int, np.ndarray] = field(default_factory=dict)
    """Sample index (in the step's sample list) -> its [positions, num_layers, top_k] expert ids,
    views into the shard's one buffer; samples of other DP ranks, and unreported ones, absent."""
    reported: int = 0
    """Samples of the whole step (every DP rank's) that carry a report."""

    def get(self, index: int) -> Optional[np.ndarray]:
        return self.reports.get(index)

    def covers(self, index: int, sample: TrainSample) -> bool:
        """Whether sample `index` (`sample`) has its report here, of its size."""
        report = self.reports.get(index)
        return report is not None and report.shape[0] == sample.length - 1

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reports.values())

    @classmethod
    def of_samples(cls, samples: Sequence[TrainSample], shape: ModelShape) -> "RoutedExperts":
        """Every sample's report, read from the samples themselves (a learner given its samples
        with their reports: one process, or tests); the same shard format as the ranks receive."""
        reports = [s.routed_experts for s in samples]
        shard = pack_expert_shard(samples, reports, range(len(samples)), shape,
                                  reported_samples(samples, reports, shape))
        return unpack_expert_shard(shard, shape)


def unpack_expert_shard(shard: ExpertShard, shape: ModelShape) -> RoutedExperts:
    """`RoutedExperts` of a received shard: views into its payload, nothing copied."""
    dtype = expert_id_dtype(shape.num_experts)
    header: List[int] = shard.header.tolist()
    reported, count, pairs = header[0], header[1], header[2:]
    data = shard.payload.numpy()
    per_position = shape.num_layers * shape.num_experts_per_tok * dtype.itemsize
    listed = sum(pairs[1:2 * count:2]) * per_position
    if listed != data.size:
        raise ValueError(f"a routed-expert shard of {data.size} bytes whose header lists {listed}")
    reports: Dict[int, np.ndarray] = {}
    offset = 0
    for index, positions in zip(pairs[0:2 * count:2], pairs[1:2 * count:2]):
        size = positions * per_position
        reports[index] = data[offset:offset + size].view(dtype).reshape(positions, shape.num_layers,
                                                                          shape.num_experts_per_tok)
        offset += size
    return RoutedExperts(reports=reports, reported=reported)

