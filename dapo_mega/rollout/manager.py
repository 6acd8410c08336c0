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
* A dead engine is not dead forever: `probe_dead` (the policy sync calls it before each
  weight sync) finds those that answer again, which then rejoin the weight sync and, once
  they hold the new weights (`serve_again`), the rollouts.
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

import asyncio
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import aiohttp

from dapo_mega.aio import run_coroutine
from dapo_mega.engines.sglang.client import EngineClient, EngineError, RequestSamplingParams, SamplingParams
from dapo_mega.engines.sglang.endpoint import EngineAddress, EngineEndpoint, as_endpoint
from dapo_mega.rollout.batch_fill import SET_ASIDE_COUNTS, SamplingRule
from dapo_mega.rollout.dispatch import RolloutError, RoundDispatcher, RoundOutcome, chunk_size
from dapo_mega.rollout.dynamic_sampling import DynamicSampler, DynamicSamplingExhausted, StepInputs
from dapo_mega.rollout.partial import PARTIAL_COUNTS, PartialGroup
from dapo_mega.rollout.samples import (
    Group,
    PromptFactory,
    PromptItem,
    PromptToInput,
    ScoredSample,
    drop_stale_groups,
    parse_version,
)

__all__ = ["DynamicSamplingExhausted", "Group", "RolloutError", "RolloutManager", "SamplingRule", "ScoredSample", "StepInputs",
           "chunk_size", "drop_stale_groups", "parse_version", "request_seed"]


class RolloutManager:
    """Generates groups on several engines; see the module docstring."""

    def __init__(self, engines: Sequence[EngineAddress], n_samples: int, sampling_params: SamplingParams,
                 max_retries: int = 3,
                 prompts_per_request: int = 4, run_id: str = "run", return_logprob: bool = True,
                 requests_per_engine: int = 8,
                 prompt_to_input: Optional[PromptToInput] = None, seed: Optional[int] = None,
                 liveness_timeout_s: float = 300.0, probe_interval_s: float = 10.0, dataset_revision: str = "",
                 partial_rollout: bool = False):
        self.endpoints = {e.url: e for e in map(as_endpoint, engines)}
        self.engine_urls = list(self.endpoints)
        self.n_samples = n_samples
        self.sampling_params = {**sampling_params, "n": n_samples}
        self.max_retries = max_retries
        self.prompts_per_request = max(1, prompts_per_request)
        # Requests in flight per engine: an engine batches concurrent requests together, so
        # one request at a time would leave it decoding prompts_per_request*G rows only.
        self.requests_per_engine = max(1, requests_per_engine)
        self.run_id = run_id
        self.return_logprob = return_logprob
        self.routed_experts_every = 0
        """Ask one request in this many for each token's experts (0: none; a mixture of experts
        whose engines report them: the fleet knows, `EngineFleet.returns_routed_experts`)."""
        self.prompt_to_input = prompt_to_input or (lambda p: p.prompt)
        self.seed = seed
        self.dataset_revision = dataset_revision
        """Revision of the data the prompts come from (each sample's ledger row carries it)."""
        self.liveness_timeout_s = float(liveness_timeout_s)
        """An engine with requests in flight that answers no probe (and finishes nothing) this long is hung."""
        self.probe_interval_s = float(probe_interval_s)
        """Seconds between /health probes of a busy engine; each probe waits at most this long."""
        self._step = 0
        self.dead: Dict[str, str] = {}
        """url -> why the engine was found dead (written by the generating thread; read
        copies with `dead_engines()`)."""
        self._dead_lock = threading.Lock()
        self.rejoining: List[str] = []
        """Engines that answered again after being found dead: they take part in the next
        weight sync and serve rollouts once it is done (`serve_again`)."""
        self.requests_by_engine: Dict[str, int] = {}
        """url -> requests completed there (every round since the manager was made)."""
        self.samples_by_engine: Dict[str, int] = {}
        """url -> samples completed there."""
        self.engine_loads: Dict[str, Dict[str, float]] = {}
        """url -> peaks of the engine's /v1/loads seen by the watchdog since the last step
        (KV tokens used and held at most, requests running): `engine_load_metrics`."""
        self.partial_rollout = partial_rollout
        """Keep the samples of requests aborted once a streamed batch is full, and resume them
        later (rollout.partial_rollout; rollout/partial.py)."""
        self.sampling = DynamicSampler(self.prompt_to_input, partial_rollout)
        """Dynamic sampling's state across steps: carry, pending prompts, keep rate."""
        self.metrics: Dict[str, float] = {}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, object]:
        """What a checkpoint keeps of the rollouts: dynamic sampling's state (`DynamicSampler`)."""
        return self.sampling.state_dict()

    def load_state_dict(self, state: Dict[str, Any], prompt_factory: PromptFactory) -> None:
        self.sampling.load_state_dict(state, prompt_factory)

    def dead_engines(self) -> Dict[str, str]:
        """A copy of `dead` (safe to read while another thread generates)."""
        with self._dead_lock:
            return dict(self.dead)

    def _mark_dead(self, url: str, reason: str) -> None:
        with self._dead_lock:
            self.dead.setdefault(url, reason)  # the first reason is the cause

    def mark_dead(self, dead: Dict[str, str]) -> None:
        """Engines another manager on the same engines found dead (an evaluation's)."""
        for url, reason in dead.items():
            if url in self.endpoints:
                self._mark_dead(url, reason)

    def alive_engines(self) -> List[EngineEndpoint]:
        """Engines that serve rollouts: neither dead nor waiting for weights after rejoining."""
        dead = self.dead_engines()
        return [self.endpoints[u] for u in self.engine_urls if u not in dead and u not in self.rejoining]

    def probe_dead(self) -> List[str]:
        """Dead engines that answer /health again (a SIGCONT, a restart at the same address):
        each is told to abort what it still runs (requests this manager gave up on) and moves
        to `rejoining`; returns their URLs. Dead engines that still do not answer stay dead."""
        dead = self.dead_engines()
        if not dead:
            return []

        async def revive(url: str) -> Optional[str]:
            async with EngineClient(self.endpoints[url]) as client:
                if not await client.health(timeout_s=self.probe_interval_s):
                    return None
                try:
                    await client.abort_request(abort_all=True)
                except Exception:  # noqa: BLE001 - it answered; a failed abort only lets old work finish
                    pass
                return url

        async def revive_all() -> List[Optional[str]]:
            return await asyncio.gather(*(revive(u) for u in dead))

        back = [u for u in run_coroutine(revive_all()) if u]
        with self._dead_lock:
            for url in back:
                self.dead.pop(url, None)
                if url not in self.rejoining:
                    self.rejoining.append(url)
        return back

    def serve_again(self, urls: Sequence[str]) -> None:
        """Rejoining engines now hold the current weights: they serve rollouts again."""
        with self._dead_lock:
            self.rejoining = [u for u in self.rejoining if u not in set(urls)]

    # ---------------------------------------------------------------- generation
    async def generate_groups(self, prompts: Sequence[PromptItem], gen_round: int = 0) -> List[Group]:
        """One group of n_samples per prompt, in prompt order, spread over live engines."""
        out = await self._generate(prompts, gen_round)
        if len(out.groups) != len(prompts):
            raise RolloutError(f"{len(prompts) - len(out.groups)} of {len(prompts)} prompts not generated; "
                               f"dead engines: {self.dead}; failures: {out.failures[-5:]}")
        return [out.groups[i] for i in range(len(prompts))]

    async def _generate(self, prompts: Sequence[PromptItem], gen_round: int,
                        on_groups: Optional[Callable[[List[Group]], bool]] = None,
                        want: Optional[Callable[[], int]] = None,
                        keep_rate: Optional[Callable[[], Optional[float]]] = None,
                        partials: Optional[Dict[int, PartialGroup]] = None) -> RoundOutcome:
        """Generate `prompts` in chunks over the live engines (rollout/dispatch.py); those in
        `partials` (prompt index -> carried PartialGroup) resume their open samples."""
        return await RoundDispatcher(self, prompts, gen_round, on_groups, want, keep_rate, partials).run()

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
            kept, samples = self.sampling.collect_step(self._generate, run_coroutine, step, learner_version, inputs,
                                                       rule)
        except RolloutError as exc:
            raise RolloutError(f"{exc}; dead engines: {self.dead_engines()}") from None
        counts, sampling = self.sampling.counts, self.sampling
        # Group-level rates (all-correct, all-wrong, kept fraction) are computed from the
        # samples by records/rollout_metrics.py, so that they exist with dynamic sampling off.
        self.metrics = {"rollout/gen_batches": counts["rounds"], "rollout/groups_generated": counts["seen"],
                        "rollout/carried_groups": len(sampling.carry), "rollout/dead_engines": len(self.dead),
                        "rollout/prompts_requested": counts["requested"],
                        "rollout/pending_prompts": len(sampling.pending),
                        # groups the filter read on the score: the reward gave no verdict
                        "rollout/score_filtered_groups": counts["score_filtered_groups"],
                        **{f"rollout/{k}": counts[k] for k in SET_ASIDE_COUNTS + PARTIAL_COUNTS}}
        if sampling.keep_rate is not None:
            self.metrics["rollout/keep_rate_estimate"] = sampling.keep_rate
        self.metrics.update(self.engine_load_metrics())
        return kept, samples

    def _params_for(self, prompts: Sequence[PromptItem], gen_round: int) -> RequestSamplingParams:
        """sampling_params of one request: shared, or (with `seed`) one dict per prompt whose
        `sampling_seed` depends only on (seed, step, round, prompt id) — so a step redone after a
        resume, or a request retried on another engine, samples the same tokens where the engine
        honours the seed (the embedded engine; SGLang with --enable-deterministic-inference)."""
        if self.seed is None:
            return self.sampling_params
        return [{**self.sampling_params, "sampling_seed": request_seed(self.seed, self._step, gen_round,
                                                                       str(getattr(p, "id", "")))} for p in prompts]

    async def _observe_loads(self, url: str, probe: EngineClient) -> None:
        """Keep the peaks of one /v1/loads answer (an engine without it is not held to it)."""
        try:
            loads = await asyncio.wait_for(probe.loads(), timeout=self.probe_interval_s)
        except (asyncio.TimeoutError, EngineError, aiohttp.ClientError, OSError, KeyError, TypeError):
            return
        peak = self.engine_loads.setdefault(url, {})
        for key in ("num_used_tokens", "max_total_num_tokens", "num_running_reqs"):
            value = sum(float(d.get(key, 0) or 0) for d in loads)
            peak[key] = max(peak.get(key, 0.0), value)

    def engine_load_metrics(self) -> Dict[str, float]:
        """The engines' KV cache and batch at their busiest since the last call (then reset):
        engine/kv_used_tokens_peak (largest on one engine), engine/kv_capacity_tokens (the
        smallest engine's), engine/kv_usage_peak (used / capacity, worst engine) and
        engine/running_requests_peak. Empty when no probe saw an engine busy."""
        seen, self.engine_loads = self.engine_loads, {}
        if not seen:
            return {}
        capacity = [p["max_total_num_tokens"] for p in seen.values() if p.get("max_total_num_tokens")]
        usage = [p["num_used_tokens"] / p["max_total_num_tokens"] for p in seen.values()
                 if p.get("max_total_num_tokens")]
        out = {"engine/kv_used_tokens_peak": max(p.get("num_used_tokens", 0.0) for p in seen.values()),
               "engine/running_requests_peak": max(p.get("num_running_reqs", 0.0) for p in seen.values())}
        if capacity:
            out.update({"engine/kv_capacity_tokens": min(capacity), "engine/kv_usage_peak": max(usage)})
        return out


def request_seed(seed: int, step: int, gen_round: int, prompt_id: str) -> int:
    """A 56-bit sampling seed of one prompt's request (the engine adds the sample index)."""
    import hashlib

    digest = hashlib.sha256(f"{seed}:{step}:{gen_round}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:7], "big")
