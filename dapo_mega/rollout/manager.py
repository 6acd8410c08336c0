"""Rollout manager: prompt groups over many engines, retries, dynamic sampling, versions.

* The G samples of a prompt are one request (`sampling_params.n = G`) on one engine.
* Each live engine has a worker pulling chunks of prompts from one queue, so faster
  engines take more. A chunk whose request fails (connection refused, reset, timeout after
  the endpoint's `timeout_s`, HTTP 5xx) marks the engine dead and goes back to the queue for the
  others; an aborted reply (the engine was paused with mode abort) is retried without
  marking the engine. A chunk's samples are taken only from a complete reply, so a killed
  engine loses no prompt and duplicates none.
* Dynamic sampling (DAPO §3.2): rounds of `gen_batch_size` prompts from `prompt_source`,
  scored by `reward_fn`, filtered by `dapo_mega.algo.select_informative_groups` (Eq. 11),
  until `train_batch_size` groups are kept; the surplus is carried to the next step
  (`state_dict`). `max_num_gen_batches` bounds the rounds (0 = no limit).
* With `seed` (the trainer passes `trainer.seed`), each prompt's request carries a
  `sampling_seed` made from (seed, step, round, prompt id): a step redone after a resume,
  or a chunk retried on another engine, samples the same tokens.
* Every sample is a typed `ScoredSample` (rollout/samples.py) from the engine's reply on:
  scored by `reward_fn`, given its reject reason, stamped with the consuming step and
  learner version; every one (kept or rejected) becomes a ledger row.
* Policy versions come from the engine's `weight_versions` spans, never assumed;
  `drop_stale_groups` enforces `max_staleness`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import aiohttp
import torch

from dapo_mega.backends.sglang.client import EngineClient, EngineError, SampleResult
from dapo_mega.backends.sglang.endpoint import EngineAddress, EngineEndpoint, as_endpoint
from dapo_mega.reward.types import SampleReward
from dapo_mega.rollout.samples import Group, ScoredSample, drop_stale_groups, parse_version

__all__ = ["DynamicSamplingExhausted", "Group", "RolloutError", "RolloutManager", "ScoredSample",
           "drop_stale_groups", "parse_version", "request_seed"]


class RolloutError(RuntimeError):
    """Generation cannot complete (every engine dead, retries exhausted)."""


class DynamicSamplingExhausted(RuntimeError):
    """max_num_gen_batches rounds did not fill the batch."""


def _select(groups: Sequence[Group]):
    """Per-sample reasons through the algo package's group filter (Eq. 11)."""
    from dapo_mega.algo import select_informative_groups

    rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float32)
    correct = torch.tensor([s.correct for g in groups for s in g.samples])
    index = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    return select_informative_groups(rewards, index, correct=correct)


class RolloutManager:
    """Generates groups on several engines; see the module docstring."""

    def __init__(self, engines: Sequence[EngineAddress], n_samples: int, sampling_params: Dict[str, Any],
                 max_retries: int = 3,
                 prompts_per_request: int = 4, run_id: str = "run", return_logprob: bool = True,
                 requests_per_engine: int = 8,
                 prompt_to_input: Optional[Callable[[Any], Any]] = None, seed: Optional[int] = None):
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
        self.prompt_to_input = prompt_to_input or (lambda p: p.prompt)
        self.seed = seed
        self._step = 0
        self.dead: Dict[str, str] = {}
        """url -> why the engine was found dead (written by the generating thread; read
        copies with `dead_engines()`)."""
        self._dead_lock = threading.Lock()
        self.carry: List[Group] = []
        self.metrics: Dict[str, float] = {}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, Any]:
        """Carried groups (plain data) for checkpoints."""
        return {"carry": [g.to_dict() for g in self.carry]}

    def load_state_dict(self, state: Dict[str, Any], prompt_factory: Callable[[Dict[str, Any]], Any]) -> None:
        self.carry = [Group.from_dict(d, prompt_factory, self.prompt_to_input) for d in state["carry"]]

    def dead_engines(self) -> Dict[str, str]:
        """A copy of `dead` (safe to read while another thread generates)."""
        with self._dead_lock:
            return dict(self.dead)

    def _mark_dead(self, url: str, reason: str) -> None:
        with self._dead_lock:
            self.dead[url] = reason

    def alive_engines(self) -> List[EngineEndpoint]:
        dead = self.dead_engines()
        return [self.endpoints[u] for u in self.engine_urls if u not in dead]

    # ---------------------------------------------------------------- generation
    async def generate_groups(self, prompts: Sequence[Any], gen_round: int = 0) -> List[Group]:
        """One group of n_samples per prompt, in prompt order, spread over live engines."""
        queue: asyncio.Queue = asyncio.Queue()
        chunks = [list(range(i, min(i + self.prompts_per_request, len(prompts))))
                  for i in range(0, len(prompts), self.prompts_per_request)]
        attempts = [0] * len(chunks)
        for c in range(len(chunks)):
            queue.put_nowait(c)
        results: Dict[int, Group] = {}
        failures: List[str] = []
        start = time.monotonic()
        remaining = [len(chunks)]
        done_event = asyncio.Event()
        if not chunks:
            return []

        async def worker(url: str):
            async with EngineClient(self.endpoints[url]) as client:
                while not done_event.is_set() and url not in self.dead:
                    try:
                        c = await asyncio.wait_for(queue.get(), timeout=0.1)
                    except asyncio.TimeoutError:
                        continue
                    if url in self.dead:  # a sibling worker found this engine dead meanwhile: no attempt spent
                        queue.put_nowait(c)
                        return
                    idx = chunks[c]
                    inputs = [self.prompt_to_input(prompts[i]) for i in idx]
                    params = self._params_for([prompts[i] for i in idx], gen_round)
                    t0 = time.monotonic()
                    try:
                        samples = await client.generate(inputs, params, return_logprob=self.return_logprob)
                        if any(s.aborted for s in samples):
                            raise _Retry(f"{url}: request aborted by the engine")
                    except (_Retry, EngineError) as exc:
                        fatal = isinstance(exc, EngineError) and exc.status < 500
                        self._requeue(queue, c, attempts, failures, f"{exc}", fatal)
                        if isinstance(exc, EngineError) and exc.status >= 500:
                            self._mark_dead(url, str(exc))
                            return
                        continue
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                        self._mark_dead(url, f"{type(exc).__name__}: {exc}")
                        self._requeue(queue, c, attempts, failures, f"{url}: {self.dead[url]}", False)
                        return
                    latency = time.monotonic() - t0
                    for k, i in enumerate(idx):
                        seed = params[k]["sampling_seed"] if isinstance(params, list) else params.get("sampling_seed")
                        replies = samples[k * self.n_samples:(k + 1) * self.n_samples]
                        results[i] = Group(prompt=prompts[i], prompt_input=inputs[k], engine_id=url,
                                           queue_delay_s=t0 - start, latency_s=latency, gen_round=gen_round,
                                           samples=[_scored_sample(r, prompts[i], seed, url, t0 - start, latency,
                                                                   gen_round) for r in replies])
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done_event.set()

        workers = [asyncio.create_task(worker(e.url)) for e in self.alive_engines()
                   for _ in range(self.requests_per_engine)]
        if not workers:
            raise RolloutError(f"no live engine (dead: {self.dead})")
        while not done_event.is_set():
            if failures and failures[-1].startswith("FATAL"):
                break
            if all(w.done() for w in workers):
                break
            await asyncio.sleep(0.05)
        done_event.set()
        await asyncio.gather(*workers, return_exceptions=True)
        if len(results) != len(prompts):
            raise RolloutError(f"{len(prompts) - len(results)} of {len(prompts)} prompts not generated; "
                               f"dead engines: {self.dead}; failures: {failures[-5:]}")
        return [results[i] for i in range(len(prompts))]

    def _params_for(self, prompts: Sequence[Any], gen_round: int) -> Any:
        """sampling_params of one request: shared, or (with `seed`) one dict per prompt whose
        `sampling_seed` depends only on (seed, step, round, prompt id) — so a step redone after a
        resume, or a request retried on another engine, samples the same tokens."""
        if self.seed is None:
            return self.sampling_params
        return [{**self.sampling_params, "sampling_seed": request_seed(self.seed, self._step, gen_round,
                                                                       str(getattr(p, "id", "")))} for p in prompts]

    def _requeue(self, queue, c, attempts, failures, message, fatal) -> None:
        attempts[c] += 1
        if fatal or attempts[c] > self.max_retries:
            failures.append(f"FATAL chunk {c} after {attempts[c]} attempts: {message}")
        else:
            failures.append(message)
            queue.put_nowait(c)

    # ---------------------------------------------------------------- dynamic sampling
    def collect_step(self, step: int, learner_version: int, prompt_source: Callable[[int], List[Any]],
                     reward_fn: Callable[[List[Group]], List[List[SampleReward]]], train_batch_size: int,
                     gen_batch_size: int, dynamic_sampling: bool = True, max_num_gen_batches: int = 0,
                     max_staleness: Optional[int] = None) -> Tuple[List[Group], List[ScoredSample]]:
        """Groups to train on at `step` (exactly train_batch_size of them) and every sample
        the step generated or dropped (kept or not, each with its reject reason), stamped with
        `step` and `learner_version`: the step's ledger rows.

        `reward_fn(groups)` returns, per group, per sample, its `SampleReward`.
        """
        kept: List[Group] = []
        samples: List[ScoredSample] = []
        self._step = step
        carried, self.carry = self.carry, []
        if max_staleness is not None:
            carried, stale = drop_stale_groups(carried, learner_version, max_staleness)
            samples += [s for g in stale for s in g.stamp(step, learner_version)]
        kept += carried
        rounds = seen = all_correct = all_wrong = 0
        while len(kept) < train_batch_size:
            if max_num_gen_batches and rounds >= max_num_gen_batches:
                raise DynamicSamplingExhausted(
                    f"step {step}: dynamic sampling kept {len(kept)} of algo.train_batch_size={train_batch_size} "
                    f"groups after {rounds} rounds (algo.max_num_gen_batches={max_num_gen_batches}): {seen} groups "
                    f"generated, {all_correct} all-correct and {all_wrong} all-wrong (uniform rewards carry no "
                    "gradient). Fix: use easier data (all wrong) or harder data (all correct), raise "
                    "algo.n_samples_per_prompt, raise algo.max_num_gen_batches or set it to 0 (no limit), or set "
                    "algo.dynamic_sampling=false.")
            prompts = prompt_source(gen_batch_size)
            groups = asyncio.run(self.generate_groups(prompts, gen_round=rounds))
            rounds += 1
            seen += len(groups)
            for g, rewards in zip(groups, reward_fn(groups)):
                for s, reward in zip(g.samples, rewards):
                    s.score = reward
            if dynamic_sampling:
                sel = _select(groups)
                all_correct += sel.num_all_correct
                all_wrong += sel.num_all_wrong
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
                if all(s.reject_reason not in ("kept", "verifier_error") for s in g.samples):
                    samples += g.stamp(step, learner_version)
                else:
                    kept.append(g)
        self.carry = kept[train_batch_size:]
        kept = kept[:train_batch_size]
        for g in kept:
            samples += g.stamp(step, learner_version)
        # Group-level rates (all-correct, all-wrong, kept fraction) are computed from the
        # samples by rollout/metrics.py, so that they exist with dynamic sampling off.
        self.metrics = {"rollout/gen_batches": rounds, "rollout/groups_generated": seen,
                        "rollout/carried_groups": len(self.carry), "rollout/dead_engines": len(self.dead)}
        return kept, samples


def _scored_sample(reply: SampleResult, prompt: Any, seed: Optional[int], engine_id: str, queue_delay_s: float,
                   latency_s: float, gen_round: int) -> ScoredSample:
    """A ScoredSample (not scored yet) from one sample of an engine's reply."""
    text = getattr(prompt, "prompt", None)
    return ScoredSample(
        prompt_id=str(getattr(prompt, "id", "")), sample_index=reply.sample_index, token_ids=list(reply.token_ids),
        logprobs=reply.logprobs, weight_versions=list(reply.weight_versions), response_text=reply.text,
        truncated=reply.truncated, seed=seed, engine_id=engine_id, queue_delay_s=queue_delay_s,
        generation_latency_s=float(reply.meta_info.get("e2e_latency", latency_s)), gen_round=gen_round,
        dataset_revision=str(getattr(prompt, "dataset_revision", "") or ""),
        prompt_text=text if isinstance(text, str) else "")


def request_seed(seed: int, step: int, gen_round: int, prompt_id: str) -> int:
    """A 56-bit sampling seed of one prompt's request (the engine adds the sample index)."""
    import hashlib

    digest = hashlib.sha256(f"{seed}:{step}:{gen_round}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


class _Retry(Exception):
    pass
