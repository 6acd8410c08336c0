"""Reward composition: correctness (±1) + soft overlong penalty (DAPO §3.4, Eq. 13).

    reward_i = correctness_i + overlong_penalty_i      (a truncated wrong answer: −2)

Both components are kept per sample for the ledger. The learner places the scalar
reward on the last response token (it is an outcome reward; advantages spread it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Protocol, Sequence

import torch

from dapo_mega.algo.overlong import compute_overlong_penalty
from dapo_mega.config import AlgoConfig
from dapo_mega.data.problem import Problem
from dapo_mega.reward.scoring import Text, VerifierPool, score_responses
from dapo_mega.reward.types import Components, SampleReward, Verifier, VerifyStats


@dataclass
class RewardBatch:
    """Per-sample reward components of N responses.

    correctness: [N] float32, +1 correct / −1 wrong (or verifier error).
    overlong_penalty: [N] float32 in [−factor, 0] (all 0 when shaping is off).
    reward: [N] float32 = correctness + overlong_penalty.
    correct: [N] bool (False where there is no verdict).
    verdict: [N] bool: the reward gave a verdict (VerifyResult.correct is not None).
    verifier_error: N × (None or "verifier_error: ...").
    extracted: N × the answer the verifier read (None if none).
    verifier_components: N × the verifier's own breakdown of correctness (a reward plugin's
        components; () for the built-in verifiers).
    stats: counts of the scoring call (errors, time-outs, seconds).
    """

    correctness: torch.Tensor
    overlong_penalty: torch.Tensor
    reward: torch.Tensor
    correct: torch.Tensor
    verdict: torch.Tensor
    verifier_error: List[Optional[str]]
    extracted: List[Optional[str]]
    stats: VerifyStats
    verifier_name: str
    verifier_version: str
    verifier_components: List[Components] = field(default_factory=list)

    def items(self) -> List[SampleReward]:
        """The typed reward of every sample (what the rollout manager stores on each), the
        tensors read once, not element by element."""
        parts = self.verifier_components or [()] * len(self.verifier_error)
        verdicts = [c if v else None for c, v in zip(self.correct.tolist(), self.verdict.tolist())]
        columns = zip(self.reward.tolist(), verdicts, self.correctness.tolist(),
                      self.overlong_penalty.tolist(), self.verifier_error, self.extracted, parts)
        return [SampleReward(reward=reward, correct=correct, correctness=correctness, overlong_penalty=penalty,
                             verifier=self.verifier_name, verifier_version=self.verifier_version,
                             verifier_error=error, extracted=extracted, verifier_components=tuple(components))
                for reward, correct, correctness, penalty, error, extracted, components in columns]


class _ScoredResponse(Protocol):
    response_text: Text
    token_ids: Sequence[int]


class ResponseGroup(Protocol):
    """What `score_groups` reads of a group (`rollout.samples.Group` is one): the problem and
    its sampled responses."""

    @property
    def prompt(self) -> Problem: ...

    @property
    def samples(self) -> Sequence[_ScoredResponse]: ...


def score_groups(verifier: Verifier, groups: Sequence[ResponseGroup], algo_cfg: AlgoConfig, prompt_template: str,
                 pool: Optional[VerifierPool] = None) -> RewardBatch:
    """`compute_rewards` of every sample of every group (a `Group`: `.prompt`, `.samples`),
    flat, group after group; each sample's answer prefix comes from its prompt and
    `prompt_template` (`verification_prefix`), its plugin metadata from `problem_metadata`."""
    from dapo_mega.data import verification_prefix
    from dapo_mega.reward.plugin import problem_metadata

    pairs = [(g.prompt, s) for g in groups for s in g.samples]
    return compute_rewards(verifier, [s.response_text for _, s in pairs], [p.ground_truth for p, _ in pairs],
                           [len(s.token_ids) for _, s in pairs], algo_cfg,
                           answer_prefixes=[verification_prefix(p, prompt_template) for p, _ in pairs], pool=pool,
                           metadata=[problem_metadata(p) for p, _ in pairs])


def compute_rewards(
    verifier: Verifier,
    responses: Sequence[Text],
    ground_truths: Sequence[str],
    response_lengths: Sequence[int],
    algo_cfg: AlgoConfig,
    answer_prefixes: Optional[Sequence[str]] = None,
    pool: Optional[VerifierPool] = None,
    metadata: Optional[Sequence[Mapping[str, object]]] = None,
) -> RewardBatch:
    """Verify N responses and add the overlong penalty.

    Args:
        verifier: from `build_verifier(algo_cfg.verifier)`.
        responses: N decoded responses.
        ground_truths: N reference answers.
        response_lengths: N response lengths in tokens (|y| of Eq. 13).
        algo_cfg: an AlgoConfig (or anything with its fields): max_response_length,
            overlong_buffer_enable, overlong_buffer_length, overlong_penalty_factor,
            verifier_timeout_s.
        answer_prefixes: see `score_responses` (the synthetic task's "Answer:").
        pool: optional worker pool (default: the shared one of the verifier).
        metadata: optional N problem metadata dicts for a reward plugin (`problem_metadata`).
    """
    results, stats = score_responses(verifier, responses, ground_truths, algo_cfg.verifier_timeout_s,
                                     answer_prefixes=answer_prefixes, pool=pool, metadata=metadata)
    correctness = torch.tensor([r.reward for r in results], dtype=torch.float32)
    if algo_cfg.overlong_buffer_enable:
        penalty = compute_overlong_penalty(list(response_lengths), algo_cfg.max_response_length,
                                           algo_cfg.overlong_buffer_length, algo_cfg.overlong_penalty_factor)
    else:
        penalty = torch.zeros(len(results), dtype=torch.float32)
    if penalty.shape != correctness.shape:
        raise ValueError(f"{len(response_lengths)} response lengths for {len(results)} responses")
    return RewardBatch(
        correctness=correctness,
        overlong_penalty=penalty,
        reward=correctness + penalty,
        correct=torch.tensor([bool(r.correct) for r in results], dtype=torch.bool),
        verdict=torch.tensor([r.correct is not None for r in results], dtype=torch.bool),
        verifier_error=[r.error for r in results],
        extracted=[r.extracted for r in results],
        stats=stats,
        verifier_name=verifier.name,
        verifier_version=verifier.version,
        verifier_components=[r.components for r in results],
    )
