"""Pipeline stages sync their weights in turn.

Each engine serves weight-update requests in arrival order, and each pipeline stage's source
broadcasts on its own group. The simulation below is that protocol with threads: an engine
takes the next request from its FIFO and joins that stage's broadcast (a barrier of the
stage's source and every engine). When two stages send at once and the requests reach the
two engines in different orders, engine A waits in stage 0's broadcast for engine B, which
waits in stage 1's for engine A: a deadlock (seen here as a broken barrier after a timeout).
`run_stages_in_turn`, which `sync_learner_weights` uses, lets stage s+1 start only after
stage s finished on every engine, so the same adversarial arrival order cannot arise.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Dict, List

import pytest

from dapo_mega.weights.sync import run_stages_in_turn

TIMEOUT_S = 1.5


class _Protocol:
    """Two engines with FIFO request queues and one broadcast barrier per stage."""

    def __init__(self, num_stages: int, engines=("A", "B")):
        self.engines = list(engines)
        self.queues: Dict[str, "queue.Queue"] = {e: queue.Queue() for e in self.engines}
        self.broadcasts = [threading.Barrier(1 + len(self.engines), timeout=TIMEOUT_S) for _ in range(num_stages)]
        self.log: List[tuple] = []
        self.failures: List[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._serve, args=(e,), daemon=True) for e in self.engines]
        for t in self.threads:
            t.start()

    def _serve(self, engine: str) -> None:
        while True:
            stage = self.queues[engine].get()
            if stage is None:
                return
            try:
                self.broadcasts[stage].wait()
                with self.lock:
                    self.log.append((engine, stage))
            except threading.BrokenBarrierError:
                self.failures.append(f"engine {engine} stuck in stage {stage}'s broadcast")
                return

    def send(self, stage: int, order: List[str], gap_s: float = 0.0) -> None:
        """A stage's source: POST to each engine (in `order`), then join the broadcast."""
        for engine in order:
            self.queues[engine].put(stage)
            time.sleep(gap_s)
        try:
            self.broadcasts[stage].wait()
        except threading.BrokenBarrierError:
            self.failures.append(f"stage {stage}'s source stuck in its broadcast")

    def close(self) -> None:
        for q in self.queues.values():
            q.put(None)
        for t in self.threads:
            t.join(timeout=TIMEOUT_S * 2)


def _run_sources(protocol: _Protocol, in_turn: bool) -> None:
    """Stage 0 reaches engine A first, stage 1 reaches engine B first (the adversarial order)."""
    orders = {0: ["A", "B"], 1: ["B", "A"]}
    barrier = threading.Barrier(2, timeout=TIMEOUT_S * 4)  # the learners' default group

    def rank(stage: int) -> None:
        send = lambda: protocol.send(stage, orders[stage], gap_s=0.05)  # noqa: E731
        if in_turn:
            run_stages_in_turn(2, stage, send, barrier.wait)
        else:  # the code before the fix: every stage's source sends at once
            send()

    threads = [threading.Thread(target=rank, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT_S * 8)


def test_concurrent_stages_deadlock_two_engines():
    protocol = _Protocol(num_stages=2)
    try:
        _run_sources(protocol, in_turn=False)
    finally:
        protocol.close()
    assert protocol.failures, "stages sending at once should deadlock on this arrival order"


def test_stages_in_turn_finish_in_stage_order_on_every_engine():
    protocol = _Protocol(num_stages=2)
    try:
        _run_sources(protocol, in_turn=True)
    finally:
        protocol.close()
    assert protocol.failures == []
    for engine in protocol.engines:
        assert [s for e, s in protocol.log if e == engine] == [0, 1]
    # every engine left stage 0 before any entered stage 1
    first_stage1 = min(i for i, (_, s) in enumerate(protocol.log) if s == 1)
    assert all(s == 0 for _, s in protocol.log[:first_stage1]) and first_stage1 == 2


@pytest.mark.parametrize("num_stages", [1, 3, 4])
def test_each_rank_sends_once_in_its_turn_and_gets_its_result(num_stages):
    barrier = threading.Barrier(num_stages, timeout=10)
    spans: Dict[int, tuple] = {}
    results: Dict[int, object] = {}

    def rank(stage: int) -> None:
        def send():
            start = time.monotonic()
            time.sleep(0.02)
            spans[stage] = (start, time.monotonic())
            return f"stats of stage {stage}"
        results[stage] = run_stages_in_turn(num_stages, stage, send, barrier.wait)

    threads = [threading.Thread(target=rank, args=(s,)) for s in range(num_stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results == {s: f"stats of stage {s}" for s in range(num_stages)}
    for s in range(1, num_stages):
        assert spans[s - 1][1] <= spans[s][0], "stage s+1 started before stage s finished"
