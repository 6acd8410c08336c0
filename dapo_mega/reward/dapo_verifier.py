"""The DAPO reference recipe's rule-based verifier (Minerva answer normalisation).

Rules, as the recipe describes them:

* look only at the last 300 characters of the response (the longest MATH-500 answer has
  159), which also bounds the work whatever the response is;
* take the last match of `Answer\\s*:\\s*([^\\n]+)` (case-insensitive); none → wrong;
* normalise prediction and ground truth the way Minerva (Lewkowycz et al. 2022, App. D)
  does, and compare the strings: +1 if equal, −1 otherwise.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Optional

from dapo_mega.reward.types import VerifyResult, code_version

ANSWER_PATTERN = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Minerva's substitutions, applied in order (order matters: "an " before " ").
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# Units and filler words that carry no value.
_REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)
_INSIDE_DOLLARS = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")
_UNWRAP = (
    re.compile(r"(\\text\{)(.*?)(\})"),
    re.compile(r"(\\textbf\{)(.*?)(\})"),
    re.compile(r"(\\overline\{)(.*?)(\})"),
)
_BOXED = re.compile(r"(\\boxed\{)(.*)(\})")  # greedy: \boxed{\frac{1}{2}} keeps its braces
_SHORT_FRAC = re.compile(r"(frac)([^{])(.)")
_SHORT_SQRT = re.compile(r"(sqrt)([^{])")


@functools.lru_cache(maxsize=1 << 16)
def normalize_final_answer(answer: str) -> str:
    """Minerva normalisation of a final answer string.

    "x = \\$1,000 dollars" → "1000"; "\\boxed{\\frac12}" → "\\frac{1}{2}"; "90^\\circ" → "90".
    """
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in _REMOVED_EXPRESSIONS:
        answer = answer.replace(expression, "")
    answer = _INSIDE_DOLLARS.sub(r"$\3$", answer)
    for pattern in _UNWRAP:
        answer = pattern.sub(r"\2", answer)
    answer = _BOXED.sub(r"\2", answer)
    answer = _SHORT_FRAC.sub(r"frac{\2}{\3}", answer)
    answer = _SHORT_SQRT.sub(r"sqrt{\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():  # thousands separators
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer(response: str, window: Optional[int] = 300) -> Optional[str]:
    """The text after the last `Answer:` in the last `window` characters, or None."""
    text = response if window is None else response[-window:]
    matches = ANSWER_PATTERN.findall(text)
    return matches[-1] if matches else None


@dataclass(frozen=True)
class DapoVerifier:
    """+1 if the last `Answer:` line of the response's tail equals the ground truth after
    Minerva normalisation, −1 otherwise (DAPO Eq. 7, reference recipe's `math_dapo`).

    Runs in the caller's process: its input is capped at `max_response_chars` (300) and
    its regexes are at worst quadratic in that, so a call costs microseconds whatever the
    response (see `score_responses`, which still times it).
    """

    max_response_chars: Optional[int] = 300
    name: str = "dapo"
    version: str = code_version("dapo", __file__)
    runs_in_process: bool = True

    def score(self, response: str, ground_truth: str) -> VerifyResult:
        raw = extract_answer(response, self.max_response_chars)
        if raw is None:
            return VerifyResult(correct=False, reward=-1.0, extracted=None)
        predicted = normalize_final_answer(raw)
        correct = predicted == normalize_final_answer(str(ground_truth))
        return VerifyResult(correct=correct, reward=1.0 if correct else -1.0, extracted=predicted)
