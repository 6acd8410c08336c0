"""Step 1 says whether the weights arrived: the checks that the engines serve the learner's weights.

Three checks, thresholds in `checks` (config.ChecksConfig), each stopping the run with a
`WeightCheckError` that names the check, the engine and the likely cause:

- the weight probe, after every weight sync (`WeightProbe.after_sync`, from
  `Session.sync_weights`): every learner rank scores a fixed token sequence
  (`probe_token_ids`) with the learner's weights (temperature 1); the driver asks every engine
  in the sync for its log-probs of the same tokens (/generate with `input_ids`,
  `logprob_start_len=0` and one greedy new token: SGLang 0.5.23's `input_token_logprobs`,
  raw log-softmax) and for the weight version it holds. An engine that reports another
  version, or whose mean |Δ log p| over the probe exceeds `checks.probe_max_abs_mean`, stops
  the run before the next rollout. Metrics `probe/...` (the worst engine).
- the step mismatch, after every learner step (`check_step_mismatch`): the learner's
  `mismatch/age_0/logp_abs_mean` (algo/mismatch.py: the engine's log-probs of the tokens it
  sampled against the learner's π_old of the same tokens, age-0 samples only) above
  `checks.step_max_abs_mean`.
- the weight checksum, after every weight sync and before the probe (`checks.checksum`,
  embedded engines and SGLang engines of TP 1: `PolicySync.held_as`): each engine's checksum of every tensor it holds (SGLang's
  /weights_checker, action checksum) against the learner's of what it sent
  (`wire.checksum`). Exact, so it sees what the probe cannot: a defect whose effect is
  below the two implementations' numerical noise (one bucket skipped, an engine that kept the
  previous weights, in a step that moved the weights by less than a hundredth of a nat: at
  32B and lr 1e-6, every step). Metrics `checksum/...`.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch

from dapo_mega import log
from dapo_mega.algo import compute_mismatch_stats, summarize_mismatch
from dapo_mega.algo.train_sample import TrainSample
from dapo_mega.config import DapoConfig, EngineKind
from dapo_mega.driver.roles import LearnerRankRole

if TYPE_CHECKING:
    from dapo_mega.backends.megatron.learner import MegatronLearner

logger = log.get(__name__)

PROBE_SEED = 1_234_567
"""Seed of the probe's random ids: the same sequence on every rank, every sync and every run."""
PROBE_TEXT = "Question: What is 17 + 25? Think step by step. 17 + 25 = 42. Answer: 42"
"""The probe's first tokens: text a trained model predicts with confidence, whose tokens'
embedding rows training moves (random ids alone barely see a stale embedding of a tiny model)."""
FP32_MAX_ABS_MEAN = 0.01
"""Default limit (nats) of both checks when learner and engines compute in float32."""
BF16_MAX_ABS_MEAN = 0.5
"""Default limit (nats) of both checks otherwise (bf16 noise: a few hundredths)."""
FAR_OFF_NATS = 2.0
"""A mean |Δ log p| this large is garbage, not a stale or partial update (message hint)."""


class WeightCheckError(RuntimeError):
    """A weight check failed: the engines do not serve what the learner sent (message: the
    check, the engine, the numbers, the likely cause and the fix)."""


def probe_token_ids(vocab_size: int, length: int, text_ids: Sequence[int] = (), seed: int = PROBE_SEED) -> List[int]:
    """`length` token ids: `text_ids` (those below vocab_size - 1), then pseudo-random ids in
    [0, vocab_size - 1) fixed by `seed` (SGLang shows ids from vocab_size - 1 on as 0 in its
    log-prob replies, so they are left out)."""
    if vocab_size < 2 or length < 2:
        raise ValueError(f"a probe needs vocab_size >= 2 and length >= 2, got {vocab_size}, {length}")
    text = [int(t) for t in text_ids if 0 <= int(t) < vocab_size - 1][:length]
    generator = torch.Generator().manual_seed(seed)
    return text + torch.randint(0, vocab_size - 1, (length - len(text),), generator=generator).tolist()


def probe_text_ids(model_dir: str) -> List[int]:
    """PROBE_TEXT in the model's tokenizer (every rank reads the same files)."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model_dir)(PROBE_TEXT, add_special_tokens=False)["input_ids"])


def resolve_limit(value: Optional[float], cfg: DapoConfig, learner_dtype: str) -> float:
    """A check's limit: `value`, or derived from the dtypes (FP32_MAX_ABS_MEAN when the learner's
    parameters and the engines are float32: the embedded engine's `auto` is, SGLang's follows
    the checkpoint; BF16_MAX_ABS_MEAN otherwise)."""
    if value is not None:
        return float(value)
    r = cfg.rollout
    engines_fp32 = r.dtype == "float32" or (r.dtype == "auto" and r.backend == EngineKind.EMBEDDED)
    return FP32_MAX_ABS_MEAN if learner_dtype == "float32" and engines_fp32 else BF16_MAX_ABS_MEAN


def probe_length(cfg: DapoConfig) -> int:
    """`checks.probe_tokens`, bounded by what one learner micro-batch and one rollout hold."""
    return max(2, min(cfg.checks.probe_tokens, cfg.megatron.micro_batch_tokens,
                      cfg.algo.max_prompt_length + cfg.algo.max_response_length))


def judge_probe(index: int, url: str, version: int, reported: str, stats: torch.Tensor, limit: float,
                previous: Optional[torch.Tensor] = None) -> Optional[str]:
    """The failure message of one engine's probe, or None when it passes.

    stats: [1, 4] mismatch statistics of the engine's probe log-probs against the learner's
        at `version` (algo/mismatch.py); previous: the same against the learner's previous
        weights (None at the first sync), which tells a stale engine from a broken one.
    """
    who = f"weight probe after the sync of policy version {version} (before step {version + 1}): engine {index} ({url})"
    if reported != str(version):
        return (f"{who} reports weight version {reported!r}, not {str(version)!r}: the update did not reach it "
                "(the engine was left out of the sync, or the sync's last bucket, which carries the version, "
                "never arrived). Fix: check that every engine in the sync receives every bucket (weights/sync.py)")
    m = summarize_mismatch(stats)
    mean, worst = m["mismatch/logp_abs_mean"], m["mismatch/logp_abs_max"]
    if mean <= limit:  # NaN is no pass
        return None
    if previous is not None and summarize_mismatch(previous)["mismatch/logp_abs_mean"] <= limit:
        cause = (f"it still scores like the learner's previous weights (version {version - 1}): the weights "
                 "did not arrive although the version did")
    elif not math.isfinite(mean) or mean > FAR_OFF_NATS:
        cause = ("its values are far off: it holds other weights altogether (the engine left out of the sync) "
                 "or garbage (a tensor sent in the wrong dtype, or converted wrongly: HF names, fused QKV / "
                 "gate-up, a TP gather)")
    else:
        cause = ("likely part of the weights did not arrive (a bucket skipped, an engine TP rank not updated) "
                 "or arrived wrong (a tensor sent in the wrong dtype), or the engine computes in another dtype "
                 "than the learner")
    return (f"{who}: mean |log p_learner - log p_engine| = {mean:.4g} nats over the {int(m['mismatch/tokens'])}-token "
            f"probe (max {worst:.4g}) > {limit:g} (checks.probe_max_abs_mean); {cause}. Fix: the sync "
            "(weights/sync.py, weights/mapping.py); checks.stop=false only logs")


def step_mismatch_failure(metrics: Dict[str, float], limit: float, step: int) -> Optional[str]:
    """The failure message when a step's age-0 mismatch (algo/mismatch.py metrics of the
    learner step) exceeds `limit`; None when within it or unmeasured."""
    mean = metrics.get("mismatch/age_0/logp_abs_mean")
    if mean is None or mean <= limit:
        return None
    return (
        f"step mismatch at step {step}: the engines' log-probs of the tokens they sampled (age 0) differ from the "
        f"learner's by mean |log p_learner - log p_engine| = {mean:.4g} nats (max "
        f"{metrics.get('mismatch/age_0/logp_abs_max', float('nan')):.4g}, k3 KL "
        f"{metrics.get('mismatch/age_0/k3_kl', float('nan')):.4g}, {int(metrics.get('mismatch/age_0/tokens', 0))} "
        f"tokens) > {limit:g} (checks.step_max_abs_mean). Likely: the engines do not serve the learner's weights "
        "(the weight probe after each sync names the engine), or the learner scores other tokens or another "
        "distribution than the engines sampled (prompt ids, packing, algo.temperature). checks.stop=false only logs")


def judge_checksums(index: int, url: str, version: int, sent: Dict[str, str],
                    reported: Dict[str, str]) -> Optional[str]:
    """The failure message when engine `index` holds other bytes than the learner sent in the
    sync of `version` (per-tensor checksums, `wire.checksum`), or None."""
    from dapo_mega.wire.checksum import differing_tensors

    differ = differing_tensors(sent, reported)
    if not differ:
        return None
    missing = [n for n in differ if n not in reported]
    shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    if missing and len(missing) == len(differ):
        cause = "it has no tensor of that name: the sync and the engine's model disagree on names (weights/mapping.py)"
    elif len(differ) == len(sent):
        cause = "none of them holds what was sent: it kept the previous weights (the engine was left out of the sync)"
    else:
        cause = ("part of the weights did not arrive or arrived wrong (a bucket skipped, a tensor sent in another "
                 "dtype or layout)")
    return (f"weight checksum after the sync of policy version {version} (before step {version + 1}): engine {index} "
            f"({url}) holds {len(differ)} of the {len(sent)} tensors sent with other bytes than the learner sent: "
            f"{shown}; {cause}. Fix: the sync (weights/sync.py); checks.stop=false only logs")


async def _checksums_of_engines(urls: Sequence[str], cfg: DapoConfig
                                ) -> List[Tuple[Dict[str, str], Optional[BaseException]]]:
    """(per-tensor checksums, error) of every engine's /weights_checker, concurrently."""
    from dapo_mega.engines.fleet import endpoint_of
    from dapo_mega.engines.sglang.client import EngineClient
    from dapo_mega.wire.checksum import reported_checksums

    async def one(url: str):
        async with EngineClient(endpoint_of(url, cfg.rollout)) as client:
            try:
                return reported_checksums(await client.check_weights()), None
            except Exception as exc:  # an engine lost now is the rollout manager's to drop
                return {}, exc

    return list(await asyncio.gather(*(one(u) for u in urls)))


async def _score_on_engines(urls: Sequence[str], ids: Sequence[int], cfg: DapoConfig
                            ) -> List[Tuple[Optional[List[float]], str, Optional[BaseException]]]:
    """(log-probs, weight version, error) of every engine's /generate on `ids`, concurrently."""
    from dapo_mega.engines.fleet import endpoint_of
    from dapo_mega.engines.sglang.client import EngineClient

    async def one(url: str):
        async with EngineClient(endpoint_of(url, cfg.rollout)) as client:
            try:
                values, version = await client.score_prompt(ids)
                return values, version, None
            except Exception as exc:  # an engine lost now is the rollout manager's to drop
                return None, "", exc

    return list(await asyncio.gather(*(one(u) for u in urls)))


class WeightProbe:
    """The weight probe of one learner rank (module docstring). Collective: every rank calls
    `after_sync`; the driver asks the engines and hands its verdict to every rank."""

    def __init__(self, cfg: DapoConfig, role: LearnerRankRole, learner: "MegatronLearner", model_dir: str):
        self.cfg, self.role = cfg, role
        self.ids = probe_token_ids(learner.info.shape.vocab_size, probe_length(cfg), probe_text_ids(model_dir))
        self.probe_limit = resolve_limit(cfg.checks.probe_max_abs_mean, cfg, learner.info.params_dtype)
        self.step_limit = resolve_limit(cfg.checks.step_max_abs_mean, cfg, learner.info.params_dtype)
        self.previous: Optional[torch.Tensor] = None
        """[1, L-1] the learner's probe log-probs at the last sync (tells a stale engine)."""

    def fail(self, message: Optional[str]) -> None:
        """Stop the run on every rank (WeightCheckError), or with checks.stop=false say it."""
        if not message:
            return
        if self.cfg.checks.stop:
            raise WeightCheckError(message)
        self.role.say(f"[weight check] {message}", error=True)

    def after_step(self, metrics: Dict[str, float], step: int) -> None:
        """The step mismatch check (the metrics are the same on every rank)."""
        self.fail(step_mismatch_failure(metrics, self.step_limit, step))

    def after_sync(self, learner: "MegatronLearner", engine_urls: Sequence[str], all_urls: Sequence[str],
                   version: int, sent_checksums: Optional[Dict[str, str]] = None) -> Dict[str, float]:
        """Check `engine_urls` (the driver's: the engines in the sync; ignored elsewhere) after the
        sync of `version`: their checksums against `sent_checksums` (when given), then the probe.
        `all_urls` gives each engine's index. Returns `checksum/...` and `probe/...` metrics on
        the driver; raises WeightCheckError on every rank when an engine fails."""
        metrics: Dict[str, float] = {}
        if sent_checksums is not None:
            failure = None
            if self.role.is_driver:
                failure, metrics = self._compare_checksums(sent_checksums, engine_urls, list(all_urls), version)
            self.fail(self.role.broadcast(failure))
        if not self.cfg.checks.probe:
            return metrics
        return {**metrics, **self._probe(learner, engine_urls, all_urls, version)}

    def _compare_checksums(self, sent: Dict[str, str], urls: Sequence[str], all_urls: List[str],
                           version: int) -> Tuple[Optional[str], Dict[str, float]]:
        replies = asyncio.run(_checksums_of_engines(urls, self.cfg))
        errors = 0
        for url, (reported, error) in zip(urls, replies):
            index = all_urls.index(url) if url in all_urls else -1
            if error is not None:
                errors += 1
                self.role.say(f"[weight check] engine {index} ({url}) did not answer /weights_checker: {error}",
                              error=True)
                continue
            failure = judge_checksums(index, url, version, sent, reported)
            if failure:
                return failure, {}
        return None, {"checksum/tensors": float(len(sent)), "checksum/engines": float(len(urls) - errors),
                      "checksum/errors": float(errors)}

    def _probe(self, learner: "MegatronLearner", engine_urls: Sequence[str], all_urls: Sequence[str],
               version: int) -> Dict[str, float]:
        sample = TrainSample(prompt_ids=self.ids[:1], response_ids=self.ids[1:])
        learner_lp = learner.compute_log_probs([sample], temperature=1.0)[0].reshape(1, -1)  # collective
        previous, self.previous = self.previous, learner_lp
        failure, metrics = None, {}
        if self.role.is_driver:
            failure, metrics = self._judge_engines(learner_lp, previous, engine_urls, list(all_urls), version)
        self.fail(self.role.broadcast(failure))
        return metrics

    def _judge_engines(self, learner_lp: torch.Tensor, previous: Optional[torch.Tensor], urls: Sequence[str],
                       all_urls: List[str], version: int) -> Tuple[Optional[str], Dict[str, float]]:
        replies = asyncio.run(_score_on_engines(urls, self.ids, self.cfg))
        mask = torch.ones_like(learner_lp)
        worst: Dict[str, float] = {}
        errors = 0
        for url, (values, reported, error) in zip(urls, replies):
            index = all_urls.index(url) if url in all_urls else -1
            if error is not None:
                errors += 1
                self.role.say(f"[weight check] engine {index} ({url}) did not answer the weight probe: {error}",
                              error=True)
                continue
            engine_lp = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
            stats = compute_mismatch_stats(learner_lp, engine_lp, mask)
            before = compute_mismatch_stats(previous, engine_lp, mask) if previous is not None else None
            failure = judge_probe(index, url, version, reported, stats, self.probe_limit, before)
            if failure:
                return failure, {}
            for key, value in summarize_mismatch(stats, prefix="probe").items():
                if "/age_" not in key:
                    worst[key] = max(worst.get(key, 0.0), value)
        worst.update({"probe/engines": float(len(urls) - errors), "probe/errors": float(errors)})
        return None, worst
