"""What every verifier returns and promises.

A verifier turns (response, ground truth) into a VerifyResult. It carries a `name` and a
`version` that are stamped on every ledger row, so that a change of the grading rules is
visible next to the rewards it produced.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional, Protocol, runtime_checkable


@dataclass(frozen=True)
class VerifyResult:
    """The verdict on one response.

    correct: the answer is equivalent to the ground truth.
    reward: the correctness reward, +1.0 when correct else −1.0 (DAPO Eq. 7).
    extracted: the answer the verifier read from the response (normalised), None if none.
    error: None, or "verifier_error: ..." when the verifier raised or ran out of time; the
        response is then scored as wrong (correct=False, reward=−1).
    """

    correct: bool
    reward: float
    extracted: Optional[str] = None
    error: Optional[str] = None


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
    """

    reward: float
    correct: bool
    correctness: float = 0.0
    overlong_penalty: float = 0.0
    verifier: str = ""
    verifier_version: str = ""
    verifier_error: Optional[str] = None
    extracted: Optional[str] = None

    def components(self) -> Dict[str, float]:
        """The parts that add up to `reward` (the ledger's `reward_components`)."""
        return {"correctness": self.correctness, "overlong_penalty": self.overlong_penalty}


UNSCORED = SampleReward(reward=0.0, correct=False)
"""The reward of a sample no verifier has seen yet."""


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
    counted in num_worker_deaths and num_errors).
    """

    num_responses: int = 0
    num_in_process: int = 0
    num_in_pool: int = 0
    num_errors: int = 0
    num_timeouts: int = 0
    num_exceptions: int = 0
    num_worker_deaths: int = 0
    seconds: float = 0.0
    max_item_seconds: float = 0.0

    def as_metrics(self, prefix: str = "verifier/") -> Dict[str, float]:
        return {f"{prefix}{key}": float(value) for key, value in asdict(self).items()}


def code_version(name: str, source_file: str, *packages: str) -> str:
    """A verifier's version derived from what decides its verdicts, not typed by hand: its
    source file's hash and the versions of the libraries it calls, e.g.
    `dapo-3f9c1a2b7d` or `math_verify-a41c09e2f1+math-verify-0.8.0`. Any edit of the file
    (or a library upgrade) gives another version in the ledger."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256(Path(source_file).read_bytes()).hexdigest()[:10]
    libs = []
    for package in packages:
        try:
            libs.append(f"+{package}-{version(package)}")
        except PackageNotFoundError:
            libs.append(f"+{package}-missing")
    return f"{name}-{digest}{''.join(libs)}"
