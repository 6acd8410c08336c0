"""Answer verification and reward composition.

    build_verifier(name)        "dapo" (the recipe's Minerva rule) or "math_verify"
    score_responses(...)        batch scoring with a hard time bound per response
    compute_rewards(...)        correctness ±1 + soft overlong penalty, per-sample components
"""

from dapo_mega.reward.dapo_verifier import DapoVerifier, extract_answer, normalize_final_answer
from dapo_mega.reward.math_verify_verifier import MathVerifyVerifier
from dapo_mega.reward.scoring import (
    VerifierPool,
    close_verifier_pools,
    coerce_text,
    get_verifier_pool,
    score_responses,
)
from dapo_mega.reward.types import UNSCORED, SampleReward, Verifier, VerifyResult, VerifyStats, verifier_error_result


def __getattr__(name: str):
    # compose needs torch; loaded on first use so that verifier worker processes, which
    # import this package to unpickle their verifier, start without importing torch.
    if name in ("RewardBatch", "compute_rewards"):
        from dapo_mega.reward import compose

        return getattr(compose, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


VERIFIERS = {"dapo": DapoVerifier, "math_verify": MathVerifyVerifier}


def build_verifier(name: str) -> Verifier:
    """The verifier named by `algo.verifier`."""
    try:
        return VERIFIERS[name]()
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; use one of {sorted(VERIFIERS)} (algo.verifier)") from None


__all__ = [
    "DapoVerifier",
    "MathVerifyVerifier",
    "RewardBatch",
    "SampleReward",
    "UNSCORED",
    "VERIFIERS",
    "Verifier",
    "VerifierPool",
    "VerifyResult",
    "VerifyStats",
    "build_verifier",
    "close_verifier_pools",
    "coerce_text",
    "compute_rewards",
    "extract_answer",
    "get_verifier_pool",
    "normalize_final_answer",
    "score_responses",
    "verifier_error_result",
]
