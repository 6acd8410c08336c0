"""A real SGLang engine SIGKILLed mid-rollout inside `dapo-mega train` loses and duplicates no prompt.

Two SGLang 0.5.23 engines on this CPU (`rollout.backend=sglang`, colocated: update from
tensor), 36 prompts x 2 samples a step in 9 requests (more than one engine's 8 request
slots, so engine 1 surely takes one). Once engine 1's first request of step 1 is in flight
(SGLang has logged its prefill and not answered), SIGKILL goes to its launch process (the
HTTP server) or to its scheduler process (the biggest, an OOM killer's pick; SGLang's
subprocess watchdog then takes the server down). The HTTP connection drops, the rollout
manager marks the engine dead and sends the prompts to engine 0; the weight sync after
step 1 leaves engine 1 out, and step 2 runs on engine 0.

Judged from the run's own records: each step's ledger (parquet under run/ledger) holds every
prompt of the step exactly n times, each sample index once; no sample of step 2 comes from
engine 1; no process of engine 1 (launch process, scheduler, detokenizer: the children set
PR_SET_PDEATHSIG) outlives the fault. The same fault against the embedded engine,
with 3 engines and a hung engine too, is test_faults_engines.py. The colocated run also checks
what every colocated SGLang run must do: the first push and each step's sync by update from
tensor inside weight-update sessions that all end, each one checked by the engine's checksums.
An SGLang engine restarted while released: tests/weights/test_engine_memory.py (the real
syncer leaves it unresumed and it serves) with test_faults_engines.py's run of the embedded one.

Needs the SGLang venv (tests/sglang_venv.py); skips without it.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from sglang_venv import sglang_python_or_skip
from test_faults_common import read_metric_rows, run_trainer

from dapo_mega.records.ledger import read_records

N_SAMPLES = 2
PROMPTS_PER_STEP = 36


@pytest.mark.slow
@pytest.mark.sglang
# each process killed and each mode once (pairs, ~110 s each here): the scheduler colocated, the
# launch process disaggregated, where the learner also forms its weight-update group again
@pytest.mark.parametrize("target,mode", [("scheduler", "colocated"), ("launch", "disaggregated")])
def test_sglang_engine_killed_mid_request_loses_and_duplicates_no_prompt(tmp_path, target, mode):
    """Disaggregated: the learner then leaves its weight-update group on the surviving SGLang
    engine (/destroy_weights_update_group) and forms a new one with it (`..._g1`)."""
    python = sglang_python_or_skip()
    fault = "engine:KILL:1:1:inflight" + ("" if target == "launch" else f"-{target}")
    result = run_trainer(tmp_path, "sglkill", [
        f"cluster.mode={mode}", "rollout.backend=sglang", f"rollout.engine_python={python}",
        "rollout.num_engines=2", "rollout.extra_server_args=[--max-total-tokens,4096]",
        "rollout.request_timeout_s=120", "rollout.max_retries=3",
        "trainer.total_steps=2", "trainer.save_interval=0",
        f"algo.n_samples_per_prompt={N_SAMPLES}", f"algo.train_batch_size={PROMPTS_PER_STEP}",
        f"algo.gen_batch_size={PROMPTS_PER_STEP}", "algo.mini_batch_size=18",
        # answers long enough that the faulted request is surely still decoding when its
        # prefill shows in the log (requests now go to both engines from the start)
        "algo.max_response_length=64",
    ], faults=[fault], timeout_s=900)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    printed = re.search(rf"SIGKILL to engine 1 \((\S+)\) {target} pid \d+ at step 1 (.*); children \[(.*)\]", out)
    assert printed, out[-4000:]
    killed, when, children = printed.group(1), printed.group(2), printed.group(3)
    assert when == "with a /generate request in flight", when
    assert children, "SGLang's launch process had no child processes (scheduler, detokenizer)"
    assert "the in-flight request to engine 1 failed" in out
    assert "engine 1's processes after the fault: all exited" in out  # none outlives the one killed
    dropped = [line for line in out.splitlines() if "dropped from rollouts and weight sync" in line]
    assert len(dropped) == 1 and killed in dropped[0], dropped
    formed = [line for line in out.splitlines() if "formed again" in line]
    assert len(formed) == (mode == "disaggregated"), formed

    run_dir = tmp_path / "sglkill"
    rows = read_metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["rollout/dead_engines"] for r in rows] == [1, 1]
    assert [r["sync/engines"] for r in rows] == [1, 1]
    for step in (1, 2):
        recs = read_records(run_dir, steps=[step])
        per_prompt = Counter(r.prompt_id for r in recs)
        assert len(per_prompt) == PROMPTS_PER_STEP, f"step {step}: {len(per_prompt)} prompts in the ledger"
        assert set(per_prompt.values()) == {N_SAMPLES}, f"step {step}: a prompt lost samples or was repeated"
        keys = [(r.prompt_id, r.sample_index) for r in recs]
        assert len(keys) == len(set(keys)) == PROMPTS_PER_STEP * N_SAMPLES
        assert all(r.learner_version == step - 1 for r in recs)
        # versions read from SGLang's replies: engine 0 got every sync
        assert {r.policy_version_min for r in recs} == {r.policy_version_max for r in recs} == {step - 1}
    survivors = {r.engine_id for r in read_records(run_dir, steps=[2])}
    assert len(survivors) == 1 and killed not in survivors
    if mode == "colocated":  # update from tensor, in SGLang's own format, into the survivor
        log = (run_dir / "logs" / "engine-0.log").read_text(errors="replace")
        assert log.count("POST /update_weights_from_tensor ") >= 3  # the first push and one per step
        assert log.count("POST /begin_weight_update ") == log.count("POST /end_weight_update ") >= 3
    # every sync checked exactly: the survivor's checksum of every tensor it holds (q/k/v and
    # gate/up fused, SGLang's CPU hash) is the learner's of what it sent (issue #37 item 4)
    checked = [r for r in rows if "checksum/tensors" in r]
    assert checked and all(r["checksum/tensors"] > 10 and r["checksum/engines"] == 1
                           and r["checksum/errors"] == 0 for r in checked), checked
