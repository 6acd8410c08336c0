"""The one place `algo.verifier` becomes a Verifier: a built-in name, a plugin or a server.

    build_verifier("dapo")                      the recipe's Minerva rule (in process)
    build_verifier("math_verify")               math-verify (worker pool)
    build_verifier("boxed_answer:score")        a reward plugin (worker pool; reward/plugin.py)
    build_verifier("my_reward.py")              a reward file, verl's compute_score (worker pool)
    build_verifier("http://judge:8000/score")   a reward server (batched requests; http_verifier.py)
    check_verifier(spec, timeout_s, probe=...)  before anything is built: the above, and a
                                                plugin or server called once on a training row
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

from dapo_mega.config import ConfigError
from dapo_mega.data.problem import Problem
from dapo_mega.reward.dapo_verifier import DapoVerifier
from dapo_mega.reward.http_verifier import HttpVerifier, is_server_url
from dapo_mega.reward.math_verify_verifier import MathVerifyVerifier
from dapo_mega.reward.plugin import FIELD, SIGNATURES, PluginVerifier, is_plugin_path, problem_metadata
from dapo_mega.reward.returns import ACCEPTED
from dapo_mega.reward.types import Verifier

VERIFIERS: Dict[str, Callable[[], Verifier]] = {"dapo": DapoVerifier, "math_verify": MathVerifyVerifier}
"""The built-in verifiers by name; any other `algo.verifier` is a plugin's path or a server's URL."""

PROBE_RESPONSE = "The answer is {answer}.\nAnswer: \\boxed{{{answer}}}"
"""The response of the one call `check_verifier` makes of a plugin or a server before a run
starts, on a real row of the training data (its ground truth as the answer, its metadata and
`extra_info` as the run will give them)."""
PROBE_PROBLEM = Problem(id="probe", prompt="What is 3 + 4?", ground_truth="7", data_source="probe")
"""The row probed where a caller has no training data to give (a verifier checked alone)."""


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


def check_verifier(spec: str, timeout_s: float, reward_kwargs: Optional[Mapping[str, object]] = None,
                   probe: Problem = PROBE_PROBLEM, probe_where: str = "a made-up problem") -> Verifier:
    """`build_verifier(spec)`, and for a plugin one call on `probe` (a row of the run's training
    data, `probe_where` saying which) in a worker process of its own, for a server one request,
    bounded by `timeout_s`: an exception, a hang or a result that is none of the accepted forms
    fails here, in one line naming the plugin or server, the row, what it returned and what is
    accepted, before any model is built."""
    from dapo_mega.reward.scoring import VerifierPool, score_responses

    verifier = build_verifier(spec, reward_kwargs)
    if not isinstance(verifier, (PluginVerifier, HttpVerifier)):
        return verifier
    pool = VerifierPool(verifier, num_workers=1) if isinstance(verifier, PluginVerifier) else None
    response = PROBE_RESPONSE.format(answer=probe.ground_truth)
    metadata = problem_metadata(probe)
    try:
        results, _ = score_responses(verifier, [response], [probe.ground_truth], timeout_s,
                                     pool=pool, metadata=[metadata])
    finally:
        if pool is not None:
            pool.close()
    error = results[0].error
    if error is not None:
        what = "reward plugin" if isinstance(verifier, PluginVerifier) else "reward server"
        raise ConfigError(f"{FIELD}: {what} {spec!r} failed its probe call on {probe_where} (response "
                          f"{response!r}, ground truth {probe.ground_truth!r}, metadata {metadata}): {error}. "
                          f"Fix: make it answer within algo.verifier_timeout_s for any text; {ACCEPTED} "
                          f"(docs/rewards.md)")
    return verifier
