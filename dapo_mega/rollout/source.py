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
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from dapo_mega.environments.base import take_environment_metrics
from dapo_mega.reward.types import SampleReward, VerifyStats
from dapo_mega.rollout.batch_fill import SamplingRule
from dapo_mega.rollout.manager import RolloutManager
from dapo_mega.rollout.metrics import compute_age_metrics, compute_rollout_metrics
from dapo_mega.rollout.samples import Group, ScoredSample, drop_stale_groups
from dapo_mega.rollout.turns import fold_turn_rewards

if TYPE_CHECKING:
    from dapo_mega.config import DapoConfig
    from dapo_mega.data import Problem, PromptEncoder, PromptIterator
    from dapo_mega.data.iterator import PromptCursor
    from dapo_mega.reward.types import Verifier


@dataclass
class RolloutBatch:
    """One step's rollout (on the driver; an empty batch on the other ranks)."""

    step: int = 0
    groups: List[Group] = field(default_factory=list)
    """The train_batch_size groups the learner trains on."""
    samples: List[ScoredSample] = field(default_factory=list)
    """Every sample generated or dropped in the step, kept or not: the step's ledger rows."""
    metrics: Dict[str, float] = field(default_factory=dict)
    data_cursor: Optional[PromptCursor] = None
    """The prompt iterator's state right after this batch's prompts were drawn."""
    rollout_carry: Optional[Dict[str, Any]] = None
    """The manager's state right after this batch (carry-over, pending prompts, keep rate)."""
    seconds: float = 0.0
    """Wall time of its generation and scoring (refills included)."""


class RolloutSource:
    """Generates, scores and filters one step's groups; see the module docstring."""

    def __init__(self, cfg: DapoConfig, prompts: PromptIterator, encoder: PromptEncoder, verifier: Verifier,
                 manager: RolloutManager):
        """cfg: the DapoConfig; prompts: a data.PromptIterator; encoder: a data.PromptEncoder."""
        self.cfg = cfg
        self.prompts = prompts
        self.encoder = encoder
        self.verifier = verifier
        self.manager = manager
        self.prompts_too_long = 0
        self._stats: List[VerifyStats] = []
        """The verifier's stats of each scoring round of the step being collected."""
        """Prompts skipped so far because they exceed algo.max_prompt_length."""

    def collect(self, step: int, learner_version: int, num_groups: Optional[int] = None) -> RolloutBatch:
        """Generate, score and filter the groups of `step` for a learner at `learner_version`
        (algo.train_batch_size of them, or `num_groups` to refill a batch)."""
        a = self.cfg.algo
        t = time.perf_counter()
        self._stats: List[VerifyStats] = []  # this step's scoring rounds
        # Groups carried from an older version obey the age limit (cluster.max_sample_age): older
        # ones are dropped as `stale`. The synchronous modes (no queue) stream: rounds sized from
        # the keep rate, the batch filled in prompt order, prompts after the last one needed put
        # back (rollout/batch_fill.py), so nothing is carried and the batch does not depend on timing.
        groups, samples = self.manager.collect_step(step, learner_version, self,
                                                    SamplingRule.from_config(a, self.cfg.cluster, num_groups))
        seconds = time.perf_counter() - t
        metrics = compute_rollout_metrics(samples, seconds, multi_turn=bool(self.cfg.rollout.environment))
        # ages as stamped here (a learner at learner_version); AsyncRollouts.take restamps them
        metrics.update(compute_age_metrics(samples, len({s.prompt_id for s in samples if s.reject_reason == "stale"})))
        metrics.update(self.manager.metrics)
        metrics.update(take_environment_metrics(self.manager.settings.environment))  # the sandbox's runs by isolation
        metrics["data/prompts_too_long"] = float(self.prompts_too_long)
        if self._stats:
            metrics.update(_sum_verify_stats(self._stats).as_metrics())
        return RolloutBatch(step=step, groups=groups, samples=samples, metrics=metrics,
                            data_cursor=self.prompts.state_dict(), rollout_carry=self.manager.state_dict(),
                            seconds=seconds)

    def state_dict(self) -> Dict[str, object]:
        """What a checkpoint needs when no batch has been drawn yet."""
        return {"data_cursor": self.prompts.state_dict(), "rollout_carry": self.manager.state_dict()}

    def load_state_dict(self, data_cursor: Optional[PromptCursor], rollout_carry: Optional[Dict[str, Any]]) -> None:
        if data_cursor:
            self.prompts.load_state_dict(data_cursor)
        if rollout_carry:
            self.manager.load_state_dict(rollout_carry, self)

    @staticmethod
    def decode(plain: Dict[str, Any]) -> "Problem":
        """A problem from the plain data a checkpoint stored of it (`PromptDecoding`)."""
        d = dict(plain)
        if isinstance(d.get("messages"), list):
            d["messages"] = tuple(d["messages"])
        from dapo_mega.data import Problem

        return Problem(**d)

    # ---------------------------------------------------------------- StepInputs (rollout/dynamic_sampling.py)
    def draw(self, n: int) -> List[Problem]:
        """n problems whose prompts fit max_prompt_length (longer ones are skipped, counted)."""
        out: List[Problem] = []
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

    def score(self, groups: List[Group]) -> List[List[SampleReward]]:
        """Verifier + overlong penalty of every sample of every group (its stats kept for the step's metrics)."""
        from dapo_mega.reward import score_groups

        if not any(g.samples for g in groups):
            return [[] for _ in groups]
        batch = score_groups(self.verifier, groups, self.cfg.algo, self.cfg.data.prompt_template)
        self._stats.append(batch.stats)
        rewards = batch.items()
        out, k = [], 0
        for g in groups:
            # a multi-turn sample's environment adds its turns' rewards, folded (rollout/turns.py)
            env = [fold_turn_rewards(s.turn_rewards, self.cfg.rollout.turn_reward) for s in g.samples]
            out.append([replace(r, reward=r.reward + e, environment=e) if e else r
                        for e, r in zip(env, rewards[k:k + len(g.samples)])])
            k += len(g.samples)
        return out


class AsyncRollouts:
    """A RolloutSource on its own thread, generating ahead of training.

    Batch b is started only once the engines serve a version of at least b - 1 - k
    (k = cluster.max_staleness, the queue), so that when it is consumed (at version b - 1)
    no token is more than k versions old. `take` drops groups older than the age limit a
    (cluster.max_sample_age, default k; groups carried over by dynamic sampling can be older
    than k) as stale and refills the batch with groups generated for it at the engines'
    current version (`_refill`: the thread serves the request before its next batch). A batch
    that was refilled checkpoints the data cursor and carry-over after the refill, so a resume
    skips the prompts drawn ahead for the next batch rather than training twice on the
    refill's.
    """

    MAX_REFILLS = 10
    """Refill rounds of one batch before giving up (every refill is at the current version,
    so one suffices unless dynamic sampling carried old groups in again)."""

    def __init__(self, source: RolloutSource, first_step: int, last_step: int, max_staleness: int,
                 engine_version: int, max_sample_age: Optional[int] = None):
        self.source = source
        self.k = max_staleness
        self.age_limit = max_staleness if max_sample_age is None else max_sample_age
        self.ready: "queue.Queue[Optional[RolloutBatch]]" = queue.Queue()
        self._refills: "queue.Queue[RolloutBatch]" = queue.Queue()
        self._refill_wanted: Optional[Tuple[int, int, int]] = None
        """(step, learner version, groups) the main thread waits for; served first."""
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
            step = first_step
            while True:
                with self._version_changed:
                    self._version_changed.wait_for(lambda: self._stop or self._refill_wanted is not None
                                                   or (step <= last_step and self._version >= step - 1 - self.k))
                    if self._stop:
                        return
                    wanted, self._refill_wanted = self._refill_wanted, None
                    version = self._version
                if wanted is not None:
                    refill_step, learner_version, groups = wanted
                    self._refills.put(self.source.collect(refill_step, min(version, learner_version), groups))
                    continue
                self.ready.put(self.source.collect(step, version))
                step += 1
        except BaseException as exc:  # handed to the main thread by take()
            self._error = exc
            self.ready.put(None)
            self._refills.put(None)

    def _wait(self, q: "queue.Queue[Optional[RolloutBatch]]", what: str) -> RolloutBatch:
        """The next item of `q` while the thread lives (a round lasts what its engines need; the
        manager's liveness probes bound a hung engine, and a failed thread hands over None)."""
        while True:
            try:
                batch = q.get(timeout=5.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and q.empty():
                    raise RuntimeError(f"rollout thread ended without {what}: {self._error}") from self._error
        if batch is None:
            raise RuntimeError(f"rollout thread failed: {self._error}") from self._error
        return batch

    def take(self, step: int, learner_version: int) -> RolloutBatch:
        """The batch of `step`, consumed by a learner at `learner_version`: groups older than
        the age limit are dropped as stale and refilled, and the kept ones are stamped with
        the consumer."""
        batch = self._wait(self.ready, f"the batch of step {step}")
        if batch.step != step:
            raise RuntimeError(f"rollout batch of step {batch.step} arrived for step {step}")
        want = len(batch.groups)
        fresh, stale = self._restamp(batch, step, learner_version)
        refilled = 0
        for _ in range(self.MAX_REFILLS):
            if len(fresh) >= want:
                break
            more = self._refill(step, learner_version, want - len(fresh))
            more_fresh, more_stale = self._restamp(more, step, learner_version)
            fresh, stale, refilled = fresh + more_fresh, stale + more_stale, refilled + len(more_fresh)
            batch.samples += more.samples
            batch.data_cursor, batch.rollout_carry = more.data_cursor, more.rollout_carry
            batch.seconds += more.seconds
        batch.groups = fresh[:want]
        batch.metrics = {k: v for k, v in batch.metrics.items() if not k.startswith(("age/", "rollout/age_"))}
        # refills and stale ones in; a multi-turn run's batch already has its turn metrics
        batch.metrics.update(compute_rollout_metrics(batch.samples, batch.seconds,
                                                     multi_turn="rollout/turns_mean" in batch.metrics))
        batch.metrics.update(compute_age_metrics(batch.samples, len(stale)))
        batch.metrics["rollout/refilled_groups"] = float(refilled)
        return batch

    def _restamp(self, batch: RolloutBatch, step: int, learner_version: int) -> Tuple[List[Group], List[Group]]:
        """Drop `batch`'s groups older than the age limit; stamp every group's samples with the
        consumer (in place, in batch.samples); (fresh, stale)."""
        fresh, stale = drop_stale_groups(batch.groups, learner_version, self.age_limit)
        consumed = {id(s) for g in batch.groups for s in g.samples}
        batch.samples = [s for s in batch.samples if id(s) not in consumed] + \
            [s for g in fresh + stale for s in g.stamp(step, learner_version)]
        return fresh, stale

    def _refill(self, step: int, learner_version: int, groups: int) -> RolloutBatch:
        """`groups` more groups for `step`, generated by the thread at the engines' version."""
        with self._version_changed:
            self._refill_wanted = (step, learner_version, groups)
            self._version_changed.notify_all()
        return self._wait(self._refills, f"the refill of step {step}")

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
