"""Rollout engines dying or hanging inside a real `dapo-mega train` run with 3 engines.

Engine 1 is SIGKILLed just before its first /generate request of step 2 (connection
refused); engine 2 is SIGSTOPped just before its first request of step 3 (it accepts the
connection and never answers /generate nor /health, so only the rollout manager's liveness
probes can tell: after `rollout.liveness_timeout_s` without an answer). Each time the
rollout manager marks the engine dead, its prompts go to the live engines, the step
completes, and the engine leaves the weight sync (colocated: shared-memory buckets per
engine), so later steps run on what is left. (The manager alone, without a trainer, is
tested in test_rollout_manager.py.)
"""

from __future__ import annotations

import re

import pytest
from test_faults_common import read_metric_rows, run_trainer

from dapo_mega.records.ledger import read_records

LIVENESS_TIMEOUT_S = 15.0
PROBE_S = 2.0


def test_engine_killed_then_engine_hung_run_completes_on_the_rest_and_the_hung_one_returns(tmp_path):
    result = run_trainer(tmp_path, "engines", [
        "trainer.total_steps=5", "trainer.save_interval=0", "rollout.num_engines=3",
        f"rollout.liveness_timeout_s={LIVENESS_TIMEOUT_S}", f"rollout.liveness_probe_interval_s={PROBE_S}",
        "rollout.max_retries=3",
        # 9 requests of 4 prompts per step: more than one engine's 8 request slots, so the
        # faulty engine surely takes one while the fault holds the others' first requests
        "algo.n_samples_per_prompt=2", "algo.train_batch_size=36", "algo.gen_batch_size=36", "algo.mini_batch_size=18",
    ], faults=["engine:KILL:1:2", "engine:STOP:2:3", "engine:CONT:2:4"], timeout_s=400)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert "SIGKILL to engine 1" in out and "SIGSTOP to engine 2" in out and "SIGCONT to engine 2" in out
    run_dir = tmp_path / "engines"
    rows = read_metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # engine 2, continued during step 4, answers the probe before step 4's sync: it gets those
    # weights and serves step 5 (the killed engine 1 never answers again)
    assert [r["rollout/dead_engines"] for r in rows] == [0, 1, 2, 2, 1]
    assert [r["sync/engines"] for r in rows] == [3, 2, 1, 2, 2]
    assert sum("answers again" in line for line in out.splitlines()) == 1
    # The hang is noticed after liveness_timeout_s, not never (bounded; slack for a busy machine).
    assert LIVENESS_TIMEOUT_S <= rows[2]["time/rollout_s"] < LIVENESS_TIMEOUT_S + 90
    dropped = [line for line in out.splitlines() if "dropped from rollouts and weight sync" in line]
    assert len(dropped) == 2, dropped

    urls = {}
    for r in read_records(run_dir):
        urls.setdefault(r.step, set()).add(r.engine_id)
    killed = re.search(r"SIGKILL to engine 1 \((\S+)\)", out).group(1)
    stopped = re.search(r"SIGSTOP to engine 2 \((\S+)\)", out).group(1)
    # no sample of a step comes from an engine that failed in it or before
    assert killed not in urls[2] | urls[3] | urls[4] | urls[5] and stopped not in urls[3] | urls[4]
    assert len(urls[3]) == 1 and urls[4] == urls[3]
    assert urls[5] == urls[4] | {stopped}      # back in the rollouts once it holds the weights
    for step in (1, 2, 3, 4, 5):
        recs = read_records(run_dir, steps=[step])
        keys = [(r.prompt_id, r.sample_index) for r in recs]
        assert len(keys) == len(set(keys)) == 72, f"step {step}: a sample lost or repeated"
        # the survivors got every sync: samples of step s come from policy version s-1
        assert {r.policy_version_min for r in recs} == {step - 1}


def test_engine_killed_in_a_disaggregated_run_leaves_the_weight_update_group(tmp_path):
    """Disaggregated (weights broadcast over a weight-update group of the learner and both
    engines): engine 1 is SIGKILLed before its first request of step 2. Its prompts go to
    engine 0, and before the next sync the learner leaves the group (on engine 0 too) and forms
    a new one with engine 0 alone, so later broadcasts do not wait for the dead member: the run
    completes, and engine 0 serves every later version. Two pipeline stages (two learner
    processes under torchrun): each stage's source forms its own group again, one stage after
    the other; the last stage's bucket carries the version, so engine 0 serving step s-1's
    version at step s shows that both stages reached it. (One stage forming its group again:
    the sync-kill test below.)"""
    result = run_trainer(tmp_path, "grouped", [
        "cluster.mode=disaggregated", "cluster.max_staleness=0",
        "megatron.pipeline_model_parallel_size=2",
        "trainer.total_steps=3", "trainer.save_interval=0", "rollout.num_engines=2",
        f"rollout.liveness_timeout_s={LIVENESS_TIMEOUT_S}", f"rollout.liveness_probe_interval_s={PROBE_S}",
        "rollout.max_retries=3",
        "algo.n_samples_per_prompt=2", "algo.train_batch_size=36", "algo.gen_batch_size=36", "algo.mini_batch_size=18",
    ], faults=["engine:KILL:1:2"], timeout_s=400, learner_processes=2)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert "SIGKILL to engine 1" in out
    rows = read_metric_rows(tmp_path / "grouped")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["sync/engines"] for r in rows] == [2, 1, 1]
    formed = [line for line in out.splitlines() if "formed again" in line]
    assert len(formed) == 1 and "stage 0" in formed[0] and "1 engine(s)" in formed[0] and "_g1" in formed[0], formed
    for step in (1, 2, 3):
        recs = read_records(tmp_path / "grouped", steps=[step])
        keys = [(r.prompt_id, r.sample_index) for r in recs]
        assert len(keys) == len(set(keys)) == 72, f"step {step}: a sample lost or repeated"
        assert {r.policy_version_min for r in recs} == {step - 1}  # engine 0 got every sync


@pytest.mark.slow  # a 3-step run with two engines: ~60 s here
def test_engine_killed_in_the_middle_of_a_weight_sync_is_dropped_and_the_sync_done_again(tmp_path):
    """Disaggregated: engine 1 is SIGKILLed in the weight sync after step 1, as the learner
    POSTs it the first bucket (engine 0 already waits in the broadcast). The learner names it
    lost at once (its POST's connection fails), aborts the group, the rollout manager marks it
    dead, and the sync is done again into engine 0 over a new group (`_g1`): the run
    completes, and engine 0 serves every later version. (The old code raised WeightSyncError
    and the run failed.)"""
    result = run_trainer(tmp_path, "synckill", [
        "cluster.mode=disaggregated", "cluster.max_staleness=0",
        "trainer.total_steps=3", "trainer.save_interval=0", "rollout.num_engines=2",
        f"rollout.liveness_timeout_s={LIVENESS_TIMEOUT_S}", f"rollout.liveness_probe_interval_s={PROBE_S}",
    ], faults=["engine:KILL:1:1:sync"], timeout_s=400)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert "SIGKILL to engine 1" in out and "in the weight sync of step 1" in out
    dropped = [line for line in out.splitlines() if "dropped from rollouts and weight sync" in line]
    assert len(dropped) == 1 and "lost during the weight sync" in dropped[0] and "process is gone" in dropped[0], \
        dropped
    formed = [line for line in out.splitlines() if "formed again" in line]
    assert len(formed) == 1 and "1 engine(s)" in formed[0] and "_g1" in formed[0], formed
    rows = read_metric_rows(tmp_path / "synckill")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["sync/engines"] for r in rows] == [1, 1, 1]
    for step in (2, 3):
        recs = read_records(tmp_path / "synckill", steps=[step])
        assert recs and {r.policy_version_min for r in recs} == {step - 1}  # engine 0 got the redone sync
        assert len({r.engine_id for r in recs}) == 1


def free_port_pair() -> int:
    """A base port P with P and P + 1 free (rollout.base_port for two engines)."""
    import socket

    from dapo_mega.distributed import free_port

    for _ in range(50):
        base = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def restarted_while_released(tmp_path, name: str, overrides, timeout_s: float):
    """A colocated run of 4 steps whose engine 1 is killed after step 2's first optimizer update
    and started again at its port (as the Slurm engines role restarts an engine): the engines
    were released for the learner's step, and the new process holds its memory. The driver's
    ledger (weights/engine_memory.py) sees the new pid and does not resume it (SGLang's
    scheduler dies of a resume never released, the memory saver of a second release), the
    engine rejoins at step 2's push and serves again. Returns the run's output and records."""
    result = run_trainer(tmp_path, name, [
        "cluster.mode=colocated", "trainer.total_steps=4", "trainer.save_interval=0", "rollout.num_engines=2",
        f"rollout.base_port={free_port_pair()}", f"rollout.liveness_probe_interval_s={PROBE_S}",
        *overrides], faults=["engine:RESTART:1:2"], timeout_s=timeout_s)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    restarted = re.search(r"engine 1 \((\S+)\) pid \d+ restarted during step 2's training", out)
    assert restarted, out[-4000:]
    url = restarted.group(1)
    assert f"engine {url} restarted while the learner trained" in out, out[-4000:]
    rows = read_metric_rows(tmp_path / name)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["sync/engines"] for r in rows] == [2, 2, 2, 2], rows
    served = {step: {r.engine_id for r in read_records(tmp_path / name, steps=[step])} for step in (3, 4)}
    assert url in served[3] | served[4], served  # back in the rollouts, with the learner's weights
    for step in (3, 4):
        assert {r.policy_version_min for r in read_records(tmp_path / name, steps=[step])} == {step - 1}
    return out


def test_a_colocated_engine_restarted_while_released_rejoins_and_serves(tmp_path):
    """The embedded engine keeps torch_memory_saver's contract (--enable-memory-saver, as the
    colocated fleet starts it): before the ledger the resume ended the new process, and the
    engine never served again (issue #37 item 2)."""
    restarted_while_released(tmp_path, "restart", ["algo.n_samples_per_prompt=2", "algo.train_batch_size=8",
                                                    "algo.gen_batch_size=8", "algo.mini_batch_size=4"], 400)
