"""An example reward plugin: exact match of the last `\\boxed{...}`, and a length component.

    PYTHONPATH=examples/rewards dapo-mega train algo.verifier=boxed_answer:score

The answer is the content of the response's last `\\boxed{...}` (braces balanced), or,
where the response has none, the text after its last `Answer:` (so that it also grades the
CPU default's synthetic task, whose prompt ends with "Answer:"). Answer and ground truth are
compared as strings once spaces and `$` are removed.

    exact_match = +1 if they are equal, -1 otherwise
    length      = -LENGTH_WEIGHT * min(1, len(response) / LENGTH_BUDGET_CHARS)
    score       = exact_match + length

The function follows the signature docs/rewards.md documents; `__version__` below is the
version every ledger row of a run it graded carries (`boxed_answer:score-1.0`): change it
with the rules (without it, the version would be a hash of this file).
"""

import re

from dapo_mega.reward import RewardResult

__version__ = "1.0"

LENGTH_WEIGHT = 0.1
LENGTH_BUDGET_CHARS = 2000
_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]*)", re.IGNORECASE)


def last_boxed(text: str):
    """The content of the last `\\boxed{...}` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len("\\boxed{"):i - 1]
        start = text.rfind("\\boxed{", 0, start)
    return None


def normalize(answer: str) -> str:
    return answer.replace("$", "").replace(" ", "").strip()


def score(response: str, ground_truth: str, metadata: dict) -> RewardResult:
    answer = last_boxed(response)
    if answer is None:
        lines = _ANSWER_LINE.findall(response)
        answer = lines[-1] if lines else None
    correct = answer is not None and normalize(answer) == normalize(ground_truth)
    exact_match = 1.0 if correct else -1.0
    length = -LENGTH_WEIGHT * min(1.0, len(response) / LENGTH_BUDGET_CHARS)
    return RewardResult(score=exact_match + length, correct=correct,
                        components={"exact_match": exact_match, "length": length},
                        extracted=None if answer is None else normalize(answer))
