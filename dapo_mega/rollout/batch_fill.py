"""One step's batch, filled in prompt order: the rollout manager's dynamic sampling (DAPO §3.2).

Groups are decided (scored by `reward_fn`, filtered by `dapo_mega.algo.select_informative_groups`,
Eq. 11, then kept or made ledger rows) strictly in the order of a round's prompts, so the batch
is the first `train_batch_size` groups in prompt order that pass the filter, however the
groups were cut into requests and whichever request finished first. Streamed
(`RolloutManager.collect_step`, synchronous modes), no group after the batch is full is
decided, nor scored; otherwise every group is decided and the kept surplus is carried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Protocol, Sequence

import torch

from dapo_mega.reward.types import SampleReward
from dapo_mega.rollout.partial import PARTIAL_COUNTS
from dapo_mega.rollout.samples import TRAINED_REASONS, Group, PromptItem, ScoredSample

if TYPE_CHECKING:
    from dapo_mega.config import AlgoConfig, ClusterConfig

__all__ = ["BatchFill", "KEEP_RATE_EMA", "KeepRate", "SET_ASIDE_COUNTS", "SamplingRule", "Scorer", "select_groups"]

KEEP_RATE_EMA = 0.03
"""Weight of each finished group in the keep-rate estimate (half-life ~23 groups)."""


class Scorer(Protocol):
    """What scores a step's groups (the run's reward: `StepInputs`)."""

    def score(self, groups: List[Group]) -> List[List[SampleReward]]:
        """Per group, per sample, its reward."""


class KeepRate:
    """The estimated fraction of generated groups dynamic sampling keeps: a ratio of
    exponentially decayed counts (KEEP_RATE_EMA per decided group) of kept and decided groups,
    carried in checkpoints (`counts`)."""

    def __init__(self) -> None:
        self.counts = [0.0, 0.0]

    @property
    def value(self) -> Optional[float]:
        """None until a group has been decided."""
        kept, seen = self.counts
        return kept / seen if seen > 0 else None

    def observe(self, kept: int, seen: int) -> None:
        if seen <= 0:
            return
        decay = (1.0 - KEEP_RATE_EMA) ** seen
        self.counts = [self.counts[0] * decay + kept, self.counts[1] * decay + seen]


@dataclass(frozen=True)
class SamplingRule:
    """What one step's batch is filled by: dynamic sampling's settings, read from the run's
    `algo` and `cluster` sections in one place (`from_config`), passed down as one object."""

    train_batch_size: int
    """Groups the step trains on."""
    gen_batch_size: int
    """Prompts of a round (a streamed round: until a keep rate has been measured)."""
    dynamic_sampling: bool = True
    """Filter groups (Eq. 11) and refill; off: every group of one round is kept."""
    max_num_gen_batches: int = 0
    """Rounds before giving up (0: no limit)."""
    max_staleness: Optional[int] = None
    """Age limit of carried groups (None: none is dropped)."""
    stream: Optional[bool] = None
    """Streamed rounds (rollout/dynamic_sampling.py); None: when max_staleness == 0."""
    metric: str = "acc"
    """What a kept group varies in: the verdicts ("acc") or the rewards ("score")."""

    @property
    def streamed(self) -> bool:
        return self.max_staleness == 0 if self.stream is None else self.stream

    @classmethod
    def from_config(cls, algo: "AlgoConfig", cluster: "ClusterConfig",
                    train_batch_size: Optional[int] = None) -> "SamplingRule":
        """The run's rule (`train_batch_size`: a refill's own size instead of algo's). The
        synchronous modes (no queue) stream; carried groups obey cluster.age_limit."""
        return cls(train_batch_size or algo.train_batch_size, algo.gen_batch_size, algo.dynamic_sampling,
                   algo.max_num_gen_batches, cluster.age_limit, cluster.max_staleness == 0,
                   algo.dynamic_sampling_metric)


def filter_metric(groups: Sequence[Group], metric: str = "acc") -> str:
    """What the group filter reads: `metric`, but "score" where it is "acc" and a sample has
    no verdict (its reward gave a bare score: `reward/returns.py`). A score is no verdict:
    0.1 for a well-formatted wrong answer must not make a group of wrong answers "mixed"."""
    if metric == "acc" and any(s.correct is None for g in groups for s in g.samples):
        return "score"
    return metric


def select_groups(groups: Sequence[Group], metric: str = "acc"):
    """Per-sample reasons through the algo package's group filter (Eq. 11): on the verdicts
    ("acc") or on the rewards alone ("score"; `SamplingRule.metric`, `filter_metric`)."""
    from dapo_mega.algo import select_informative_groups

    metric = filter_metric(groups, metric)
    rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float32)
    correct = torch.tensor([s.correct for g in groups for s in g.samples]) if metric == "acc" else None
    index = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    return select_informative_groups(rewards, index, correct=correct)


SET_ASIDE_COUNTS = ("aborted_requests", "aborted_samples", "aborted_tokens", "discarded_groups",
                     "discarded_samples", "discarded_tokens")
"""Counts of a streamed step's work that is no ledger row: `rollout/<name>` metrics (see
dapo_mega/rollout/manager.py's module docstring)."""


class BatchFill:
    """One step's batch, filled in prompt order (module docstring; RolloutManager.collect_step).

    `take` is given each finished chunk of a round in order: it decides groups (scores them, filters them, keeps
    them or makes them ledger rows) strictly in the order of the round's prompts. Streamed, it
    decides no group once the batch is full, and scores at most as many groups at a time as
    are still needed, so a group after the last one needed is never scored either; otherwise
    it decides every group and the kept surplus is carried.
    """

    def __init__(self, step: int, learner_version: int, scorer: Scorer, rule: SamplingRule, carried: Sequence[Group],
                 keep_rate: KeepRate):
        """`keep_rate` observes every decided group, in order (the run's estimate)."""
        self.keep_rate = keep_rate
        self.step, self.learner_version = step, learner_version
        self.scorer = scorer
        self.rule = rule
        self.stream = rule.streamed
        self.kept: List[Group] = list(carried)
        self.samples: List[ScoredSample] = []
        """The step's ledger rows so far (rejected and stale groups; kept ones are added last)."""
        self.counts = {"rounds": 0, "seen": 0, "all_correct": 0, "all_wrong": 0, "requested": 0,
                       "score_filtered_groups": 0,
                       **{k: 0 for k in SET_ASIDE_COUNTS + PARTIAL_COUNTS}}
        self.round_prompts: Sequence[PromptItem] = ()
        self.decided = 0
        """Groups of the current round decided: always its first `decided` prompts."""

    def need(self) -> int:
        return max(0, self.rule.train_batch_size - len(self.kept))

    def full(self) -> bool:
        return len(self.kept) >= self.rule.train_batch_size

    def start_round(self, prompts: Sequence[PromptItem]) -> None:
        self.round_prompts, self.decided = prompts, 0

    def take(self, groups: List[Group]) -> bool:
        """Decide `groups` (the next ones in prompt order) as far as the rule allows; True once
        the batch is full. Groups that are not the next in prompt order (handed over after a
        failed chunk, when the round fails anyway) are left undecided."""
        groups = list(groups)
        if not groups or self.decided >= len(self.round_prompts) or \
                groups[0].prompt is not self.round_prompts[self.decided]:
            return self.full()
        while groups and not (self.stream and self.full()):
            n = self.need() if self.stream else len(groups)
            part, groups = groups[:n], groups[n:]
            self._decide(part)
        return self.full()

    def _decide(self, groups: List[Group]) -> None:
        """Score and filter `groups` into kept / rejected (ledger rows), in order."""
        for g, rewards in zip(groups, self.scorer.score(groups)):
            for s, reward in zip(g.samples, rewards):
                s.score = reward
        if self.rule.dynamic_sampling:
            metric = filter_metric(groups, self.rule.metric)
            sel = select_groups(groups, metric)
            if metric != self.rule.metric:
                self.counts["score_filtered_groups"] += len(groups)
            self.counts["all_correct"] += sel.num_all_correct
            self.counts["all_wrong"] += sel.num_all_wrong
            offset = 0
            for g in groups:
                g.set_reasons(sel.sample_reasons[offset:offset + len(g.samples)])
                offset += len(g.samples)
        else:
            for g in groups:
                g.set_reasons(["kept"] * len(g.samples))
        for g in groups:
            for s in g.samples:
                if s.score.verifier_error and s.reject_reason == "kept":
                    s.reject_reason = "verifier_error"
            kept = any(s.reject_reason in TRAINED_REASONS for s in g.samples)
            if kept:
                self.kept.append(g)
            else:
                self.samples.extend(g.stamp(self.step, self.learner_version))
            # one group at a time: the estimate depends on the groups decided, in order, and not
            # on how they were cut into requests
            self.keep_rate.observe(int(kept), 1)
        self.decided += len(groups)
        self.counts["seen"] += len(groups)
