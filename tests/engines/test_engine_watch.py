"""The Slurm engines role's watch (`engines/watch.py`): an engine that exits is
restarted at its port and announced again, at most `rollout.engine_restarts` times; one exit
more ends the role with that exit's status, saying so."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from dapo_mega.config import ConfigError, DapoConfig, RolloutConfig, validate_config
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.engines.sglang.client import EngineClient
from dapo_mega.engines.watch import EngineWatch, RestartBudget, exit_status


def test_the_budget_counts_restarts_per_engine():
    budget = RestartBudget(max_restarts=2)
    assert [budget.take(0), budget.take(1), budget.take(0), budget.take(0), budget.take(1)] == \
        [True, True, True, False, True]
    assert budget.spent(0) == 2 and budget.spent(1) == 2 and not budget.take(1)
    assert not RestartBudget(0).take(3)


def test_exit_status_is_the_shells():
    assert (exit_status(-9), exit_status(3), exit_status(0), exit_status(None)) == (137, 3, 1, 1)


def test_engine_restarts_below_zero_is_refused_naming_the_field():
    cfg = DapoConfig()
    cfg.rollout.engine_restarts = -1
    with pytest.raises(ConfigError, match="rollout.engine_restarts"):
        validate_config(cfg)


async def _generate_one(url):
    async with EngineClient(url) as client:
        out = await client.generate([[4, 5, 6]], {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    return out[0].token_ids


@pytest.mark.slow  # two engine starts and a restart: ~20-40 s here
def test_a_killed_engine_comes_back_at_its_url_then_the_role_ends_past_its_restarts(tiny_model_dir):
    announced, lines = [], []
    with EngineFleet(RolloutConfig(), str(tiny_model_dir), num_threads=1) as fleet:
        fleet.start(1)
        first = fleet.engines[0]
        url, old_pid = first.url, first.pid
        watch = EngineWatch(fleet, RolloutConfig(engine_restarts=1), on_healthy=announced.append, say=lines.append)
        assert watch.check() is None and not lines  # nothing exited: nothing to do

        os.kill(old_pid, signal.SIGKILL)
        first.proc.wait(timeout=30)
        assert watch.check() is None
        again = fleet.engines[0]
        assert again.url == url and again.pid != old_pid and again.alive()
        assert announced == [again] and watch.restarts == [0]
        assert "exited with signal 9; restarting it at its port" in lines[0] and "restart 1 of 1" in lines[0]
        assert len(asyncio.run(_generate_one(url))) == 2  # it serves at the URL the trainer knows

        os.kill(again.pid, signal.SIGKILL)
        again.proc.wait(timeout=30)
        assert watch.check() == 137
        assert "restarted 1 time(s) in this job, the most rollout.engine_restarts=1 allows" in lines[-1]
        assert announced == [again]  # no second restart


def test_with_a_window_only_the_recent_restarts_count():
    """rollout.engine_restart_window_s: 2 restarts per hour. Two crashes a minute apart use
    them up (a crash loop still ends the job); two more hours later are allowed again."""
    now = [0.0]
    rollout = RolloutConfig(engine_restarts=2, engine_restart_window_s=3600)
    budget = RestartBudget.from_config(rollout)
    budget.clock = lambda: now[0]
    taken = []
    for t in (0, 60, 120, 3610, 3620, 7300):
        now[0] = float(t)
        taken.append(budget.take(0))
    # at 120 s two restarts are within the hour; at 3610 s the one of 0 s has left it; at 3620 s
    # the ones of 60 and 3610 s count; at 7300 s none does
    assert taken == [True, True, False, True, False, True]
    assert budget.scope == "in the last 3600 s" and RestartBudget(2).scope == "in this job"
    whole_job = RestartBudget.from_config(RolloutConfig(engine_restarts=2))
    assert [whole_job.take(0) for _ in range(3)] == [True, True, False]
    cfg = DapoConfig()
    cfg.rollout.engine_restart_window_s = -1
    with pytest.raises(ConfigError, match="rollout.engine_restart_window_s"):
        validate_config(cfg)
