"""Rank roles, expressed once: the driver (global rank 0) and every other learner rank.

Every learner rank runs the same loop. Global rank 0 is also the driver: it owns the data,
the rollout source (and through it the engines' rollout manager), the ledger, the records
and the held-out evaluation, and hands each step's samples to the other ranks. Each rank
holds one role object with the same methods: `DriverRole` does the work and broadcasts
what the others need; `LearnerRankRole` does nothing, or receives the broadcast. The loop
calls them without testing the rank.

What the driver hands over travels on the host (`host_group`, gloo: never a pickled object
through a GPU), and a mixture's routed-expert reports apart from the samples, each DP rank
only its share (`routed_experts`, `expert_handover.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from dapo_mega import distributed as D
from dapo_mega import log
from dapo_mega.driver import advantages
from dapo_mega.driver.expert_handover import ExpertHandOver
from dapo_mega.driver.gate import DriverGate
from dapo_mega.driver.run_state import RunState, WallClock, write_ledger
from dapo_mega.driver.stop_signal import WALL_TIME
from dapo_mega.engines.book import BookView
from dapo_mega.records.ledger import LedgerText, prepare_writer
from dapo_mega.rollout.source import AsyncRollouts, RolloutBatch, RolloutSource

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from dapo_mega.algo.train_sample import TrainSample
    from dapo_mega.backends.megatron.expert_shards import RoutedExperts
    from dapo_mega.config import DapoConfig
    from dapo_mega.data import PromptIterator
    from dapo_mega.data.build import EvalSet
    from dapo_mega.driver.eval_beside import EvalBeside
    from dapo_mega.evaluate import EvalResult
    from dapo_mega.records.recorder import RunRecorder
    from dapo_mega.weights.sync import WeightSyncer

logger = log.get(__name__)

DRIVER_RANK = 0


class LearnerRankRole:
    """A learner rank other than the driver: no data, engines or records of its own.

    Whatever the driver hands over, this rank first waits for on the store (`gate`), then
    receives in one collective: no collective timeout bounds the driver's rollout or eval."""

    is_driver = False

    def __init__(self, gate: Optional[DriverGate] = None, host_group: Optional["ProcessGroup"] = None,
                 experts: Optional[ExpertHandOver] = None):
        """`host_group`: the learner ranks' gloo group what is handed over travels in (None: the
        default group); `experts`: the hand-over of a mixture's routed experts (None: the
        samples keep theirs)."""
        self.gate = gate or DriverGate()
        self.host_group = host_group
        self.experts = experts

    def broadcast(self, obj: object = None, stall_timeout_s: Optional[float] = None) -> Any:
        """The driver's `obj` (inside the trusted learner group only), once it is ready;
        `stall_timeout_s` replaces cluster.driver_stall_timeout_s for this wait (the engines' start)."""
        self.gate.handover(stall_timeout_s)
        return D.broadcast_object(obj, src=DRIVER_RANK, group=self.host_group)

    def say(self, message: str, error: bool = False) -> None:
        """A line on the run's console (the driver's); nothing elsewhere."""

    def sft_samples(self, batch_size: int) -> list:
        """The warm start's next supervised batch, as the driver built it."""
        return self.broadcast()

    def start_rollouts(self, first_step: int) -> None:
        """Start generating ahead of training when the mode asks for it."""

    def next_rollout_batch(self, step: int, learner_version: int) -> RolloutBatch:
        return RolloutBatch(step=step)

    def train_samples(self, batch: RolloutBatch) -> list:
        """The step's TrainSamples (advantages computed on the driver), on every rank; with an
        expert hand-over, without their routed experts (`routed_experts`)."""
        return self.broadcast()

    def routed_experts(self, samples: Sequence["TrainSample"], step: int) -> Optional["RoutedExperts"]:
        """A mixture's routed-expert reports of this rank's DP share of `samples` (the step's, as
        `train_samples` gave them), on the host; None without a hand-over (the samples carry
        them). Collective over the learner ranks."""
        return self.experts.receive() if self.experts is not None else None

    def engine_changes(self) -> BookView:
        """The driver's engine book (`BookView`: dead, rejoining, deaths), on every rank.
        Collective; the driver probes its dead engines first."""
        return self.broadcast()

    def engines_lost(self, lost: Dict[str, str]) -> None:
        """Engines a weight sync lost (url -> why) join the driver's dead list (every rank
        holds the same `lost`; the next `engine_changes` hands them to all)."""

    def engines_serve(self, version: int, rejoined: Sequence[str] = ()) -> None:
        """The engines (`rejoined` among them, after their first sync back) now serve `version`."""

    def release_engine_memory(self, syncer: Optional["WeightSyncer"]) -> None:
        """Colocated: the engines free their memory for the learner's step (the driver asks)."""

    def resume_engine_memory(self, syncer: Optional["WeightSyncer"]) -> None:
        """Colocated: the engines take their memory back after the learner's step."""

    def write_ledger(self, step: int, batch: RolloutBatch) -> None:
        pass

    def evaluate(self) -> Dict[str, float]:
        """Held-out avg@k through the engines: metrics on the driver, {} elsewhere (after the
        driver's evaluation: the collective that follows must not start before it ends)."""
        self.gate.handover()
        return {}

    def begin_eval(self) -> None:
        """The driver starts the held-out evaluation beside the next step (`eval_beside.py`)."""

    def finish_eval(self, wait: bool = True) -> Dict[str, float]:
        """After the driver has ended the evaluation begun by `begin_eval` (a hand-over: the
        collective that follows must not start before it ends); {} here."""
        self.gate.handover()
        return {}

    def log_step(self, step: int, metrics: Dict[str, float], timings: Dict[str, float]) -> None:
        pass

    def checkpoint_state(self) -> Dict[str, object]:
        """What only the driver adds to a checkpoint's trainer state."""
        return {}

    def stop_reason(self, clock: WallClock, stop_signal: str = "") -> str:
        """Why the run stops after this step ("" = it goes on): a stop signal the driver received
        ("SIGUSR1", "SIGTERM": `stop_signal.py`), else WALL_TIME when the next step would not fit
        the wall-time limit. The driver's clock, limit and signal decide for every rank (under
        Slurm each rank's limit is its own squeue answer, which can differ or be missing, and
        ranks receive a signal at slightly different times). Collective, limited or not."""
        return str(self.broadcast())

    def close(self) -> None:
        self.gate.close()


class DriverRole(LearnerRankRole):
    """Global rank 0: data, rollouts, ledger, records and evaluation; see the module docstring."""

    is_driver = True

    def __init__(self, cfg: "DapoConfig", run: RunState, rollouts: RolloutSource, sft_prompts: "PromptIterator",
                 eval_sets: List["EvalSet"], recorder: "RunRecorder", gate: Optional[DriverGate] = None,
                 host_group: Optional["ProcessGroup"] = None, experts: Optional[ExpertHandOver] = None):
        super().__init__(gate or DriverGate(is_driver=True), host_group, experts)
        self.gate.start()
        self.cfg = cfg
        self.run = run
        self.rollouts = rollouts
        self.book = rollouts.manager.book
        """Which engines serve, are dead or rejoin: the one record (engines/book.py)."""
        self.sft_prompts = sft_prompts
        self.eval_sets = eval_sets
        """The held-out sets (data/build.py EvalSet), the unnamed one first."""
        self.recorder = recorder
        self.producer: Optional[AsyncRollouts] = None
        self.eval_beside: Optional["EvalBeside"] = None
        """The evaluation running beside the next step, if any (`begin_eval`)."""
        self.last_batch: Optional[RolloutBatch] = None
        """The last batch whose ledger shard was written: its cursor and carry go into the checkpoint."""
        self._held_reports: Optional[List[Optional[str]]] = None
        """The routed experts `train_samples` took out of the step's samples, until `routed_experts`."""
        prepare_writer()

    def say(self, message: str, error: bool = False) -> None:
        (logger.warning if error else logger.info)(message)

    def sft_samples(self, batch_size: int) -> list:
        from dapo_mega.algo.train_sample import TrainSample
        from dapo_mega.data import reference_segments

        encoder = self.rollouts.encoder
        eos = encoder.eos_token_id
        samples = [TrainSample(prompt_ids=encoder.encode(p),
                               response_ids=[t for seg in reference_segments(p) for t in encoder.encode_text(seg) + [eos]])
                   for p in self.sft_prompts.next_batch(batch_size)]
        return self.broadcast(samples)

    def start_rollouts(self, first_step: int) -> None:
        c = self.cfg.cluster
        if c.mode == "disaggregated" and c.max_staleness > 0:
            self.producer = AsyncRollouts(self.rollouts, first_step, self.cfg.trainer.total_steps, c.max_staleness,
                                          engine_version=self.run.state.policy_version,
                                          max_sample_age=c.max_sample_age)

    def next_rollout_batch(self, step: int, learner_version: int) -> RolloutBatch:
        if self.producer is None:
            return self.rollouts.collect(step, learner_version)
        return self.producer.take(step, learner_version)

    def advantage_step(self, batch: RolloutBatch) -> list:
        """Group-relative advantages and token lists of the kept groups."""
        from dapo_mega.config import partial_rollout_enabled

        mask = self.cfg.rollout.mask_offpolicy_in_partial_rollout and partial_rollout_enabled(self.cfg)
        return advantages.build_train_samples(batch.groups, self.cfg.algo, mask_offpolicy=mask)

    def train_samples(self, batch: RolloutBatch) -> list:
        samples = self.advantage_step(batch)
        if self.experts is not None:
            samples, self._held_reports = self.experts.strip(samples)
        return self.broadcast(samples)

    def routed_experts(self, samples: Sequence["TrainSample"], step: int) -> Optional["RoutedExperts"]:
        if self.experts is None:
            return None
        reports, self._held_reports = self._held_reports, None
        return self.experts.send(samples, reports, step)

    def engine_changes(self) -> BookView:
        for url in self.book.probe_dead(self.cfg.rollout.liveness_probe_interval_s):
            self.say(f"[trainer] engine {url} answers again: it rejoins the weight sync, then the rollouts",
                     error=True)
        return self.broadcast(self.book.view())

    def engines_lost(self, lost: Dict[str, str]) -> None:
        self.book.mark_all_dead({url: f"lost during the weight sync: {why}" for url, why in lost.items()})

    def engines_serve(self, version: int, rejoined: Sequence[str] = ()) -> None:
        if rejoined:
            self.book.serve_again(rejoined)
        if self.producer is not None:
            self.producer.engines_serve(version)

    def release_engine_memory(self, syncer: Optional["WeightSyncer"]) -> None:
        if self.cfg.cluster.mode == "colocated" and syncer is not None:
            self._tolerating_lost(syncer.release_engine_memory)

    def resume_engine_memory(self, syncer: Optional["WeightSyncer"]) -> None:
        if self.cfg.cluster.mode == "colocated" and syncer is not None:
            restarted = self._tolerating_lost(syncer.resume_engine_memory) or []
            for url in restarted:  # not resumed (a second resume would end it); found dead and back next
                self.say(f"[trainer] engine {url} restarted while the learner trained: a new process holds its "
                         "memory and none of the weights; it rejoins the weight sync", error=True)
            self.book.mark_all_dead({url: "restarted while the learner trained" for url in restarted})

    def _tolerating_lost(self, call):
        """`call()` has reached every engine; one gone meanwhile (killed while the learner
        trained) is marked dead instead of ending the run: the next sync drops it. Returns what
        `call` returned, None when an engine was lost."""
        from dapo_mega.weights.sync import EngineLostError

        try:
            return call()
        except EngineLostError as exc:
            if exc.others:
                raise
            for url, why in exc.lost.items():
                self.say(f"[trainer] engine {url} lost: {why}", error=True)
            self.book.mark_all_dead(exc.lost)

    def write_ledger(self, step: int, batch: RolloutBatch) -> None:
        write_ledger(self.run.run_dir, self.run.run_id, step, batch.samples, text=LedgerText.of(self.cfg.trainer),
                     run_name=self.cfg.trainer.run_name, encoder=self.rollouts.encoder.fingerprint())
        self.last_batch = batch

    def evaluate(self) -> Dict[str, float]:
        try:
            return self._evaluate()
        finally:
            self.gate.handover()  # the other ranks wait for the evaluation's end

    def _evaluate(self) -> Dict[str, float]:
        from dapo_mega.evaluate import evaluate_set

        results = [evaluate_set(self.book, eval_set, self.cfg, self.rollouts.encoder, self.rollouts.verifier,
                                run_id=self.run.run_id) for eval_set in self.eval_sets]
        return self._record_eval(self.run.state.step, results)

    def _record_eval(self, step: int, results: List["EvalResult"], how: str = "") -> Dict[str, float]:
        """Each set's result file, console line and metrics."""
        from dapo_mega.driver.run_state import eval_result_path

        metrics: Dict[str, float] = {}
        for result in results:
            result.write(eval_result_path(self.run.run_dir, step, result.name))
            self.say(f"[eval] step {step}: {result.label} avg@{result.k} = {result.avg_at_k:.4f} on "
                     f"{len(result.problems)} problems{how}; {result.engine_line()}")
            metrics.update(result.metrics())
        return metrics

    def begin_eval(self) -> None:
        from dapo_mega.driver.eval_beside import EvalBeside

        self.eval_beside = EvalBeside.start(self.run.state.step, self.book, self.eval_sets, self.cfg,
                                            self.rollouts.encoder, self.rollouts.verifier, self.run.run_id)

    def finish_eval(self, wait: bool = True) -> Dict[str, float]:
        """The evaluation begun by `begin_eval`, recorded under its step once it has ended; with
        `wait` False (a run stopping on a signal or its time limit) {} unless it already has."""
        job, self.eval_beside = self.eval_beside, None
        try:
            if job is None:
                return {}
            if not wait and not job.done:
                self.say(f"[eval] step {job.step}: not waited for (the run stops); its row has no eval figures",
                         error=True)
                return {}
            results = job.join()  # engines it found dead are out of the book already
            metrics = self._record_eval(job.step, results, f" (beside the next step, {job.seconds:.0f} s)")
            return {**metrics, "eval/beside_s": round(job.seconds or 0.0, 3)}
        finally:
            self.gate.handover()  # the other ranks wait for the evaluation's end

    def log_step(self, step: int, metrics: Dict[str, float], timings: Dict[str, float]) -> None:
        self.recorder.log_step(step, {"policy_version": self.run.state.policy_version, **metrics, **timings})

    def stop_reason(self, clock: WallClock, stop_signal: str = "") -> str:
        return str(self.broadcast(stop_signal or (WALL_TIME if clock.next_step_would_overrun() else "")))

    def checkpoint_state(self) -> Dict[str, object]:
        if self.last_batch is None:
            return self.rollouts.state_dict()
        return {"data_cursor": self.last_batch.data_cursor, "rollout_carry": self.last_batch.rollout_carry}

    def close(self) -> None:
        super().close()
        if self.producer is not None:
            self.producer.stop()
        self.recorder.close()
