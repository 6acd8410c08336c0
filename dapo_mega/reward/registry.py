"""The one place `algo.verifier` becomes a Verifier: a built-in name, a plugin or a server.

    build_verifier("dapo")                      the recipe's Minerva rule (in process)
    build_verifier("math_verify")               math-verify (worker pool)
    build_verifier("boxed_answer:score")        a reward plugin (worker pool; reward/plugin.py)
    build_verifier("my_reward.py")              a reward file, verl's compute_score (worker pool)
    build_verifier("http://judge:8000/score")   a reward server (batched requests; http_verifier.py)
    check_verifier(spec, timeout_s)             before anything is built: the above, and a
                                                plugin or server called once on a probe
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

from dapo_mega.config import ConfigError
from dapo_mega.reward.dapo_verifier import DapoVerifier
from dapo_mega.reward.http_verifier import HttpVerifier, is_server_url
from dapo_mega.reward.math_verify_verifier import MathVerifyVerifier
from dapo_mega.reward.plugin import FIELD, SIGNATURES, PluginVerifier, is_plugin_path
from dapo_mega.reward.returns import ACCEPTED
from dapo_mega.reward.types import Verifier

VERIFIERS: Dict[str, Callable[[], Verifier]] = {"dapo": DapoVerifier, "math_verify": MathVerifyVerifier}
"""The built-in verifiers by name; any other `algo.verifier` is a plugin's path or a server's URL."""

PROBE_RESPONSE = "The answer is 7.\nAnswer: \\boxed{7}"
PROBE_GROUND_TRUTH = "7"
PROBE_METADATA = {"id": "probe", "data_source": "probe", "prompt": "What is 3 + 4?"}
"""The one call `check_verifier` makes of a plugin or a server before a run starts."""


def build_verifier(spec: str, reward_kwargs: Optional[Mapping[str, object]] = None) -> Verifier:
    """The verifier `algo.verifier` names (a plugin given `algo.reward_kwargs` on every call);
    ConfigError naming the field when it cannot be used."""
    if spec in VERIFIERS:
        return VERIFIERS[spec]()
    if is_server_url(spec):
        return HttpVerifier.connect(spec)
    if is_plugin_path(spec):
        return PluginVerifier.from_path(spec, reward_kwargs)
    raise ConfigError(f"{FIELD}: unknown verifier {spec!r}. Fix: use one of {', '.join(sorted(VERIFIERS))}, "
                      f"a reward plugin's import path package.module:function or file path/to/file.py[:function] "
                      f"{SIGNATURES}, or a reward server's URL http://host:port/path (docs/rewards.md)")


def check_verifier(spec: str, timeout_s: float, reward_kwargs: Optional[Mapping[str, object]] = None) -> Verifier:
    """`build_verifier(spec)`, and for a plugin one call on a probe in a worker process of its
    own, for a server one request, bounded by `timeout_s`: an exception, a hang or a result
    that is none of the accepted forms fails here, in one line naming the plugin or server,
    what it returned and what is accepted, before any model is built."""
    from dapo_mega.reward.scoring import VerifierPool, score_responses

    verifier = build_verifier(spec, reward_kwargs)
    if not isinstance(verifier, (PluginVerifier, HttpVerifier)):
        return verifier
    pool = VerifierPool(verifier, num_workers=1) if isinstance(verifier, PluginVerifier) else None
    try:
        results, _ = score_responses(verifier, [PROBE_RESPONSE], [PROBE_GROUND_TRUTH], timeout_s,
                                     pool=pool, metadata=[PROBE_METADATA])
    finally:
        if pool is not None:
            pool.close()
    error = results[0].error
    if error is not None:
        what = "reward plugin" if isinstance(verifier, PluginVerifier) else "reward server"
        raise ConfigError(f"{FIELD}: {what} {spec!r} failed its probe call (response {PROBE_RESPONSE!r}, "
                          f"ground truth {PROBE_GROUND_TRUTH!r}, metadata {PROBE_METADATA}): {error}. "
                          f"Fix: make it answer within algo.verifier_timeout_s for any text; {ACCEPTED} "
                          f"(docs/rewards.md)")
    return verifier
