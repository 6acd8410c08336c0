"""A verifier that accepts what a human grader would: math-verify (Hugging Face).

It parses LaTeX / plain expressions with sympy and compares them symbolically, so
"\\frac{1}{2}", "0.5" and "\\boxed{1/2}" all match a ground truth of "1/2". Symbolic
evaluation can run for ever ("9^{9^{9^9}}"), so it is never called in the trainer's process:
`score_responses` runs it in worker processes it kills on time-out.

math-verify's own time-outs use signal.alarm, which only works in a main thread; the
workers call it with them disabled and rely on being killed instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from dapo_mega.reward.types import VerifyResult, code_version


@dataclass(frozen=True)
class MathVerifyVerifier:
    """+1 if math-verify finds the response's answer equivalent to the ground truth.

    The ground truth is parsed as `\\boxed{<ground truth>}`; the response's last
    `max_response_chars` characters are parsed with math-verify's default LaTeX and
    expression extraction (boxed answers first). `extracted` is math-verify's string form
    of the answer it found.
    """

    max_response_chars: Optional[int] = 2000
    name: str = "math_verify"
    version: str = code_version("math_verify", __file__, "math-verify")
    runs_in_process: bool = False

    def score(self, response: str, ground_truth: str) -> VerifyResult:
        from math_verify import parse, verify

        logging.getLogger("math_verify").setLevel(logging.ERROR)  # the "timeout disabled" warning
        text = response if self.max_response_chars is None else response[-self.max_response_chars:]
        gold = parse("\\boxed{" + str(ground_truth) + "}", parsing_timeout=None)
        if not gold:
            gold = parse(str(ground_truth), parsing_timeout=None)
        predicted = parse(text, parsing_timeout=None)
        if not predicted:
            return VerifyResult(correct=False, reward=-1.0, extracted=None)
        extracted = (str(predicted[-1]) if len(predicted) > 1 else str(predicted[0]))[:200]
        correct = bool(gold) and bool(verify(gold, predicted, timeout_seconds=None))
        return VerifyResult(correct=correct, reward=1.0 if correct else -1.0, extracted=extracted)
