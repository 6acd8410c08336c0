"""Rollout manager: prompt groups over many engines, retries, dynamic sampling, versions.

* The G samples of a prompt are one request (`sampling_params.n = G`) on one engine.
* Each live engine has `requests_per_engine` workers pulling chunks of prompts from one
  queue, and a worker takes a chunk only while its engine has no more requests in flight than
  the least loaded live engine: the work spreads over every engine even when there are few
  chunks (an AIME eval), and faster engines still take more. Chunks are at most
  `prompts_per_request` prompts, fewer when that leaves an engine without one.
* Liveness is progress, not a request's duration (a 20k-token answer decodes for minutes):
  while an engine has requests in flight it is probed (`GET /health` every
  `probe_interval_s`, each probe bounded by that interval; SGLang answers 200 once its
  scheduler has produced output since the probe began), and an engine that answers no
  probe and finishes no request for `liveness_timeout_s` is hung: its requests are
  abandoned, it is marked dead, and its chunks go back to the queue for the others. A
  request that fails (connection refused, HTTP 5xx, the endpoint's optional hard
  `timeout_s`) marks its engine dead the same way, and so does a connection closed or reset
  mid-request unless the engine answers /health on a new one (then the connection failed,
  not the engine: the chunk is retried, one of `max_retries`); an aborted reply (the engine
  was paused with mode abort) is retried without marking the engine. A chunk's samples are taken only
  from a complete reply, so a lost engine loses no prompt and duplicates none.
* Which engines serve, are dead or rejoin is the engine book's (engines/book.py), shared
  by every manager of the driver (training, the held-out evaluation beside it): a dead engine
  answering again rejoins the weight sync (`EngineBook.probe_dead`, before each sync) and
  serves once it holds the new weights.
* Dynamic sampling (DAPO §3.2), its rounds, keep-rate estimate, carry-over and streamed
  steps are rollout/dynamic_sampling.py's (`DynamicSampler`, the manager's `sampling`);
  `collect_step` runs it on these engines. With `partial_rollout`, the samples of requests
  aborted once a streamed batch is full are kept and resumed later (rollout/partial.py).
* With `seed` (the trainer passes `trainer.seed`), each prompt's request carries a
  `sampling_seed` made from (seed, step, round, prompt id): on the embedded engine a step
  redone after a resume, or a chunk retried on another engine, samples the same tokens;
  SGLang 0.5.23 honours the seed only when started with `--enable-deterministic-inference`
  (`rollout.extra_server_args`, a GPU attention backend), and otherwise samples afresh.
* Every sample is a typed `ScoredSample` (rollout/samples.py) from the engine's reply on:
  scored by `reward_fn`, given its reject reason, stamped with the consuming step and
  learner version; every one decided (kept or rejected) becomes a ledger row.
* Policy versions come from the engine's `weight_versions` spans, never assumed;
  `drop_stale_groups` enforces `max_staleness`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from dapo_mega.aio import run_coroutine
from dapo_mega.engines.book import EngineBook
from dapo_mega.engines.sglang.endpoint import EngineAddress, EngineEndpoint
from dapo_mega.environments.base import environment_tools
from dapo_mega.rollout.batch_fill import SET_ASIDE_COUNTS, SamplingRule
from dapo_mega.rollout.dynamic_sampling import DynamicSampler, DynamicSamplingExhausted, StepInputs
from dapo_mega.rollout.partial import PARTIAL_COUNTS, PartialGroup
from dapo_mega.rollout.round import RolloutError, Round, chunk_size
from dapo_mega.rollout.samples import (
    Group,
    PromptDecoding,
    PromptEncoding,
    PromptItem,
    ScoredSample,
    TextPrompts,
    drop_stale_groups,
    parse_version,
)
from dapo_mega.rollout.settings import RoundSettings, request_seed

if TYPE_CHECKING:
    from dapo_mega.config import DapoConfig

__all__ = ["DynamicSamplingExhausted", "Group", "RolloutError", "RolloutManager", "RoundSettings", "SamplingRule",
           "ScoredSample", "StepInputs", "chunk_size", "drop_stale_groups", "parse_version", "request_seed"]


class RolloutManager:
    """Generates groups on the engines of a book; see the module docstring.

    `engines`: the run's `EngineBook` (shared with the policy sync and other managers), or
    engine addresses (a book of its own). `settings` fix every request (`RoundSettings`;
    `from_config` builds them for training, evaluation or the audit); `encoding` turns a
    prompt item into the engine's input (default: its text)."""

    def __init__(self, engines: Union[EngineBook, Sequence[EngineAddress]], settings: RoundSettings,
                 encoding: Optional[PromptEncoding] = None):
        self.book = engines if isinstance(engines, EngineBook) else EngineBook(engines)
        self.settings = settings
        self.encoding = encoding or TextPrompts()
        if settings.environment is not None and not callable(getattr(self.encoding, "encode_text", None)):
            raise TypeError(f"multi-turn samples (an environment) need an encoding with encode_text(text) to tokenize "
                            f"the environment's answers (data.PromptEncoder); got {type(self.encoding).__name__}")
        schemas = environment_tools(settings.environment)
        if schemas:  # the prompts show the environment's tools (the chat template's tools=)
            show = getattr(self.encoding, "show_tools", None)
            if not callable(show):
                raise TypeError(f"the environment's tools are shown through the chat template: the encoding needs "
                                f"show_tools (data.PromptEncoder); got {type(self.encoding).__name__}")
            show(schemas)
        if settings.environment is not None:  # its answers may be bounded in the sample's tokens
            settings.environment.use_tokens(self.encoding.encode_text)
        self._step = 0
        self.requests_by_engine: Dict[str, int] = {}
        """url -> requests completed there by `generate_groups` (an evaluation's engine line)."""
        self.samples_by_engine: Dict[str, int] = {}
        """url -> samples completed there by this manager's rounds."""
        self.sampling = DynamicSampler(self.encoding, settings.partial_rollout)
        """Dynamic sampling's state across steps: carry, pending prompts, keep rate."""
        self.metrics: Dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg: "DapoConfig", book: EngineBook, purpose: str, encoding: Optional[PromptEncoding] = None,
                    **settings: Any) -> "RolloutManager":
        """The manager of training, evaluation or the audit on `book`'s engines
        (`RoundSettings.for_purpose`; `settings`: its keyword arguments)."""
        return cls(book, RoundSettings.for_purpose(cfg, purpose, **settings), encoding)

    @property
    def engine_urls(self) -> List[str]:
        return self.book.urls

    @property
    def endpoints(self) -> Dict[str, EngineEndpoint]:
        return self.book.endpoints

    # ---------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, object]:
        """What a checkpoint keeps of the rollouts: dynamic sampling's state (`DynamicSampler`)."""
        return self.sampling.state_dict()

    def load_state_dict(self, state: Dict[str, Any], prompts: PromptDecoding) -> None:
        self.sampling.load_state_dict(state, prompts)

    # ---------------------------------------------------------------- generation
    def round(self, prompts: Sequence[PromptItem], gen_round: int = 0,
              partials: Optional[Dict[int, PartialGroup]] = None) -> Round:
        """A generation round of `prompts` on the book's serving engines (rollout/round.py:
        `async with` it, then read its finished groups in prompt order); those in `partials`
        (prompt index -> carried PartialGroup) resume their open samples."""
        return Round(self.book, self.settings, self.encoding, prompts, self._step, gen_round, partials)

    async def generate_groups(self, prompts: Sequence[PromptItem], gen_round: int = 0) -> List[Group]:
        """One group of n_samples per prompt, in prompt order, spread over the serving engines."""
        async with self.round(prompts, gen_round) as rnd:
            async for _ in rnd:
                pass
        out = rnd.outcome
        for url, k in out.requests_by_engine.items():
            self.requests_by_engine[url] = self.requests_by_engine.get(url, 0) + k
        for url, k in out.samples_by_engine.items():
            self.samples_by_engine[url] = self.samples_by_engine.get(url, 0) + k
        if out.missing(len(prompts)):
            raise RolloutError(f"{out.missing(len(prompts))}; dead engines: {self.book.dead()}")
        return [out.groups[i] for i in range(len(prompts))]

    # ---------------------------------------------------------------- dynamic sampling
    def collect_step(self, step: int, learner_version: int, inputs: StepInputs, rule: SamplingRule
                     ) -> Tuple[List[Group], List[ScoredSample]]:
        """Groups to train on at `step` (exactly train_batch_size of them) and every sample
        the step generated or dropped (kept or not, each with its reject reason), stamped with
        `step` and `learner_version`: the step's ledger rows.

        `inputs` draws the prompts and scores the groups (`StepInputs`); `rule` (`SamplingRule`)
        holds dynamic sampling's settings. Streamed (default: `max_staleness == 0`, where a
        surplus could only be dropped as stale), it sizes each round
        from the keep rate, decides groups in prompt order as their requests finish, aborts the
        requests in flight once the batch is full and returns the round's undecided prompts to
        `pending` (rollout/dynamic_sampling.py).
        """
        self._step = step
        try:
            kept, samples = run_coroutine(self.sampling.collect_step(self, step, learner_version, inputs, rule))
        except RolloutError as exc:
            raise RolloutError(f"{exc}; dead engines: {self.book.dead()}") from None
        counts, sampling = self.sampling.counts, self.sampling
        # Group-level rates (all-correct, all-wrong, kept fraction) are computed from the
        # samples by rollout/metrics.py, so that they exist with dynamic sampling off.
        self.metrics = {"rollout/gen_batches": counts["rounds"], "rollout/groups_generated": counts["seen"],
                        "rollout/carried_groups": len(sampling.carry), "rollout/dead_engines": len(self.book.dead()),
                        "rollout/prompts_requested": counts["requested"],
                        "rollout/pending_prompts": len(sampling.pending),
                        # groups the filter read on the score: the reward gave no verdict
                        "rollout/score_filtered_groups": counts["score_filtered_groups"],
                        **{f"rollout/{k}": counts[k] for k in SET_ASIDE_COUNTS + PARTIAL_COUNTS}}
        if sampling.keep_rate is not None:
            self.metrics["rollout/keep_rate_estimate"] = sampling.keep_rate
        self.metrics.update(self.book.take_load_metrics())
        return kept, samples
