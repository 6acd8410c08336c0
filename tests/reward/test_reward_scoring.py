"""Bounded batch scoring: pathological responses, exceptions, hangs, dead workers.

Verifier classes below are module-level so the worker processes can unpickle them (the
pool passes this process's sys.path to its workers).
"""

import os
import time

import pytest

from dapo_mega.reward import (
    DapoVerifier,
    MathVerifyVerifier,
    VerifierPool,
    VerifyResult,
    build_verifier,
    score_responses,
)

PATHOLOGICAL = [
    "x" * 3_000_000 + "\nAnswer: 46",           # megabytes
    "{" * 100_000,                               # 100k nested braces
    "Answer: " + "9" * 1_000_000,               # a million-digit number
    b"\xff\xfe\xc3(Answer: 46",                  # invalid UTF-8 bytes
    "Answer: 46\ud800\udfff\ud800",              # lone surrogates
]


class RaisingVerifier:
    name, version, max_response_chars = "raising", "1", None

    def __init__(self, runs_in_process: bool):
        self.runs_in_process = runs_in_process

    def score(self, response, ground_truth):
        if "boom" in response:
            raise ValueError("cannot parse boom")
        return VerifyResult(True, 1.0, response, None)


class SlowVerifier:
    name, version, max_response_chars, runs_in_process = "slow", "1", None, True

    def score(self, response, ground_truth):
        time.sleep(0.3)
        return VerifyResult(True, 1.0, None, None)


class DyingVerifier:
    name, version, max_response_chars, runs_in_process = "dying", "1", None, False

    def score(self, response, ground_truth):
        if response == "die":
            os._exit(3)
        return VerifyResult(response == ground_truth, 1.0 if response == ground_truth else -1.0, response, None)


class SpinningVerifier:
    """Never returns, busy (a pathological regex, say): only a signal ends its worker."""

    name, version, max_response_chars, runs_in_process = "spinning", "1", None, False

    def score(self, response, ground_truth):
        while True:
            pass


TRAINER_SCORING_WITH_A_HUNG_VERIFIER = """
import sys
sys.path.insert(0, sys.argv[1])
from test_reward_scoring import SpinningVerifier
from dapo_mega.reward import VerifierPool, VerifyStats
pool = VerifierPool(SpinningVerifier(), num_workers=1)
print("scoring", flush=True)
pool.score(["x"], ["1"], timeout_s=600, stats=VerifyStats())
"""


def test_a_worker_in_a_hung_verifier_ends_with_a_sigkilled_trainer(tmp_path):
    """The worker never reads its pipe again, so the parent's end closing cannot stop it;
    it was started tethered (dapo_mega/tether.py), so the kernel's SIGTERM does."""
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    out = tmp_path / "out"
    with open(out, "w") as log:
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER_SCORING_WITH_A_HUNG_VERIFIER,
                                    str(Path(__file__).parent)], stdout=log, stderr=subprocess.STDOUT)
    workers = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not workers:
            time.sleep(0.2)
            busy = [c for c in psutil.Process(trainer.pid).children() if c.cpu_percent(interval=0.2) > 50]
            workers = busy if "scoring" in out.read_text() else []
        assert workers, out.read_text()[-3000:]
        trainer.kill()
        trainer.wait(timeout=30)
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"verifier worker {[p.pid for p in alive]} outlived the SIGKILLed trainer"
    finally:
        for p in workers:
            if p.is_running():
                p.kill()
        if trainer.poll() is None:
            trainer.kill()


def test_dapo_fast_path_handles_pathological_input_in_process():
    start = time.monotonic()
    results, stats = score_responses(DapoVerifier(), PATHOLOGICAL, ["46"] * len(PATHOLOGICAL), timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert elapsed < 1.0  # all in-process, microseconds each after truncation
    assert stats.num_in_process == len(PATHOLOGICAL) and stats.num_in_pool == 0
    assert [r.correct for r in results] == [True, False, False, True, False]
    assert results[4].extracted == "46???"  # surrogates replaced, not crashed
    assert stats.num_errors == 0


def test_answer_prefix_lets_the_verifier_see_the_prompt_tail():
    # the synthetic task's prompt ends with "Answer:"; the model writes " 46\n"
    results, _ = score_responses(DapoVerifier(), [" 46\n", " 45\n"], ["46", "46"], answer_prefixes=["Answer:"] * 2)
    assert [r.correct for r in results] == [True, False]
    results, _ = score_responses(DapoVerifier(), [" 46\n"], ["46"])
    assert results[0].correct is False and results[0].extracted is None


def test_in_process_exception_and_overtime_are_counted_errors():
    results, stats = score_responses(RaisingVerifier(runs_in_process=True), ["fine", "boom"], ["a", "b"])
    assert results[0].correct and results[0].error is None
    assert (results[1].correct, results[1].reward) == (False, -1.0)
    assert results[1].error.startswith("verifier_error: ValueError: cannot parse boom")
    assert stats.num_exceptions == 1 and stats.num_errors == 1

    results, stats = score_responses(SlowVerifier(), ["a"], ["a"], timeout_s=0.1)
    assert results[0].correct is False and "timeout" in results[0].error
    assert stats.num_timeouts == 1 and stats.num_errors == 1


def test_length_mismatch_is_a_caller_error():
    with pytest.raises(ValueError):
        score_responses(DapoVerifier(), ["a", "b"], ["a"])


@pytest.fixture(scope="module")
def math_verify_pool():
    pool = VerifierPool(MathVerifyVerifier(), num_workers=2)
    yield pool
    pool.close()


def test_math_verify_accepts_equivalent_forms(math_verify_pool):
    verifier = build_verifier("math_verify")
    assert verifier.name == "math_verify" and verifier.version.startswith("math_verify-")
    responses = ["so \\boxed{\\frac{1}{2}}", "Answer: 0.5", "the answer is $\\frac{2}{4}$", "\\boxed{3}", "Answer: 46"]
    truths = ["1/2", "\\frac{1}{2}", "0.5", "1/2", "46"]
    results, stats = score_responses(verifier, responses, truths, timeout_s=10.0, pool=math_verify_pool)
    assert [r.correct for r in results] == [True, True, True, False, True]
    assert [r.reward for r in results] == [1.0, 1.0, 1.0, -1.0, 1.0]
    assert stats.num_in_pool == 5 and stats.num_errors == 0


def test_math_verify_hang_is_killed_within_the_bound(math_verify_pool):
    # sympy evaluates 9^(9^(9^9)) eagerly: without a kill this never returns
    responses = ["Answer: $9^{9^{9^{9}}}$"] + PATHOLOGICAL + ["\\boxed{46}"]
    truths = ["46"] * len(responses)
    timeout_s = 2.0
    start = time.monotonic()
    results, stats = score_responses(MathVerifyVerifier(), responses, truths, timeout_s=timeout_s,
                                     pool=math_verify_pool)
    elapsed = time.monotonic() - start
    # 7 items over 2 workers, each at most timeout_s, plus a worker restart (< 1 s)
    assert elapsed < 4 * timeout_s + 5.0
    assert results[0].correct is False and results[0].reward == -1.0
    assert results[0].error == f"verifier_error: timeout after {timeout_s:g}s"
    assert stats.num_timeouts >= 1 and stats.num_errors == sum(r.error is not None for r in results)
    assert results[-1].correct  # the pool keeps working after the kill
    assert results[1].correct   # megabyte response: its tail holds the answer
    assert results[4].correct   # invalid UTF-8 bytes decoded leniently
    assert all(r.reward in (1.0, -1.0) for r in results)


def test_pool_counts_exceptions_and_dead_workers():
    pool = VerifierPool(DyingVerifier(), num_workers=1)
    try:
        results, stats = score_responses(DyingVerifier(), ["a", "die", "b"], ["a", "x", "c"], timeout_s=20.0,
                                         pool=pool)
        assert [r.correct for r in results] == [True, False, False]
        assert results[1].error.startswith("verifier_error: worker died")
        assert results[2].error is None and results[2].extracted == "b"  # scored by the replacement
        assert stats.num_worker_deaths == 1 and stats.num_errors == 1 and pool.num_restarts == 1
    finally:
        pool.close()
    pool = VerifierPool(RaisingVerifier(runs_in_process=False), num_workers=1)
    try:
        results, stats = score_responses(pool.verifier, ["boom", "ok"], ["a", "b"], timeout_s=20.0, pool=pool)
        assert results[0].error.startswith("verifier_error: ValueError") and results[1].correct
        assert stats.num_exceptions == 1 and stats.num_errors == 1 and stats.num_in_pool == 2
    finally:
        pool.close()
