"""The rollout source: prompts -> encode -> generate -> score -> filter -> a RolloutBatch.

`RolloutSource.collect(step, learner_version)` draws prompts that fit
`algo.max_prompt_length` from the data cursor, has the `RolloutManager` generate, score
(verifier + overlong penalty, `reward.compute_rewards`) and filter them (dynamic sampling),
and returns a `RolloutBatch`: the kept groups, every `ScoredSample` of the step (kept or
rejected, each with its reason: the ledger rows), the step's metrics, and snapshots of the
data cursor and the manager's state (carry-over, prompts drawn but not completed, keep-rate
estimate) for the checkpoint. In the synchronous modes the manager sizes each round from
its keep rate and aborts the requests still in flight once the batch is full
(`rollout/aborted_*` metrics; an aborted sample is no ledger row).

`AsyncRollouts` runs one `RolloutSource` on its own thread (disaggregated mode with
`cluster.max_staleness = k > 0`). The thread owns the source: its counters, its data cursor
and its manager are touched by nobody else; the main thread gets finished batches through a
queue and tells the thread which policy version the engines serve (`engines_serve`, under a
condition variable). The prompt encoder is shared and locks itself.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, List, Optional

from dapo_mega.reward.types import SampleReward, VerifyStats
from dapo_mega.rollout.manager import RolloutManager
from dapo_mega.rollout.metrics import compute_age_metrics, compute_rollout_metrics
from dapo_mega.rollout.samples import Group, ScoredSample, drop_stale_groups


@dataclass
class RolloutBatch:
    """One step's rollout (on the driver; an empty batch on the other ranks)."""

    step: int = 0
    groups: List[Group] = field(default_factory=list)
    """The train_batch_size groups the learner trains on."""
    samples: List[ScoredSample] = field(default_factory=list)
    """Every sample generated or dropped in the step, kept or not: the step's ledger rows."""
    metrics: Dict[str, float] = field(default_factory=dict)
    data_cursor: Optional[Dict[str, Any]] = None
    """The prompt iterator's state right after this batch's prompts were drawn."""
    rollout_carry: Optional[Dict[str, Any]] = None
    """The manager's state right after this batch (carry-over, pending prompts, keep rate)."""


class RolloutSource:
    """Generates, scores and filters one step's groups; see the module docstring."""

    def __init__(self, cfg: Any, prompts: Any, encoder: Any, verifier: Any, manager: RolloutManager):
        """cfg: the DapoConfig; prompts: a data.PromptIterator; encoder: a data.PromptEncoder."""
        self.cfg = cfg
        self.prompts = prompts
        self.encoder = encoder
        self.verifier = verifier
        self.manager = manager
        self.prompts_too_long = 0
        """Prompts skipped so far because they exceed algo.max_prompt_length."""

    def collect(self, step: int, learner_version: int) -> RolloutBatch:
        """Generate, score and filter the groups of `step` for a learner at `learner_version`."""
        a = self.cfg.algo
        t = time.perf_counter()
        stats: List[VerifyStats] = []  # this step's scoring rounds
        # Surplus groups carried from an older version obey max_staleness too: in the
        # synchronous modes (0) they are dropped as `stale`, so every trained sample is on-policy;
        # there the manager streams (rounds sized from its keep rate, requests in flight aborted
        # once the batch is full) so that little surplus is generated in the first place.
        groups, samples = self.manager.collect_step(
            step, learner_version, self._next_prompts, lambda gs: self._score(gs, stats), a.train_batch_size,
            a.gen_batch_size, dynamic_sampling=a.dynamic_sampling, max_num_gen_batches=a.max_num_gen_batches,
            max_staleness=self.cfg.cluster.max_staleness)
        metrics = compute_rollout_metrics(samples, time.perf_counter() - t)
        metrics.update(self.manager.metrics)
        metrics["data/prompts_too_long"] = float(self.prompts_too_long)
        if stats:
            metrics.update(_sum_verify_stats(stats).as_metrics())
        return RolloutBatch(step=step, groups=groups, samples=samples, metrics=metrics,
                            data_cursor=self.prompts.state_dict(), rollout_carry=self.manager.state_dict())

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint needs when no batch has been drawn yet."""
        return {"data_cursor": self.prompts.state_dict(), "rollout_carry": self.manager.state_dict()}

    def load_state_dict(self, data_cursor: Optional[Dict[str, Any]], rollout_carry: Optional[Dict[str, Any]],
                        problem_factory: Callable[[Dict[str, Any]], Any]) -> None:
        if data_cursor:
            self.prompts.load_state_dict(data_cursor)
        if rollout_carry:
            self.manager.load_state_dict(rollout_carry, problem_factory)

    def _next_prompts(self, n: int) -> List[Any]:
        """n problems whose prompts fit max_prompt_length (longer ones are skipped, counted)."""
        out: List[Any] = []
        for _ in range(100):
            for p in self.prompts.next_batch(n - len(out)):
                if len(self.encoder.encode(p)) <= self.cfg.algo.max_prompt_length:
                    out.append(p)
                else:
                    self.prompts_too_long += 1
            if len(out) == n:
                return out
        raise RuntimeError(f"could not find {n} prompts within algo.max_prompt_length="
                           f"{self.cfg.algo.max_prompt_length} tokens. Fix: raise algo.max_prompt_length")

    def _score(self, groups: List[Group], stats: List[VerifyStats]) -> List[List[SampleReward]]:
        """Verifier + overlong penalty of every sample of every group (the manager's reward_fn)."""
        from dapo_mega.data import verification_prefix
        from dapo_mega.reward import compute_rewards

        pairs = [(g, s) for g in groups for s in g.samples]
        if not pairs:
            return [[] for _ in groups]
        batch = compute_rewards(self.verifier, [s.response_text for _, s in pairs],
                                [g.prompt.ground_truth for g, _ in pairs], [s.response_length for _, s in pairs],
                                self.cfg.algo, answer_prefixes=[verification_prefix(g.prompt, self.cfg.data.prompt_template)
                                                                for g, _ in pairs])
        stats.append(batch.stats)
        rewards = batch.items()
        out, k = [], 0
        for g in groups:
            out.append(rewards[k:k + len(g.samples)])
            k += len(g.samples)
        return out


class AsyncRollouts:
    """A RolloutSource on its own thread, generating ahead of training.

    Batch b is started only once the engines serve a version of at least b - 1 - k, so that
    when it is consumed (at version b - 1) no token is more than k versions old — except
    tokens of groups carried over by dynamic sampling, which `take` drops as stale.
    """

    def __init__(self, source: RolloutSource, first_step: int, last_step: int, max_staleness: int,
                 engine_version: int):
        self.source = source
        self.k = max_staleness
        self.ready: "queue.Queue[Optional[RolloutBatch]]" = queue.Queue()
        self._version = engine_version
        self._version_changed = threading.Condition()
        self._stop = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(first_step, last_step), name="rollouts", daemon=True)
        self._thread.start()

    def engines_serve(self, version: int) -> None:
        """The engines now serve `version` (called by the main thread after each sync)."""
        with self._version_changed:
            self._version = version
            self._version_changed.notify_all()

    def _run(self, first_step: int, last_step: int) -> None:
        try:
            for step in range(first_step, last_step + 1):
                with self._version_changed:
                    self._version_changed.wait_for(lambda: self._stop or self._version >= step - 1 - self.k)
                    if self._stop:
                        return
                    version = self._version
                self.ready.put(self.source.collect(step, version))
        except BaseException as exc:  # handed to the main thread by take()
            self._error = exc
            self.ready.put(None)

    def take(self, step: int, learner_version: int) -> RolloutBatch:
        """The batch of `step`, consumed by a learner at `learner_version`: groups older than
        max_staleness are dropped as stale, and the kept ones are stamped with the consumer.
        Waits as long as the rollout thread lives (a round lasts what its engines need; the
        manager's liveness probes bound a hung engine, and a failed thread hands over None)."""
        while True:
            try:
                batch = self.ready.get(timeout=5.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self.ready.empty():
                    raise RuntimeError(f"rollout thread ended without the batch of step {step}: "
                                       f"{self._error}") from self._error
        if batch is None:
            raise RuntimeError(f"rollout thread failed: {self._error}") from self._error
        if batch.step != step:
            raise RuntimeError(f"rollout batch of step {batch.step} arrived for step {step}")
        fresh, stale = drop_stale_groups(batch.groups, learner_version, self.k)
        consumed = {id(s) for g in batch.groups for s in g.samples}
        batch.samples = [s for s in batch.samples if id(s) not in consumed] + \
            [s for g in fresh + stale for s in g.stamp(step, learner_version)]
        batch.groups = fresh
        batch.metrics.update(compute_age_metrics(batch.samples, len(stale)))
        return batch

    def stop(self) -> None:
        with self._version_changed:
            self._stop = True
            self._version_changed.notify_all()
        self._thread.join(timeout=60)


def _sum_verify_stats(stats: List[VerifyStats]) -> VerifyStats:
    """Verifier counts of a step's scoring rounds (max of the per-item maximum)."""
    total = stats[0]
    for s in stats[1:]:
        summed = {f.name: getattr(total, f.name) + getattr(s, f.name) for f in fields(total)}
        total = replace(total, **{**summed, "max_item_seconds": max(total.max_item_seconds, s.max_item_seconds)})
    return total
