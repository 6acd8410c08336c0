"""A mixture's routed-expert reports from the driver to the learner ranks, each DP rank its
share, on the host (issue #46 item 2).

The driver broadcasts a step's samples to every learner rank (`roles.py`), pickled. The
experts the engines routed each token to would make that object large (the Qwen3-30B-A3B
recipe: 17.5 GB a step at the plan's mean lengths, `plan/hand_over.py`) and every rank would
hold all of it, though it trains on its DP rank's samples only. So the driver takes the
reports out of the samples (`strip`) and, once the samples are broadcast, hands them over
(`send` / `receive`, over gloo groups: CPU tensors, no GPU on the way):

    driver ──(its DP rank's share, point to point)──► the first rank of each DP rank
    first rank of a DP rank ──(broadcast)──► the other ranks of that DP rank (TP, CP, PP)

Each share is one packed shard (`backends.megatron.expert_shards`: a header and the expert ids
back to back, one byte each up to 256 experts), built one DP rank at a time from the base64
reports the driver already holds, so the driver never holds a second copy of the step's
reports. Which samples a DP rank trains on is the learner's own rule
(`batch.step_mini_batches`, `batch.data_parallel_samples`), from the samples' lengths and the
step, which every rank knows.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch

from dapo_mega import distributed as D
from dapo_mega.algo.train_sample import TrainSample
from dapo_mega.backends.megatron.batch import data_parallel_samples, step_mini_batches
from dapo_mega.backends.megatron.expert_shards import (
    ExpertShard,
    RoutedExperts,
    pack_expert_shard,
    reported_samples,
    unpack_expert_shard,
)
from dapo_mega.models.shape import ModelShape

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.config import DapoConfig


def ranks_by_data_parallel(layout: "ParallelLayout", world_size: int) -> List[List[int]]:
    """The global ranks of each DP rank (`layout.coordinates_of`), each list in rank order:
    its first rank receives the DP rank's share from the driver."""
    ranks: List[List[int]] = [[] for _ in range(layout.dp)]
    for rank in range(world_size):
        ranks[layout.coordinates_of(rank)[2]].append(rank)
    return ranks


class ExpertHandOver:
    """This rank's part in handing over a step's routed-expert reports (module docstring)."""

    def __init__(self, cfg: "DapoConfig", shape: ModelShape, ranks: List[List[int]], rank: int,
                 first_ranks: Optional["ProcessGroup"], own_dp_rank: Optional["ProcessGroup"]):
        self.cfg, self.shape, self.ranks, self.rank = cfg, shape, ranks, rank
        self.driver = ranks[0][0]
        """The driver: the first rank of DP rank 0."""
        self.first_ranks = first_ranks
        """The gloo group of the driver and the first rank of every DP rank."""
        self.own_dp_rank = own_dp_rank
        """The gloo group of this rank's DP rank (its TP, CP and PP ranks)."""
        self.first = next(r[0] for r in ranks if rank in r)
        """The first rank of this rank's DP rank: it receives from the driver."""

    @classmethod
    def build(cls, cfg: "DapoConfig", layout: "ParallelLayout", shape: ModelShape,
              driver_rank: int) -> Optional["ExpertHandOver"]:
        """This rank's part, or None where nothing is handed over (a dense model, or one
        process: the samples keep their reports). Collective: every rank makes the groups."""
        if not shape.is_moe or not D.is_active():
            return None
        world = D.world_size()
        ranks = ranks_by_data_parallel(layout, world)
        if ranks[0][0] != driver_rank:
            raise RuntimeError(f"rank {driver_rank} (the driver) is not the first rank of data-parallel rank 0: {ranks}")
        first_ranks = D.host_group([r[0] for r in ranks])
        groups = [D.host_group(r) for r in ranks]  # every rank makes every group, in one order
        rank = D.rank()
        return cls(cfg, shape, ranks, rank, first_ranks, next(g for g, r in zip(groups, ranks) if rank in r))

    @staticmethod
    def strip(samples: Sequence[TrainSample]) -> Tuple[List[TrainSample], List[Optional[str]]]:
        """(the samples without their reports: what the driver broadcasts, their reports: the
        same strings, not copied)."""
        return [dataclasses.replace(s, routed_experts=None) for s in samples], [s.routed_experts for s in samples]

    def shares(self, samples: Sequence[TrainSample], step: int) -> List[List[int]]:
        """The samples each DP rank trains on at rollout step `step` (the learner's rule)."""
        m = self.cfg.megatron
        mini_batches = step_mini_batches(len(samples), self.cfg.algo, m.seed, step)
        return data_parallel_samples(samples, mini_batches, len(self.ranks), m.balance_data_parallel)

    def send(self, samples: Sequence[TrainSample], reports: Sequence[Optional[str]], step: int) -> RoutedExperts:
        """The driver: each DP rank's share to its first rank, one at a time; its own DP rank's
        to its own group. Returns the driver's own share."""
        reported = reported_samples(samples, reports, self.shape)
        shares = self.shares(samples, step)
        for dp_rank in range(1, len(self.ranks)):
            shard = pack_expert_shard(samples, reports, shares[dp_rank], self.shape, reported)
            D.send_tensor(shard.header, self.ranks[dp_rank][0], self.first_ranks)
            D.send_tensor(shard.payload, self.ranks[dp_rank][0], self.first_ranks)
            del shard
        return self._share(pack_expert_shard(samples, reports, shares[0], self.shape, reported))

    def receive(self) -> RoutedExperts:
        """Any other rank: its DP rank's share (from the driver through the DP rank's first rank)."""
        shard = None
        if self.rank == self.first:
            shard = ExpertShard(header=D.receive_tensor(self.driver, torch.int64, self.first_ranks),
                                payload=D.receive_tensor(self.driver, torch.uint8, self.first_ranks))
        return self._share(shard)

    def _share(self, shard: Optional[ExpertShard]) -> RoutedExperts:
        """The first rank's shard on every rank of its DP rank."""
        header = D.broadcast_tensor(shard.header if shard else None, self.first, torch.int64, self.own_dp_rank)
        payload = D.broadcast_tensor(shard.payload if shard else None, self.first, torch.uint8, self.own_dp_rank)
        return unpack_expert_shard(ExpertShard(header=header, payload=payload), self.shape)
