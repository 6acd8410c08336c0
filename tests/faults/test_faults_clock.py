"""A whole run at the 32B run's clock ratios, on a CPU: rollouts and evaluations that outlast
the collective timeout, requests that outlast what a total-request timeout would allow.

At 32B a dynamic-sampling round takes tens of minutes and an AIME eval longer still, while
the learner ranks' collective timeout (`cluster.dist_timeout_s`) is 30 minutes and the slowest
request (630-900 s) outlasts the 600 s request timeout the trainer used to have. Here the
embedded engines are slowed (`--test-decode-delay-ms`, a sleep after every forward step, with
DAPO_MEGA_TEST_CLOCK=1) and the limits shrunk so that the ratios hold or exceed those:

    rollout round >= 3 x dist_timeout_s,  slowest request >= 3 x (dist_timeout_s / 3),
    an evaluation longer than a round,

with two learner processes (the second waits for the driver's rollouts and evals on the
store, `driver/gate.py`, not inside a gloo broadcast that would time out) and two engines
(every request and eval reaches both; neither is marked dead for being slow). One step is
enough: the evaluation before it, its round and the evaluation after it each outlast the
timeout, and the weight sync between them is the one every later step repeats.
"""

from __future__ import annotations

import json

import pytest
from test_faults_common import read_metric_rows, run_trainer

from dapo_mega.records.ledger import read_records

pytestmark = pytest.mark.exclusive  # its limits are what it tests: it runs alone on two workers

DIST_TIMEOUT_S = 3
OLD_REQUEST_TIMEOUT_S = DIST_TIMEOUT_S / 3  # 600 s of 1800 s, the old defaults' ratio
DELAY_MS = 300


@pytest.mark.slow
def test_rollouts_and_evals_outlast_the_collective_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("DAPO_MEGA_TEST_CLOCK", "1")
    result = run_trainer(tmp_path, "clock", [
        "trainer.total_steps=1", "trainer.save_interval=0", "trainer.eval_interval=1",
        "eval.max_problems=6", "eval.n_samples=4", "eval.max_response_length=12",
        f"cluster.dist_timeout_s={DIST_TIMEOUT_S}", "rollout.num_engines=2",
        # two sequences at a time per engine: a request of 2 prompts x 4 samples decodes in 4 waves
        "rollout.max_running_requests=2", f"rollout.extra_server_args=[--test-decode-delay-ms,{DELAY_MS}]",
        "rollout.liveness_timeout_s=30", "rollout.liveness_probe_interval_s=1",
    ], timeout_s=600, learner_processes=2)
    out = result.stdout
    assert result.returncode == 0, out[-5000:]
    run_dir = tmp_path / "clock"
    rows = read_metric_rows(run_dir)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1]
    rollout_s = [r["time/rollout_s"] for r in steps]
    # the ratios of the 32B run hold (else the test proves nothing: slow the engines more)
    assert min(rollout_s) >= 3 * DIST_TIMEOUT_S, rollout_s
    assert steps[-1]["time/eval_s"] > max(rollout_s), (steps[-1]["time/eval_s"], rollout_s)
    records = read_records(run_dir)
    slowest = max(r.generation_latency_s for r in records)
    assert slowest >= 3 * OLD_REQUEST_TIMEOUT_S, slowest
    # slow engines are not dead ones; both serve training and both serve every evaluation
    assert all(r["rollout/dead_engines"] == 0 for r in steps)
    assert len({r.engine_id for r in records}) == 2
    for name in ("step_000000.json", "step_000001.json"):
        engines = json.loads((run_dir / "eval" / name).read_text())["engines"]
        assert len(engines) == 2 and all(v["requests"] > 0 for v in engines.values()), (name, engines)
    assert "requests/samples per engine: e0 " in out
