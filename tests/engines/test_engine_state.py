"""The embedded engine answers a request only after its own state says the request finished.

Each test gives the engine sequences whose `on_done` (the reply) looks at the engine at once,
as a client that flushes the moment its aborted reply arrives: the window between the reply
and the clean-up is as wide as it can be, and whatever the engine reports then (`load`,
`flush_cache`, `is_idle`) must already leave the answered sequence out. Every way a sequence
ends is tried: its own length, an abort by rid, abort-all, a pause in mode abort, a shutdown
and an engine error (issue #40: a flush after an aborted reply was refused as if paused
in_place).
"""

import threading
import time

import pytest
import torch

from dapo_mega.engines.embedded.engine import GenerationEngine
from dapo_mega.engines.embedded.sampling import SamplingSpec, Sequence_


@pytest.fixture
def engine(tiny_model_dir):
    eng = GenerationEngine(str(tiny_model_dir), batch_wait_s=0.0, decode_delay_s=0.02)
    yield eng
    eng.shutdown()


class Replies:
    """Sequences whose reply records what the engine reports at that moment."""

    def __init__(self, engine: GenerationEngine):
        self.engine = engine
        self.seen = {}
        self.done = threading.Event()
        self.expected = 0

    def seq(self, rid: str, max_new_tokens: int = 200) -> Sequence_:
        self.expected += 1

        def on_done(seq: Sequence_) -> None:
            running, waiting = self.engine.load()
            self.seen[seq.rid] = {"reason": seq.finish_reason["type"], "running": running, "waiting": waiting,
                                  "flushed": self.engine.flush_cache(), "idle": self.engine.is_idle()}
            if len(self.seen) == self.expected:
                self.done.set()

        return Sequence_(prompt_ids=[4, 5, 6], spec=SamplingSpec(max_new_tokens=max_new_tokens, ignore_eos=True),
                         on_done=on_done, generator=torch.Generator().manual_seed(0), rid=rid)

    def wait(self, timeout_s: float = 60.0) -> dict:
        assert self.done.wait(timeout_s), f"answered {sorted(self.seen)} of {self.expected} requests"
        return self.seen


def wait_running(engine: GenerationEngine, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.load()[0] < n or engine.num_generated_tokens == 0:
        assert time.monotonic() < deadline, f"engine load {engine.load()}, wanted {n} running"
        time.sleep(0.005)


def test_a_request_that_ran_out_of_length_is_gone_when_it_is_answered(engine):
    replies = Replies(engine)
    assert engine.submit([replies.seq("a", max_new_tokens=3)])
    seen = replies.wait()["a"]
    assert seen == {"reason": "length", "running": 0, "waiting": 0, "flushed": True, "idle": True}


def test_abort_by_rid_answers_after_the_row_left_the_batch(engine):
    replies = Replies(engine)
    assert engine.submit([replies.seq("keep", max_new_tokens=60), replies.seq("drop")])
    wait_running(engine, 2)
    engine.abort(rid="drop")
    seen = replies.wait()
    assert seen["drop"]["reason"] == "abort" and seen["drop"]["running"] == 1, seen
    assert not seen["drop"]["flushed"]  # "keep" still holds the cache: SGLang refuses too
    assert seen["keep"] == {"reason": "length", "running": 0, "waiting": 0, "flushed": True, "idle": True}


def test_abort_all_of_running_and_queued_requests(tiny_model_dir):
    engine = GenerationEngine(str(tiny_model_dir), batch_wait_s=0.0, decode_delay_s=0.02, max_running_requests=1)
    try:
        replies = Replies(engine)
        assert engine.submit([replies.seq("running"), replies.seq("queued")])
        wait_running(engine, 1)
        engine.abort(abort_all=True)
        seen = replies.wait()
        # the queued one is answered first, at once; the running one after its step
        assert seen["queued"]["reason"] == "abort" and seen["queued"]["waiting"] == 0
        assert seen["running"] == {"reason": "abort", "running": 0, "waiting": 0, "flushed": True, "idle": True}
    finally:
        engine.shutdown()


def test_pause_abort_returns_after_every_request_is_answered_and_the_cache_flushes(engine):
    """The trainer's order: pause (abort), read the aborted replies, flush. SGLang's pause in
    mode abort returns only once no request is in flight; a sleep after each forward step
    (decode_delay_s) keeps the running row unfinished after the step lock is free."""
    replies = Replies(engine)
    assert engine.submit([replies.seq("a"), replies.seq("b")])
    wait_running(engine, 2)
    engine.pause("abort")
    assert sorted(replies.seen) == ["a", "b"], "pause(abort) returned before its requests were answered"
    for seen in replies.seen.values():
        assert seen["reason"] == "abort"
    assert replies.seen["a"]["flushed"] or replies.seen["b"]["flushed"]
    last = max(replies.seen.values(), key=lambda s: -s["running"])
    assert last == {"reason": "abort", "running": 0, "waiting": 0, "flushed": True, "idle": True}
    assert engine.flush_cache() and engine.load() == (0, 0)
    engine.resume()


def test_shutdown_answers_running_and_queued_requests_as_aborted(tiny_model_dir):
    engine = GenerationEngine(str(tiny_model_dir), batch_wait_s=0.0, decode_delay_s=0.02, max_running_requests=1)
    replies = Replies(engine)
    assert engine.submit([replies.seq("running"), replies.seq("queued")])
    wait_running(engine, 1)
    engine.shutdown()
    seen = replies.wait()
    assert {s["reason"] for s in seen.values()} == {"abort"}
    assert seen["running"]["running"] == 0 and seen["running"]["flushed"]


def test_an_engine_error_answers_every_row_including_those_that_joined_the_batch(engine):
    """A forward that raises ends every sequence of the batch, also the one admitted into the
    running batch after it started (it is not in the batch the thread took): none hangs."""
    replies = Replies(engine)
    assert engine.submit([replies.seq("first")])
    wait_running(engine, 1)
    forward_decode = engine.runner.forward_decode
    calls = []

    def failing_decode(rows, cache, mask):
        calls.append(len(rows))
        if len(rows) == 2:  # "joined" was admitted into the batch "first" started
            raise RuntimeError("device lost")
        return forward_decode(rows, cache, mask)

    engine.runner.forward_decode = failing_decode
    assert engine.submit([replies.seq("joined")])
    seen = replies.wait(timeout_s=30)
    assert calls[-1] == 2, f"the second request never joined the running batch: {calls}"
    for rid in ("first", "joined"):
        assert seen[rid]["reason"] == "abort", seen
    assert engine.load() == (0, 0) and engine.flush_cache()
