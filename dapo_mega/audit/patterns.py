"""The pure parts of the audit: one typed record per response, its verdict, the patterns a
person should look at, and the seeded stratified picks. No engines, no files.

Verdicts partition the responses (their counts add up to N):

    verifier_error  the verifier raised or ran out of time (scored as wrong in training)
    correct         the verifier accepts the answer
    no_answer       nothing extracted: a format failure (DAPO rule: no `Answer:` line)
    wrong           an answer was extracted and does not match

`truncated` (stopped by the length limit) is a flag beside the verdict, not a verdict: a
truncated response may still carry a correct answer line.

Suspicious patterns, each a flag on the record:

    copied_answer        the ground truth, or the extracted answer, appears verbatim (as a
                         whole token, not inside a longer number) in the prompt as rendered
    several_answer_lines more than one `Answer:` line in what the verifier reads
    no_working           the response is little more than its answer line; not checked where
                         the prompt itself ends in the answer line (the synthetic task's
                         "Answer:" prefix asks for the answer alone)
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from dapo_mega.reward.dapo_verifier import ANSWER_PATTERN

VERDICTS = ("correct", "wrong", "no_answer", "verifier_error")
"""Every response has exactly one of these."""
PATTERNS = ("copied_answer", "several_answer_lines", "no_working")
STRATA = ("correct", "wrong", "no_answer", "truncated", "verifier_error", "disagreement", *PATTERNS)
"""The strata picks are drawn from, in the sheet's order; a response may be in several."""
STRATUM_TITLES = {
    "correct": "Correct", "wrong": "Wrong", "no_answer": "Format failures (no answer extracted)",
    "truncated": "Truncated (length limit)", "verifier_error": "Verifier errors",
    "disagreement": "Disagreements between the two verifiers",
    "copied_answer": "Suspicious: answer copied from the prompt",
    "several_answer_lines": "Suspicious: several Answer: lines",
    "no_working": "Suspicious: an answer with no working",
}
MIN_WORKING_CHARS = 20
"""A response with fewer non-blank characters than this besides its answer lines has no working."""


@dataclass
class VerifierView:
    """What one verifier said about a response."""

    name: str
    version: str
    correct: bool
    extracted: Optional[str]
    error: Optional[str] = None


@dataclass
class AuditRecord:
    """One response of the audit, from the prompt as the model saw it to its verdicts."""

    index: int
    """Position among the N audited prompts (their order in the training set)."""
    problem_id: str
    ground_truth: str
    prompt: str
    """The prompt as rendered for the model (the encoder's text, chat template included)."""
    response: str
    verification_prefix: str
    """Prepended to the response before verification (the synthetic task's "Answer:")."""
    response_tokens: int
    truncated: bool
    sampling_seed: Optional[int]
    reward: float
    components: Dict[str, float]
    """The parts that add up to `reward` (correctness, overlong_penalty), as in training."""
    verifier: VerifierView
    """The training verifier (algo.verifier): the verdict is its."""
    other: Optional[VerifierView] = None
    """The other verifier (math-verify beside the DAPO rule, or the reverse); None when not installed."""
    flags: List[str] = field(default_factory=list)
    """The suspicious patterns found (PATTERNS)."""
    notes: List[str] = field(default_factory=list)
    """Why each flag was raised, in words."""

    @property
    def verdict(self) -> str:
        return verdict_of(self.verifier)

    @property
    def disagreement(self) -> bool:
        """Both verifiers scored it without error and one accepts what the other rejects."""
        o = self.other
        return (o is not None and o.error is None and self.verifier.error is None
                and o.correct != self.verifier.correct)

    def strata(self) -> List[str]:
        """The strata this response belongs to (STRATA order)."""
        member = {self.verdict, *self.flags}
        if self.truncated:
            member.add("truncated")
        if self.disagreement:
            member.add("disagreement")
        return [s for s in STRATA if s in member]

    def to_dict(self) -> Dict[str, object]:
        return {**asdict(self), "verdict": self.verdict, "disagreement": self.disagreement, "strata": self.strata()}


def verdict_of(view: VerifierView) -> str:
    """verifier_error, correct, no_answer or wrong (see the module docstring)."""
    if view.error is not None:
        return "verifier_error"
    if view.correct:
        return "correct"
    return "no_answer" if view.extracted is None else "wrong"


# ---------------------------------------------------------------------- patterns
def count_answer_lines(text: str) -> int:
    """`Answer:` lines in `text` (the DAPO rule's pattern, over the whole text)."""
    return len(ANSWER_PATTERN.findall(text))


def _appears_in(needle: str, haystack: str) -> bool:
    """`needle` occurs in `haystack` as a whole token: "4" is in "Q: 4+0" but not in "Q: 42"."""
    needle = needle.strip()
    if not needle:
        return False
    pattern = r"(?<![0-9A-Za-z])" + re.escape(needle) + r"(?![0-9A-Za-z])"
    return re.search(pattern, haystack) is not None


def copied_from_prompt(prompt: str, ground_truth: str, extracted: Optional[str]) -> List[str]:
    """Why the answer may be copied from the prompt: [] or one line per finding."""
    found = []
    if _appears_in(ground_truth, prompt):
        found.append(f"the ground truth {ground_truth.strip()!r} appears verbatim in the prompt")
    if extracted is not None and extracted.strip() != ground_truth.strip() and _appears_in(extracted, prompt):
        found.append(f"the extracted answer {extracted.strip()!r} appears verbatim in the prompt")
    return found


def has_no_working(response: str, verification_prefix: str = "") -> bool:
    """The response holds an answer line and little else (< MIN_WORKING_CHARS non-blank
    characters beside it). False where the prompt ends in the answer line
    (`verification_prefix` non-empty): there the answer alone is what was asked for."""
    if verification_prefix or not ANSWER_PATTERN.search(response):
        return False
    rest = ANSWER_PATTERN.sub("", response)
    return len("".join(rest.split())) < MIN_WORKING_CHARS


def find_patterns(record: AuditRecord) -> AuditRecord:
    """Set `record.flags` and `record.notes` from its prompt, response and extracted answer."""
    flags, notes = [], []
    copied = copied_from_prompt(record.prompt, record.ground_truth, record.verifier.extracted)
    if copied:
        flags.append("copied_answer")
        notes += copied
    lines = count_answer_lines(record.verification_prefix + record.response)
    if lines > 1:
        flags.append("several_answer_lines")
        notes.append(f"{lines} Answer: lines (the DAPO rule reads the last one in the last 300 characters)")
    if has_no_working(record.response, record.verification_prefix):
        flags.append("no_working")
        notes.append(f"fewer than {MIN_WORKING_CHARS} characters beside the answer line")
    record.flags, record.notes = flags, notes
    return record


# ---------------------------------------------------------------------- counts and picks
def count_records(records: Sequence[AuditRecord]) -> Dict[str, int]:
    """Verdict counts (they add up to N), then truncated, disagreements and each pattern."""
    counts = {v: 0 for v in VERDICTS}
    for r in records:
        counts[r.verdict] += 1
    counts["truncated"] = sum(r.truncated for r in records)
    counts["disagreement"] = sum(r.disagreement for r in records)
    for p in PATTERNS:
        counts[p] = sum(p in r.flags for r in records)
    return counts


def choose_indices(population: int, n: int, seed: int, salt: str) -> List[int]:
    """`min(n, population)` distinct indices of range(population), sorted, a pure function of
    (seed, salt): string seeds hash the same in every process (no PYTHONHASHSEED)."""
    rng = random.Random(f"audit:{seed}:{salt}")
    return sorted(rng.sample(range(population), min(n, population)))


def pick_strata(records: Sequence[AuditRecord], per_stratum: int, seed: int) -> Dict[str, List[int]]:
    """Stratum -> positions in `records` of up to `per_stratum` picks, drawn with `seed`
    (each stratum its own draw, so one stratum's size does not move another's picks).
    Every non-empty stratum gets min(per_stratum, its size) picks."""
    picks: Dict[str, List[int]] = {}
    for stratum in STRATA:
        members = [i for i, r in enumerate(records) if stratum in r.strata()]
        picks[stratum] = [members[j] for j in choose_indices(len(members), per_stratum, seed, stratum)]
    return picks
