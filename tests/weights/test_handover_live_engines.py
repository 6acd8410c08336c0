"""Colocated hand-over with engines found dead: payloads only for live engines (a CUDA IPC
payload nobody unpickles keeps its block in IPC limbo), engines answering again take part
again, and a dropped engine that still holds its GPU memory stops the run, named."""

from __future__ import annotations

import os
import signal

import pytest

from dapo_mega.weights.handover import (
    GONE,
    HUNG,
    RELEASED,
    HandoverPlan,
    HungEngineError,
    probe_dropped_engine,
    require_dropped_engines_released,
)

# two TP-2 engines over four learner ranks; rank 1 holds engine 0's TP rank 1 and engine 1's TP rank 0
IPC = {0: (0, 1), 1: (1, 2)}


def _counting_maker(made):
    def make(views):
        made.append(views)
        return f"payload-{len(made)}", lambda: None
    return make


def test_payloads_are_made_for_live_engines_only_and_again_once_readmitted():
    plan = HandoverPlan.for_rank(1, IPC)
    assert plan.holds == [(0, 1), (1, 0)] and plan.posts == [1]
    made = []
    payloads, cleanups = plan.make_payloads([("w", None)], _counting_maker(made))
    assert sorted(payloads) == [(0, 1), (1, 0)] and len(made) == len(cleanups) == 2

    plan.drop([1])  # engine 1 found dead: no payload for its TP rank 0, nothing posted for it
    made.clear()
    payloads, cleanups = plan.make_payloads([("w", None)], _counting_maker(made))
    assert sorted(payloads) == [(0, 1)] and len(made) == len(cleanups) == 1
    assert plan.live_posts() == []

    plan.readmit([1])
    payloads, _ = plan.make_payloads([("w", None)], _counting_maker(made))
    assert sorted(payloads) == [(0, 1), (1, 0)] and plan.live_posts() == [1]
    # the live engine's request still finds every TP rank's payload
    gathered = [{(0, 0): "a"}, {(0, 1): "b", (1, 0): "c"}, {(1, 1): "d"}]
    assert plan.request_payloads(gathered, 1) == ["c", "d"]


def test_a_dropped_engine_that_still_holds_its_memory_stops_the_run_named():
    gpus = {"http://n1:30001": [2, 3], "http://n1:30000": [0, 1]}
    require_dropped_engines_released({"http://n1:30000": GONE, "http://n1:30001": RELEASED}, gpus)
    with pytest.raises(HungEngineError) as info:
        require_dropped_engines_released({"http://n1:30000": GONE, "http://n1:30001": HUNG}, gpus)
    message = str(info.value)
    assert "http://n1:30001 (GPUs [2, 3])" in message and "30000" not in message
    assert "run out of memory" in message and "kill the engine" in message


@pytest.mark.slow  # one engine start: ~10-20 s here
def test_probe_tells_a_released_a_hung_and_a_gone_engine(tiny_model_dir):
    from dapo_mega.config import RolloutConfig
    from dapo_mega.engines.fleet import EngineFleet

    with EngineFleet(RolloutConfig(), str(tiny_model_dir), num_threads=1) as fleet:
        fleet.start(1)
        engine = fleet.engines[0]
        assert probe_dropped_engine(engine.endpoint, timeout_s=5) == RELEASED
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            assert probe_dropped_engine(engine.endpoint, timeout_s=2) == HUNG
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        os.kill(engine.pid, signal.SIGKILL)
        engine.proc.wait(timeout=30)
        assert probe_dropped_engine(engine.endpoint, timeout_s=2) == GONE
