"""Rollout manager: prompt groups over many engines, retries, dynamic sampling, versions.

* The G samples of a prompt are one request (`sampling_params.n = G`) on one engine.
* Each live engine has a worker pulling chunks of prompts from one queue, so faster
  engines take more. A chunk whose request fails (connection refused, reset, timeout after
  `request_timeout_s`, HTTP 5xx) marks the engine dead and goes back to the queue for the
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
* Every sample (kept or rejected, with the reason) becomes a ledger record.
* Policy versions come from the engine's `weight_versions` spans, never assumed;
  `drop_stale_groups` enforces `max_staleness`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import aiohttp
import torch

from dapo_mega.backends.sglang.client import EngineClient, EngineError, SampleResult
from dapo_mega.rollout.ledger import LedgerRecord


class RolloutError(RuntimeError):
    """Generation cannot complete (every engine dead, retries exhausted)."""


class DynamicSamplingExhausted(RuntimeError):
    """max_num_gen_batches rounds did not fill the batch."""


def parse_version(version: Any) -> int:
    """Engine weight versions are strings; ours are integers ("default" = 0)."""
    try:
        return int(str(version))
    except ValueError:
        return 0


@dataclass
class Group:
    """The G samples of one prompt, with where/when they were generated."""

    prompt: Any
    """The prompt item (an object with `.id` and `.prompt`, e.g. data.Problem)."""
    samples: List[SampleResult]
    engine_id: str
    queue_delay_s: float
    latency_s: float
    gen_round: int = 0
    rewards: List[Dict[str, Any]] = field(default_factory=list)
    reasons: List[str] = field(default_factory=list)

    @property
    def prompt_id(self) -> str:
        return str(getattr(self.prompt, "id", ""))

    def version_range(self) -> Tuple[int, int]:
        versions = [parse_version(s["version"]) for smp in self.samples for s in smp.weight_versions]
        return (min(versions), max(versions)) if versions else (0, 0)


def drop_stale_groups(groups: Sequence[Group], learner_version: int, max_staleness: int
                      ) -> Tuple[List[Group], List[Group]]:
    """(fresh, stale): a group is stale when its oldest token's version < learner_version - k."""
    fresh, stale = [], []
    for g in groups:
        (stale if g.version_range()[0] < learner_version - max_staleness else fresh).append(g)
    for g in stale:
        g.reasons = ["stale"] * len(g.samples)
    return fresh, stale


def _select(groups: Sequence[Group]):
    """Per-sample reasons through the algo package's group filter (Eq. 11)."""
    from dapo_mega.algo import select_informative_groups

    rewards = torch.tensor([r["reward"] for g in groups for r in g.rewards], dtype=torch.float32)
    correct = torch.tensor([bool(r.get("correct", r["reward"] > 0)) for g in groups for r in g.rewards])
    index = torch.tensor([i for i, g in enumerate(groups) for _ in g.rewards])
    return select_informative_groups(rewards, index, correct=correct)


class RolloutManager:
    """Generates groups on several engines; see the module docstring."""

    def __init__(self, engine_urls: Sequence[str], n_samples: int, sampling_params: Dict[str, Any],
                 api_key: str = "", request_timeout_s: float = 600.0, max_retries: int = 3,
                 prompts_per_request: int = 4, run_id: str = "run", return_logprob: bool = True,
                 requests_per_engine: int = 8,
                 prompt_to_input: Optional[Callable[[Any], Any]] = None, seed: Optional[int] = None):
        self.engine_urls = list(engine_urls)
        self.n_samples = n_samples
        self.sampling_params = {**sampling_params, "n": n_samples}
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
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
        self.carry: List[Group] = []
        self.metrics: Dict[str, float] = {}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, Any]:
        """Carried groups (plain data) for checkpoints."""
        return {"carry": [{"prompt": _plain(g.prompt), "engine_id": g.engine_id, "queue_delay_s": g.queue_delay_s,
                           "latency_s": g.latency_s, "gen_round": g.gen_round, "rewards": g.rewards,
                           "samples": [s.__dict__ for s in g.samples]} for g in self.carry]}

    def load_state_dict(self, state: Dict[str, Any], prompt_factory: Callable[[Dict[str, Any]], Any]) -> None:
        self.carry = [Group(prompt=prompt_factory(d["prompt"]), samples=[SampleResult(**s) for s in d["samples"]],
                            engine_id=d["engine_id"], queue_delay_s=d["queue_delay_s"], latency_s=d["latency_s"],
                            gen_round=d["gen_round"], rewards=d["rewards"]) for d in state["carry"]]

    def alive_engines(self) -> List[str]:
        return [u for u in self.engine_urls if u not in self.dead]

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
            async with EngineClient(url, api_key=self.api_key, timeout_s=self.request_timeout_s) as client:
                while not done_event.is_set() and url not in self.dead:
                    try:
                        c = await asyncio.wait_for(queue.get(), timeout=0.1)
                    except asyncio.TimeoutError:
                        continue
                    if url in self.dead:  # a sibling worker found this engine dead meanwhile: no attempt spent
                        queue.put_nowait(c)
                        return
                    idx = chunks[c]
                    t0 = time.monotonic()
                    try:
                        samples = await client.generate([self.prompt_to_input(prompts[i]) for i in idx],
                                                        self._params_for([prompts[i] for i in idx], gen_round),
                                                        return_logprob=self.return_logprob,
                                                        timeout_s=self.request_timeout_s)
                        if any(s.aborted for s in samples):
                            raise _Retry(f"{url}: request aborted by the engine")
                    except (_Retry, EngineError) as exc:
                        fatal = isinstance(exc, EngineError) and exc.status < 500
                        self._requeue(queue, c, attempts, failures, f"{exc}", fatal)
                        if isinstance(exc, EngineError) and exc.status >= 500:
                            self.dead[url] = str(exc)
                            return
                        continue
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                        self.dead[url] = f"{type(exc).__name__}: {exc}"
                        self._requeue(queue, c, attempts, failures, f"{url}: {self.dead[url]}", False)
                        return
                    latency = time.monotonic() - t0
                    for k, i in enumerate(idx):
                        results[i] = Group(prompt=prompts[i], samples=samples[k * self.n_samples:(k + 1) * self.n_samples],
                                           engine_id=url, queue_delay_s=t0 - start, latency_s=latency,
                                           gen_round=gen_round)
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done_event.set()

        workers = [asyncio.create_task(worker(u)) for u in self.alive_engines() for _ in range(self.requests_per_engine)]
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
                     reward_fn: Callable[[List[Group]], List[List[Dict[str, Any]]]], train_batch_size: int,
                     gen_batch_size: int, dynamic_sampling: bool = True, max_num_gen_batches: int = 0,
                     max_staleness: Optional[int] = None) -> Tuple[List[Group], List[LedgerRecord]]:
        """Groups to train on at `step` (exactly train_batch_size of them) and the ledger records.

        `reward_fn(groups)` returns, per group, per sample, a dict with `reward` (float),
        `correct` (bool) and optionally `components` (dict), `verifier`, `verifier_version`
        and `error` (a verifier exception message).
        """
        kept: List[Group] = []
        records: List[LedgerRecord] = []
        self._step = step
        carried, self.carry = self.carry, []
        if max_staleness is not None:
            carried, stale = drop_stale_groups(carried, learner_version, max_staleness)
            records += [r for g in stale for r in self.records_of(g, step, learner_version)]
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
                g.rewards = list(rewards)
            if dynamic_sampling:
                sel = _select(groups)
                all_correct += sel.num_all_correct
                all_wrong += sel.num_all_wrong
                offset = 0
                for g in groups:
                    g.reasons = list(sel.sample_reasons[offset:offset + len(g.samples)])
                    offset += len(g.samples)
            else:
                for g in groups:
                    g.reasons = ["kept"] * len(g.samples)
            for g in groups:
                for k, r in enumerate(g.rewards):
                    if r.get("error"):
                        g.reasons[k] = "verifier_error" if g.reasons[k] == "kept" else g.reasons[k]
                if all(reason != "kept" and reason != "verifier_error" for reason in g.reasons):
                    records += self.records_of(g, step, learner_version)
                else:
                    kept.append(g)
        self.carry = kept[train_batch_size:]
        kept = kept[:train_batch_size]
        for g in kept:
            records += self.records_of(g, step, learner_version)
        # Group-level rates (all-correct, all-wrong, kept fraction) are computed from the
        # ledger records by rollout/metrics.py, so that they exist with dynamic sampling off.
        self.metrics = {"rollout/gen_batches": rounds, "rollout/groups_generated": seen,
                        "rollout/carried_groups": len(self.carry), "rollout/dead_engines": len(self.dead)}
        return kept, records

    def records_of(self, g: Group, step: int, learner_version: int) -> List[LedgerRecord]:
        out = []
        for k, s in enumerate(g.samples):
            versions = [parse_version(sp["version"]) for sp in s.weight_versions] or [0]
            r = g.rewards[k] if k < len(g.rewards) else {"reward": 0.0, "correct": False}
            out.append(LedgerRecord(
                run_id=self.run_id, step=step, prompt_id=g.prompt_id,
                dataset_revision=str(getattr(g.prompt, "dataset_revision", "") or ""),
                sample_index=s.sample_index, seed=None, policy_version_min=min(versions),
                policy_version_max=max(versions), learner_version=learner_version,
                age=learner_version - min(versions), engine_id=g.engine_id, queue_delay_s=g.queue_delay_s,
                generation_latency_s=float(s.meta_info.get("e2e_latency", g.latency_s)),
                response_length=len(s.token_ids), truncated=s.truncated, reward=float(r["reward"]),
                correct=bool(r.get("correct", False)), reward_components=json.dumps(r.get("components", {})),
                verifier=str(r.get("verifier", "")), verifier_version=str(r.get("verifier_version", "")),
                reject_reason=g.reasons[k] if k < len(g.reasons) else "kept", response_text=s.text,
                prompt_text=str(g.prompt.prompt if isinstance(getattr(g.prompt, "prompt", None), str) else ""),
                gen_round=g.gen_round))
        return out


def request_seed(seed: int, step: int, gen_round: int, prompt_id: str) -> int:
    """A 56-bit sampling seed of one prompt's request (the engine adds the sample index)."""
    import hashlib

    digest = hashlib.sha256(f"{seed}:{step}:{gen_round}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


class _Retry(Exception):
    pass


def _plain(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict
        return asdict(obj)
    return obj
