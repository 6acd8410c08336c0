"""What a reward may return, and how it becomes a VerifyResult: one rule for a reward
plugin's return value and for each item of a reward server's reply (http_verifier.py).

    a RewardResult            as it is (score, correct, components, extracted)
    a bool                    a verdict: score 1.0 / 0.0 (verl's float(res)), correct = it
    a finite number           score = the number, and no verdict (correct = None): a
                              score says how good, not whether right (0.1 for a
                              well-formatted wrong answer is no correct one); accuracy
                              counts verdicts only, and dynamic sampling filters on the
                              score where a group has no verdicts (rollout/batch_fill.py)
    a tuple or list           verl's `default_compute_score` takes float(res[0]): its first
                              item, a bool or a finite number, read as above (prime_math's
                              (correct, extracted) pairs); the rest is left out
    a dict with "score"       verl's dict form: score = d["score"]; correct = d["acc"] where
                              present (a bool, or a number: > 0), else None; extracted =
                              d["pred"] (None, or its text); every other key whose value is a
                              finite number or a bool becomes a component; other values
                              (strings, lists, None) are left out

Anything else (a string, None, a dict without "score", NaN, a non-finite component) is a
TypeError in one line naming the reward, what it returned and what is accepted; the scorer
turns it into a verifier_error of that response (and the preflight probe into a refusal).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional

from dapo_mega.reward.types import VerifyResult

MAX_EXTRACTED_CHARS = 200
ACCEPTED = ("accepted: a finite number (the score, no verdict), a bool (the verdict), a tuple whose first "
            "item is one of those (verl reads res[0]), a dict with a finite 'score' (optional 'acc' verdict, 'pred' "
            "answer, other numeric keys as components), or dapo_mega.reward.RewardResult")
"""What `to_verify_result` accepts, in the words of its errors."""

_DICT_KEYS = ("score", "acc", "pred")


@dataclass(frozen=True)
class RewardResult:
    """What a reward plugin returns for one response (the richest of the accepted forms).

    score: the correctness reward, a finite number (the built-in verifiers give ±1).
    correct: the verdict (accuracy, all-correct / all-wrong groups are counted on it).
    components: names to finite numbers, the plugin's breakdown of `score` (ledger:
        `reward_components["verifier/<name>"]`).
    extracted: the answer the plugin read, None if none (ledger: `extracted_answer`).
    """

    score: float
    correct: bool
    components: Mapping[str, float] = field(default_factory=dict)
    extracted: Optional[str] = None


def to_verify_result(source: str, value: object) -> VerifyResult:
    """`value`, returned by the reward `source` names ("reward plugin m:f", "reward server
    http://..."), as a VerifyResult; TypeError in one line when it is none of the accepted forms."""
    if isinstance(value, RewardResult):
        return _from_reward_result(source, value)
    if isinstance(value, (tuple, list)) and value and (isinstance(value[0], bool) or _finite(value[0])):
        value = value[0]
    if isinstance(value, bool):
        return VerifyResult(correct=value, reward=float(value))
    if _finite(value):
        return VerifyResult(correct=None, reward=float(value))  # type: ignore[arg-type]
    if isinstance(value, Mapping):
        return _from_dict(source, value)
    raise TypeError(f"{source} returned {_shown(value)}; {ACCEPTED}")


def _from_reward_result(source: str, value: RewardResult) -> VerifyResult:
    if not _finite(value.score):
        raise TypeError(f"{source}: score {value.score!r} is not a finite number; {ACCEPTED}")
    if not isinstance(value.correct, bool):
        raise TypeError(f"{source}: correct {value.correct!r} is not a bool")
    if not isinstance(value.components, Mapping):
        raise TypeError(f"{source}: components is a {type(value.components).__name__}, not a dict")
    for name, part in value.components.items():
        if not isinstance(name, str) or not _finite(part):
            raise TypeError(f"{source}: component {name!r}={part!r} is not a name and a finite number")
    if value.extracted is not None and not isinstance(value.extracted, str):
        raise TypeError(f"{source}: extracted {value.extracted!r} is not a str or None")
    return VerifyResult(correct=value.correct, reward=float(value.score), extracted=_cut(value.extracted),
                        components=_frozen({name: float(part) for name, part in value.components.items()}))


def _from_dict(source: str, value: Mapping) -> VerifyResult:
    if "score" not in value:
        raise TypeError(f"{source} returned a dict without 'score' (keys {sorted(map(str, value))[:10]}); {ACCEPTED}")
    score = value["score"]
    if not _finite(score):
        raise TypeError(f"{source}: 'score' {score!r} is not a finite number; {ACCEPTED}")
    acc = value.get("acc")
    if acc is None:
        correct = None
    elif isinstance(acc, bool) or _finite(acc):
        correct = bool(acc) if isinstance(acc, bool) else float(acc) > 0
    else:
        raise TypeError(f"{source}: 'acc' {acc!r} is not a bool or a finite number (the verdict)")
    pred = value.get("pred")
    components: Dict[str, float] = {}
    for name, part in value.items():
        if name in _DICT_KEYS or not isinstance(part, (bool, numbers.Real)):
            continue
        if not isinstance(name, str) or not (isinstance(part, bool) or _finite(part)):
            raise TypeError(f"{source}: key {name!r}={part!r} is not a name and a finite number")
        components[name] = float(part)
    return VerifyResult(correct=correct, reward=float(score), extracted=None if pred is None else _cut(str(pred)),
                        components=_frozen(components))


def _frozen(components: Mapping[str, float]):
    return tuple(sorted(components.items()))


def _cut(text: Optional[str]) -> Optional[str]:
    return None if text is None else text[:MAX_EXTRACTED_CHARS]


def _finite(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value: object) -> str:
    """`value` for an error line: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:80] + ('...' if len(text) > 80 else '')}"
