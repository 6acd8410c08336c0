"""The rollout manager at the real run's clock: slow engines are not dead ones, hung engines
are found by their silence, work spreads over every engine, a recovered engine serves again.

The engines are embedded engines slowed by `--test-decode-delay-ms` (a sleep after every
forward step, allowed only with DAPO_MEGA_TEST_CLOCK=1), so a tiny model's request lasts as
long, relative to the limits, as a 20k-token answer does at 32B: here a request decodes for
several times `liveness_timeout_s`, as the slowest 32B request (630-900 s) outlasts the
600 s total-request timeout the trainer used to have.
"""

import os
import signal
import threading
import time
from dataclasses import dataclass

import pytest

from dapo_mega.aio import run_coroutine
from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.engines.sglang.endpoint import EngineEndpoint
from dapo_mega.rollout.manager import RolloutError, RolloutManager, RoundSettings, chunk_size

pytestmark = pytest.mark.exclusive  # its limits are what it tests: it runs alone on two workers

DELAY_MS = 100
TOKENS = 24
"""A request decodes TOKENS steps of >= DELAY_MS each: >= 2.4 s, 3x LIVENESS_S and more."""
LIVENESS_S = 0.8
PROBE_S = 0.2


@dataclass
class Prompt:
    id: str
    prompt: list

    @classmethod
    def decode(cls, plain):  # a PromptDecoding
        return cls(**plain)


@pytest.fixture(scope="module")
def slow_engines(tiny_model_dir):
    """Two embedded engines whose every forward step takes >= DELAY_MS."""
    rollout = RolloutConfig(extra_server_args=["--test-decode-delay-ms", str(DELAY_MS)], health_timeout_s=120)
    fleet = EngineFleet(rollout, str(tiny_model_dir), num_threads=1, weight_version="0",
                        extra_env={"DAPO_MEGA_TEST_CLOCK": "1"})
    fleet.start(2)
    try:
        yield fleet.engines
    finally:
        for e in fleet.engines:
            if e.alive():
                os.kill(e.pid, signal.SIGCONT)
        fleet.close()


def prompts(n, start=0):
    return [Prompt(id=f"p{start + i}", prompt=[4 + (start + i) % 20, 5]) for i in range(n)]


def manager(engines, **kw):
    kw = {"prompts_per_request": 1, "requests_per_engine": 2, "liveness_timeout_s": LIVENESS_S,
          "probe_interval_s": PROBE_S, **kw}
    return RolloutManager([EngineEndpoint(e.url) for e in engines], RoundSettings(
        n_samples=2, sampling_params={"max_new_tokens": TOKENS, "temperature": 1.0, "ignore_eos": True}, **kw))


def test_chunks_leave_no_engine_without_a_request():
    assert chunk_size(30, 32, 4) == 1           # AIME over 32 engines: one problem per request
    assert chunk_size(1536, 32, 4) == 4         # a 32B training round: the configured size
    assert chunk_size(6, 2, 4) == 3 and chunk_size(0, 2, 4) == 4


def test_slow_engine_is_not_dead_and_a_total_timeout_would_kill_it(slow_engines):
    mgr = manager(slow_engines)
    t0 = time.monotonic()
    groups = run_coroutine(mgr.generate_groups(prompts(4)))
    elapsed = time.monotonic() - t0
    latencies = [g.latency_s for g in groups]
    assert min(latencies) >= 3 * LIVENESS_S, f"requests {latencies} too short for the test's ratio"
    assert mgr.book.dead() == {} and len(groups) == 4
    assert elapsed < 60
    # the watchdog's probes also read each busy engine's /v1/loads: its KV cache at its busiest
    load = mgr.book.take_load_metrics()
    assert 0 < load["engine/kv_used_tokens_peak"] <= load["engine/kv_capacity_tokens"], load
    assert 0 < load["engine/kv_usage_peak"] <= 1 and load["engine/running_requests_peak"] >= 1, load
    assert mgr.book.take_load_metrics() == {}  # reset: the next step reports its own
    # the same work under a total-request limit of LIVENESS_S (the old rule): engines "die"
    strict = RolloutManager([EngineEndpoint(e.url, timeout_s=LIVENESS_S) for e in slow_engines], RoundSettings(
        n_samples=2, sampling_params={"max_new_tokens": TOKENS, "ignore_eos": True}, prompts_per_request=1,
        max_retries=1, liveness_timeout_s=LIVENESS_S, probe_interval_s=PROBE_S))
    with pytest.raises(RolloutError):
        run_coroutine(strict.generate_groups(prompts(2, start=50)))
    assert len(strict.book.dead()) == 2


def test_few_prompts_reach_every_engine(slow_engines):
    # 3 prompts, 4 per request and 8 requests per engine as configured: before, one engine's
    # eight workers took every chunk (an AIME eval of 8 chunks ran on engine 0 of 32)
    mgr = manager(slow_engines, prompts_per_request=4, requests_per_engine=8)
    groups = run_coroutine(mgr.generate_groups(prompts(3)))
    assert len(groups) == 3
    assert all(mgr.requests_by_engine.get(e.url, 0) >= 1 for e in slow_engines), mgr.requests_by_engine
    assert {g.engine_id for g in groups} == {e.url for e in slow_engines}


def test_hung_engine_is_found_its_prompts_move_and_it_serves_again_once_it_answers(slow_engines):
    a, b = slow_engines
    mgr = manager(slow_engines)
    stopper = threading.Timer(0.5, os.kill, args=(b.pid, signal.SIGSTOP))
    stopper.start()
    try:
        t0 = time.monotonic()
        groups = run_coroutine(mgr.generate_groups(prompts(8, start=100)))
        elapsed = time.monotonic() - t0
    finally:
        stopper.join()
    dead = mgr.book.dead()
    assert list(dead) == [b.url] and "hung" in dead[b.url] and "liveness_timeout_s" in dead[b.url], dead
    assert len(groups) == 8 and len({(g.prompt.id, s.sample_index) for g in groups for s in g.samples}) == 16
    assert elapsed < 60
    # still stopped: the probe finds it silent, it stays dead
    assert mgr.book.probe_dead(PROBE_S) == [] and b.url in mgr.book.dead()
    os.kill(b.pid, signal.SIGCONT)
    assert mgr.book.probe_dead(PROBE_S) == [b.url]
    assert mgr.book.dead() == {} and [e.url for e in mgr.book.serving()] == [a.url]  # weights first
    mgr.book.serve_again([b.url])
    groups = run_coroutine(mgr.generate_groups(prompts(4, start=200)))
    assert {g.engine_id for g in groups} == {a.url, b.url}
