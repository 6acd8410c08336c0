"""What every verifier returns and promises.

A verifier turns (response, ground truth) into a VerifyResult. It carries a `name` and a
`version` that are stamped on every ledger row, so that a change of the grading rules is
visible next to the rewards it produced.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Mapping, Optional, Protocol, Tuple, runtime_checkable

Components = Tuple[Tuple[str, float], ...]
"""A verifier's own breakdown of its score, as (name, value) pairs (frozen, hashable)."""

VERIFIER_COMPONENT_PREFIX = "verifier/"
"""The ledger's `reward_components` key of a verifier's own component `name`:
`verifier/<name>` (a breakdown of `correctness`, never added to the reward again)."""


@dataclass(frozen=True)
class VerifyResult:
    """The verdict on one response.

    correct: the answer is equivalent to the ground truth; None when the reward gave no
        verdict (a bare score: a plugin's float, a dict without "acc"). A score carries no
        verdict: 0.1 for a well-formatted wrong answer is not a correct one, so accuracy and
        the all-correct / all-wrong filter never read one from it (`returns.py`).
    reward: the correctness reward, +1.0 when correct else −1.0 (DAPO Eq. 7).
    extracted: the answer the verifier read from the response (normalised), None if none.
    error: None, or "verifier_error: ..." when the verifier raised or ran out of time; the
        response is then scored as wrong (correct=False, reward=−1).
    components: the verifier's own breakdown of `reward` (a reward plugin's `components`);
        () for the built-in verifiers, whose reward is the ±1 verdict alone.
    """

    correct: Optional[bool]
    reward: float
    extracted: Optional[str] = None
    error: Optional[str] = None
    components: Components = ()


@dataclass(frozen=True)
class SampleReward:
    """The reward of one response and its parts, as the ledger and the learner see them.

    reward: correctness + overlong_penalty (DAPO Eq. 7 + Eq. 13).
    correct: the verifier's verdict.
    correctness: +1.0 correct / −1.0 wrong (or verifier error).
    overlong_penalty: in [−factor, 0]; 0 when shaping is off.
    verifier / verifier_version: who graded it (stamped in the ledger).
    verifier_error: None, or "verifier_error: ..." when the verifier raised or timed out.
    extracted: the answer the verifier read (normalised), None if none.
    verifier_components: the verifier's own breakdown of `correctness` (VerifyResult.components).
    """

    reward: float
    correct: Optional[bool]
    """The verdict; None when the reward gave none (VerifyResult.correct)."""
    correctness: float = 0.0
    overlong_penalty: float = 0.0
    verifier: str = ""
    verifier_version: str = ""
    verifier_error: Optional[str] = None
    extracted: Optional[str] = None
    verifier_components: Components = ()
    environment: float = 0.0
    """The reward parts a multi-turn sample's environment gave (rollout/turns.py), added in."""

    def components(self) -> Dict[str, float]:
        """The parts that add up to `reward` (the ledger's `reward_components`), then the
        verifier's breakdown of `correctness` under `verifier/<name>` (not added again)."""
        parts = {"correctness": self.correctness, "overlong_penalty": self.overlong_penalty}
        if self.environment:
            parts["environment"] = self.environment
        parts.update((VERIFIER_COMPONENT_PREFIX + name, value) for name, value in self.verifier_components)
        return parts


UNSCORED = SampleReward(reward=0.0, correct=False)
"""The reward of a sample no verifier has seen yet."""


def call_verifier(verifier: Verifier, response: str, ground_truth: str,
                  metadata: Optional[Mapping[str, object]] = None) -> VerifyResult:
    """`verifier.score` with the problem's metadata where the verifier takes it (a reward
    plugin), without it otherwise (the built-in verifiers and any two-argument one)."""
    if getattr(verifier, "takes_metadata", False):
        return verifier.score(response, ground_truth, dict(metadata or {}))  # type: ignore[call-arg]
    return verifier.score(response, ground_truth)


def verifier_error_result(message: str) -> VerifyResult:
    """The result recorded for a response the verifier could not score."""
    return VerifyResult(correct=False, reward=-1.0, extracted=None, error=f"verifier_error: {message}")


@runtime_checkable
class Verifier(Protocol):
    """A rule-based answer checker.

    name / version: stamped in the ledger.
    max_response_chars: the verifier only looks at this many trailing characters of the
        response (None: all of it). `score_responses` truncates before anything else, so
        a megabyte response costs no more than a short one.
    runs_in_process: its work is bounded by construction (bounded input, no super-linear
        backtracking, no symbolic evaluation), so `score_responses` may call it in the
        caller's process without a worker it could kill.
    takes_metadata (optional, default False): `score` takes a third argument, the problem's
        metadata dict (a reward plugin does; see `call_verifier`).
    scores_batches (optional, default False): `score_responses` hands it whole batches,
        `score_batch(responses, ground_truths, metadata, timeout_s, stats)`, in the caller's
        process (a reward server, whose only work here is waiting on the network).
    """

    name: str
    version: str
    max_response_chars: Optional[int]
    runs_in_process: bool

    def score(self, response: str, ground_truth: str) -> VerifyResult:
        ...


@dataclass
class VerifyStats:
    """Counts of one `score_responses` call (reported per step; never silently dropped).

    num_errors = num_timeouts + num_exceptions (+ responses lost to a crashed worker,
    counted in num_worker_deaths and num_errors). num_retries: requests to a reward server
    sent again after a failure (an error only once its last attempt failed).
    """

    num_responses: int = 0
    num_in_process: int = 0
    num_in_pool: int = 0
    num_errors: int = 0
    num_timeouts: int = 0
    num_exceptions: int = 0
    num_worker_deaths: int = 0
    num_retries: int = 0
    seconds: float = 0.0
    max_item_seconds: float = 0.0

    def as_metrics(self, prefix: str = "verifier/") -> Dict[str, float]:
        return {f"{prefix}{key}": float(value) for key, value in asdict(self).items()}


def code_version(name: str, source_file: str, *packages: str, declared: Optional[str] = None) -> str:
    """A verifier's version derived from what decides its verdicts, not typed by hand: its
    source file's hash and the versions of the libraries it calls, e.g.
    `dapo-3f9c1a2b7d` or `math_verify-a41c09e2f1+math-verify-0.8.0`. Any edit of the file
    (or a library upgrade) gives another version in the ledger. `declared`: a version its
    author declared (a reward plugin's `__version__`), used in place of the hash:
    `boxed_answer:score-1.2`."""
    from importlib.metadata import PackageNotFoundError, version

    digest = declared if declared is not None else hashlib.sha256(Path(source_file).read_bytes()).hexdigest()[:10]
    libs = []
    for package in packages:
        try:
            libs.append(f"+{package}-{version(package)}")
        except PackageNotFoundError:
            libs.append(f"+{package}-missing")
    return f"{name}-{digest}{''.join(libs)}"
