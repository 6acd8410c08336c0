"""Multi-turn rounds in the recipe's shape (issue #46): tools at the environment's width, a
stop that reaches every chunk, no tool call lost to a stop, progress while a chunk works.

On one embedded engine slowed to DELAY_MS a forward step (`--test-decode-delay-ms`), with a
test environment whose turns end at their first character (its stop strings are every
character of the tiny model) and whose step sleeps `tool_s`: the tools, not the tiny model,
take a round's time, as the python tool's 30 s runs do beside a 32B engine. Each limit is
tested with work that exceeds it: 48 calls where asyncio's pool would run 6, a chunk several
stall timeouts long, a request that reaches its engine after the first abort.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import pytest

from dapo_mega.aio import run_coroutine
from dapo_mega.config import DataConfig, RolloutConfig, load_config
from dapo_mega.data import PromptEncoder
from dapo_mega.data.problem import Problem
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.engines.sglang.client import EngineClient, SampleResult
from dapo_mega.environments.base import Environment, StepResult
from dapo_mega.models.tiny import CHARACTERS
from dapo_mega.rollout.manager import RolloutManager, RoundSettings
from dapo_mega.rollout.metrics import compute_rollout_metrics
from dapo_mega.rollout.partial import PartialGroup
from dapo_mega.rollout.samples import Group, ScoredSample

pytestmark = pytest.mark.exclusive  # its limits are what it tests: it runs alone on two workers

DELAY_MS = 10
LONG = 200
"""A sample that never stops decodes LONG steps of >= DELAY_MS: >= 2 s."""


@dataclass
class Meter:
    """What the episodes of one environment share (an episode is a shallow copy of it)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    running: int = 0
    peak: int = 0
    """Steps running at once, at most."""
    calls: List[str] = field(default_factory=list)
    """Per step, the prompt id of its sample."""
    spans: List[tuple] = field(default_factory=list)
    """Per step: (prompt id, start, end) on the monotonic clock."""
    on_step: Optional[Callable[[], None]] = None


class SlowTool(Environment):
    """A turn ends at its first character; each step sleeps `tool_s` (or, a dict, the seconds of
    the sample's prompt id) and answers `<turn>`; the episode ends after `done_after` steps (of
    this episode: a resumed sample's is a fresh one), else at rollout.max_turns."""

    stop = list(CHARACTERS)

    def __init__(self, tool_s, done_after: int = 1000):
        self.tool_s, self.done_after, self.meter = tool_s, done_after, Meter()

    def reset(self, problem):
        self.problem_id, self.turn = problem.id, 0

    def step(self, model_text: str) -> StepResult:
        m, self.turn = self.meter, self.turn + 1
        with m.lock:
            m.running += 1
            m.peak = max(m.peak, m.running)
            m.calls.append(self.problem_id)
        if m.on_step is not None:
            m.on_step()
        seconds = self.tool_s[self.problem_id] if isinstance(self.tool_s, dict) else self.tool_s
        t0 = time.monotonic()
        try:
            time.sleep(seconds)
        finally:
            with m.lock:
                m.running -= 1
                m.spans.append((self.problem_id, t0, time.monotonic()))
        return StepResult(observation=f"<{self.turn}>", done=self.turn >= self.done_after, tool_calls=1,
                          tool_time_s=seconds)


@dataclass(frozen=True)
class OnlyFirstStops(RoundSettings):
    """The first prompt's turns stop at their first character; the others' never stop (no stop
    strings): they decode their whole budget."""

    def params_for(self, prompts, step, gen_round):
        return [{**self.sampling_params, **({} if p.id == "t0" else {"stop": []})} for p in prompts]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    rollout = RolloutConfig(extra_server_args=["--test-decode-delay-ms", str(DELAY_MS)], health_timeout_s=120)
    fleet = EngineFleet(rollout, str(tiny_model_dir), num_threads=1, weight_version="0",
                        extra_env={"DAPO_MEGA_TEST_CLOCK": "1"})
    fleet.start(1)
    try:
        yield fleet.endpoints, PromptEncoder.from_pretrained(tiny_model_dir, DataConfig(prompt_template="raw"))
    finally:
        fleet.close()


def problems(n):
    return [Problem(id=f"t{i}", prompt=f"{i}+{i}=", ground_truth=str(2 * i), data_source="test") for i in range(n)]


def manager(engine, env, cls=RoundSettings, **kw):
    endpoints, encoder = engine
    kw = {"n_samples": 2, "sampling_params": {"max_new_tokens": LONG, "temperature": 1.0, "ignore_eos": True},
          "environment": env, "max_turns": 8, "prompts_per_request": 4, "requests_per_engine": 1,
          "partial_rollout": True, **kw}
    return RolloutManager(endpoints, cls(**kw), encoder)


async def run_round(mgr, prompts, partials=None, stop_when=None, watch=None):
    """The Round of `prompts` (resuming `partials`), run to its end; `stop_when(rnd)`, awaited
    once a request is in flight, then stops it; `watch(rnd)` runs beside it until it ends."""
    async with mgr.round(prompts, 0, partials) as rnd:
        async def stopper():
            while not any(rnd.dog.in_flight.values()):
                await asyncio.sleep(0.005)
            await stop_when(rnd)
            rnd.stop()

        helpers = [asyncio.ensure_future(f) for f in ([stopper()] if stop_when else []) + ([watch(rnd)] if watch else [])]
        async for _ in rnd:
            pass
    for h in helpers:
        h.cancel()
    await asyncio.gather(*helpers, return_exceptions=True)
    return rnd


def tool_threads():
    return [t for t in threading.enumerate() if t.name.startswith("dapo-mega-tool")]


def test_tool_calls_run_as_many_at_once_as_the_environment_allows(engine):
    """48 samples stop at a tool call together: the 48 calls run at once (asyncio's default
    pool runs min(32, cores + 4): 6 here, 32 on a GPU node), in threads of the round's own
    executor, gone when the round ends."""
    env, slots = SlowTool(tool_s=0.5, done_after=1), 48
    mgr = manager(engine, env, n_samples=slots, tool_slots=slots)
    rnd = run_coroutine(run_round(mgr, problems(1)))
    assert [s.tool_calls for s in rnd.outcome.groups[0].samples] == [1] * slots
    assert env.meter.peak == slots, f"{env.meter.peak} tool calls at once, not {slots}"
    deadline = time.monotonic() + 5
    while tool_threads() and time.monotonic() < deadline:  # the round is still referenced: shut down, not collected
        time.sleep(0.05)
    assert tool_threads() == []


def test_each_sample_goes_on_as_its_own_tool_answers_not_at_the_slowest_of_its_chunk(engine):
    """Issue #47 item 1: one chunk, two samples; t0's tool takes 1.2 s a call, t1's 0.02 s.
    t1's episode makes its three calls and its turns between them while t0's first call still
    runs (lock-step turns would hold each of t1's turns until t0's call ended)."""
    env = SlowTool(tool_s={"t0": 1.2, "t1": 0.02}, done_after=3)
    mgr = manager(engine, env, n_samples=1, prompts_per_request=2)
    rnd = run_coroutine(run_round(mgr, problems(2)))
    assert rnd.outcome.requests_by_engine == {engine[0][0].url: 1}, "one chunk: both samples in one request"
    assert [[s.tool_calls, s.turns] for g in (rnd.outcome.groups[0], rnd.outcome.groups[1]) for s in g.samples] == \
        [[3, 3], [3, 3]]
    slow_first_end = min(end for pid, _, end in env.meter.spans if pid == "t0")
    fast = sorted(span for span in env.meter.spans if span[0] == "t1")
    assert len(fast) == 3 and all(end < slow_first_end for _, _, end in fast), env.meter.spans


def test_the_executor_has_the_slots_the_plan_counts():
    from dapo_mega.plan.clock import ClockAssumptions, tool_load

    for kwargs, slots in (([], 4), (["+rollout.environment_kwargs.max_concurrent=192"], 192)):
        cfg = load_config(["rollout.environment=python", *kwargs])
        assert RoundSettings.for_purpose(cfg, "train").tool_slots == slots
        assert tool_load(cfg, ClockAssumptions())["tool_slots"] == slots


def test_a_sample_stopped_at_a_tool_call_stays_open_and_runs_its_tool_on_resume(engine):
    """t0's samples end their first turn at the stop string while t1's (one request with them)
    still decode; the round stops: t1's are aborted, t0's wait for their tool. Both stay open;
    on resume t0's tool runs first, then the model goes on. None is closed with its call
    unmade (today's code closed t0's as answered)."""
    env = SlowTool(tool_s=0.0)
    mgr = manager(engine, env, cls=OnlyFirstStops, max_turns=2)

    async def soon(rnd):
        await asyncio.sleep(0.4)  # t0's samples stopped after a character; t1's decode for >= 2 s

    out = run_coroutine(run_round(mgr, problems(2), stop_when=soon)).outcome
    assert out.stopped and out.groups == {} and sorted(out.partials) == [0, 1]
    waiting, cut = out.partials[0], out.partials[1]
    assert waiting.open == [0, 1] and all(s.tool_pending and s.tool_calls == 0 for s in waiting.group.samples)
    assert cut.open == [0, 1] and not any(s.tool_pending for s in cut.group.samples)
    assert env.meter.calls == []
    first_turn = [len(s.token_ids) for s in waiting.group.samples]

    out = run_coroutine(run_round(mgr, problems(2), partials=out.partials)).outcome
    t0, t1 = out.groups[0], out.groups[1]
    assert env.meter.calls.count("t0") == 2 and "t1" not in env.meter.calls
    for s, before in zip(t0.samples, first_turn):
        assert s.tool_calls == 1 and s.turns == 2 and s.env_spans[0][0] == before, (s.env_spans, before)
    assert all(len(s.token_ids) == LONG and s.tool_calls == 0 for s in t1.samples)
    samples = [s for g in (t0, t1) for s in g.samples]
    assert compute_rollout_metrics(samples, 1.0, multi_turn=True)["rollout/closed_with_pending_tool"] == 0


def test_a_stop_between_turns_sends_no_new_turn_and_the_sample_resumes(engine):
    """The round stops while the tools of a chunk's first turn run: their answers are kept and
    no further turn is sent (today's code sent it and ran the episode to its end); the samples
    stay partials and resume with the model's next turn."""
    env = SlowTool(tool_s=0.3)
    mgr = manager(engine, env, max_turns=3)

    async def stop_at_first_tool(rnd):
        loop = asyncio.get_running_loop()
        env.meter.on_step = lambda: loop.call_soon_threadsafe(rnd.stop)
        await asyncio.Event().wait()  # the environment stops the round

    out = run_coroutine(run_round(mgr, problems(1), stop_when=stop_at_first_tool)).outcome
    env.meter.on_step = None
    assert out.stopped and out.groups == {} and list(out.partials) == [0], (out.groups, out.partials)
    pg = out.partials[0]
    assert pg.open == [0, 1] and len(env.meter.calls) == 2
    for s in pg.group.samples:  # the tool's answer last: the next turn counted, none of its tokens
        assert s.tool_calls == 1 and s.turns == 2 and not s.tool_pending and s.env_spans[-1][1] == len(s.token_ids)

    out = run_coroutine(run_round(mgr, problems(1), partials=out.partials)).outcome
    assert all(s.turns == 3 and s.tool_calls == 2 for s in out.groups[0].samples)
    assert len(env.meter.calls) == 4


def test_a_request_that_reaches_its_engine_after_the_abort_is_aborted_again(engine, monkeypatch):
    """Each request is 0.3 s on its way; the round stops as they leave: the first abort_all
    finds the engine empty, and the requests would then decode their whole budget (>= 2 s).
    The abort is repeated while the round's requests run, so they are cut within a second."""
    send = EngineClient.generate

    async def late(self, *args, **kwargs):
        await asyncio.sleep(0.3)
        return await send(self, *args, **kwargs)

    monkeypatch.setattr(EngineClient, "generate", late)
    mgr = manager(engine, None, prompts_per_request=1, requests_per_engine=2, sampling_params={
        "max_new_tokens": LONG, "temperature": 1.0, "ignore_eos": True})
    stopped = []

    async def at_once(rnd):
        while sum(rnd.dog.in_flight.values()) < 2:  # both requests on their way
            await asyncio.sleep(0.001)
        stopped.append(time.monotonic())

    out = run_coroutine(run_round(mgr, problems(2), stop_when=at_once)).outcome
    elapsed = time.monotonic() - stopped[0]
    assert out.groups == {} and out.aborted_requests == 2, (sorted(out.groups), out.failures)
    assert all(0 < len(s.token_ids) < LONG for pg in out.partials.values() for s in pg.group.samples)
    assert elapsed < 1.5, elapsed


def test_a_long_multi_turn_chunk_shows_progress_at_every_turn_and_tool_call(engine):
    """One chunk of six tool turns (0.25 s each) lasts twice STALL_S: the driver's progress
    counter (EngineBook.finished_requests, what its stall timer reads) and the watchdog's last
    progress move at each request and tool call, never STALL_S apart (today: once, at the
    chunk's end). Probes are set apart beyond the test so that they do not hide it."""
    stall_s, env = 0.75, SlowTool(tool_s=0.25, done_after=6)
    mgr = manager(engine, env, probe_interval_s=60.0, liveness_timeout_s=60.0)
    url = mgr.book.urls[0]
    seen = {"gap": 0.0, "silence": 0.0}

    async def watch(rnd):
        count, at = mgr.book.finished_requests(), time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            if mgr.book.finished_requests() != count:
                count, at = mgr.book.finished_requests(), now
            seen["gap"] = max(seen["gap"], now - at)
            if rnd.dog.in_flight[url] > 0:
                seen["silence"] = max(seen["silence"], now - rnd.dog.last_progress[url])

    t0 = time.monotonic()
    out = run_coroutine(run_round(mgr, problems(1), watch=watch)).outcome
    took = time.monotonic() - t0
    assert all(s.tool_calls == 6 for s in out.groups[0].samples)
    assert took > 1.5 * stall_s, f"the chunk ({took:.2f} s) must outlast the stall timeout for the test to hold"
    assert seen["gap"] < stall_s and seen["silence"] < stall_s, seen


# ------------------------------------------------------------------------------ pure


def _reply(tokens, reason):
    return SampleResult(prompt_index=0, sample_index=0, text="".join(chr(t) for t in tokens), output_ids=list(tokens),
                        token_ids=list(tokens), finish_reason=reason, logprobs=[-0.5] * len(tokens),
                        weight_versions=[{"version": "1", "start": 0, "end": len(tokens)}], prompt_tokens=2,
                        completion_tokens=len(tokens))


def test_a_continuation_cut_by_the_stop_keeps_open_both_the_aborted_and_the_stopped():
    """The turns of two samples answer as the round stops: one was aborted mid-turn, the other
    had just stopped at a tool call. Both stay open; the second's tool is pending."""
    from dapo_mega.rollout.turns import Episodes

    class Chars:
        encode_text = staticmethod(lambda text: [ord(c) for c in text])

    env = SlowTool(tool_s=0.0, done_after=5)
    env.stop = ["a"]
    samples = [ScoredSample(prompt_id="t0", sample_index=j, token_ids=[97], logprobs=[-1.0], weight_versions=[],
                            response_text="a", truncated=False, seed=None, engine_id="e", queue_delay_s=0.0,
                            generation_latency_s=0.0) for j in range(2)]
    group = Group(prompt=problems(1)[0], prompt_input=[1, 2], samples=samples, engine_id="e", queue_delay_s=0.0,
                  latency_s=0.0)
    stopped = _reply([97], {"type": "stop", "matched": "a"})
    episodes = Episodes(env, Chars(), 4, [PartialGroup(group, [], 40)], {(0, 0): stopped, (0, 1): stopped},
                        [{"n": 2, "max_new_tokens": 40}], 40)
    async def answer():
        return [st for st in episodes.pending() if await episodes.answer(st)]

    going = run_coroutine(answer())
    assert len(going) == 2
    for st in going:
        episodes.next_turn(st)
    assert not episodes.take(going[0], _reply([98, 99], {"type": "abort"}), "e", 0.1)
    assert episodes.take(going[1], _reply([98, 97], {"type": "stop", "matched": "a"}), "e", 0.1)
    (pg,) = episodes.partial_groups()
    assert pg.open == [0, 1] and [s.tool_pending for s in pg.group.samples] == [False, True]
    assert pg.to_generate == [0]
    metrics = compute_rollout_metrics(pg.group.samples, 1.0, multi_turn=True)
    assert metrics["rollout/closed_with_pending_tool"] == 1  # what closing them now would lose
