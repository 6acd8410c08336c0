"""Answer verification and reward composition.

    build_verifier(spec)        "dapo" (the recipe's Minerva rule), "math_verify", a reward
                                plugin's import path "package.module:function" or file
                                "path/file.py[:function]" (dapo-mega's, verl's or slime's
                                signature), or a reward server's URL "http://..." (registry.py)
    check_verifier(spec, ...)   the same, and a plugin or server probed once (preflight)
    score_responses(...)        batch scoring with a hard time bound per response
    compute_rewards(...)        correctness ±1 + soft overlong penalty, per-sample components
    score_groups(...)           compute_rewards of every sample of rollout groups (training, eval)
"""

from dapo_mega.reward.dapo_verifier import DapoVerifier, extract_answer, normalize_final_answer
from dapo_mega.reward.http_verifier import HttpVerifier, is_server_url
from dapo_mega.reward.math_verify_verifier import MathVerifyVerifier
from dapo_mega.reward.plugin import PluginVerifier, is_plugin_path, problem_metadata
from dapo_mega.reward.registry import VERIFIERS, build_verifier, check_verifier
from dapo_mega.reward.returns import RewardResult, to_verify_result
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
    if name in ("RewardBatch", "compute_rewards", "score_groups"):
        from dapo_mega.reward import compose

        return getattr(compose, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")



__all__ = [
    "DapoVerifier",
    "HttpVerifier",
    "MathVerifyVerifier",
    "PluginVerifier",
    "RewardBatch",
    "RewardResult",
    "SampleReward",
    "UNSCORED",
    "VERIFIERS",
    "Verifier",
    "VerifierPool",
    "VerifyResult",
    "VerifyStats",
    "build_verifier",
    "check_verifier",
    "close_verifier_pools",
    "coerce_text",
    "compute_rewards",
    "score_groups",
    "extract_answer",
    "get_verifier_pool",
    "is_plugin_path",
    "is_server_url",
    "normalize_final_answer",
    "problem_metadata",
    "score_responses",
    "to_verify_result",
    "verifier_error_result",
]
