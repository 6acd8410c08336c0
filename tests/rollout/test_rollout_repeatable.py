"""Streamed synchronous steps do not depend on timing: the same seed gives the same batch
and the same ledger rows, whichever engine is slow.

Two embedded engines, one slowed by `--test-decode-delay-ms` (DAPO_MEGA_TEST_CLOCK=1). A
round of 8 prompts is two requests of 4 (chunk 0: p0-p3, chunk 1: p4-p7); the batch (2
groups, p<k> kept for even k) fills within chunk 0. Run A sends chunk 0 to the fast engine,
so the batch fills while chunk 1 still decodes on the slow one (aborted); run B sends chunk
0 to the slow engine, so chunk 1 has finished long before the batch fills. The groups the
first finished do not count: both runs keep p0, p2 at step 1 and p4, p6 at step 2 (the
round's undecided prompts p3-p7 come back first), with the same tokens, the same rows and
the same state. (The manager before this rule carried p4, p6 in run B and made rows of p5,
p7: the step-1 rows, the carry, `pending` and step 2's batch all differed.)
"""

import pytest
from test_rollout_manager import Feed, prompt_stream  # prompts p0, p1, ... drawn in order

from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.engines.sglang.endpoint import EngineEndpoint
from dapo_mega.reward import SampleReward
from dapo_mega.rollout.batch_fill import SamplingRule
from dapo_mega.rollout.manager import RolloutManager, RoundSettings

pytestmark = pytest.mark.exclusive  # its limits are what it tests: it runs alone on two workers

DELAY_MS = 150
TOKENS = 10
"""A request on the slow engine decodes TOKENS steps of >= DELAY_MS: >= 1.5 s."""
G = 2


def fleet_of_one(model_dir, delay_ms: float) -> EngineFleet:
    args = ["--test-decode-delay-ms", str(delay_ms)] if delay_ms else []
    fleet = EngineFleet(RolloutConfig(extra_server_args=args, health_timeout_s=120), str(model_dir), num_threads=1,
                        weight_version="0", extra_env={"DAPO_MEGA_TEST_CLOCK": "1"} if delay_ms else None)
    fleet.start(1)
    return fleet


@pytest.fixture(scope="module")
def fast_and_slow(tiny_model_dir):
    fast, slow = fleet_of_one(tiny_model_dir, 0), fleet_of_one(tiny_model_dir, DELAY_MS)
    try:
        yield fast.engines[0], slow.engines[0]
    finally:
        fast.close()
        slow.close()


def every_other_kept(groups):
    """p<k> has mixed rewards (kept) for even k, all wrong (rejected) for odd k."""
    return [[SampleReward(float(s.sample_index % 2), bool(s.sample_index % 2)) if int(g.prompt_id[1:]) % 2 == 0
             else SampleReward(-1.0, False) for s in g.samples] for g in groups]


def two_steps(engines):
    """Two streamed steps on `engines` (the first gets chunk 0); what each kept and recorded."""
    mgr = RolloutManager([EngineEndpoint(e.url, timeout_s=120) for e in engines], RoundSettings(
        n_samples=G, seed=5, sampling_params={"max_new_tokens": TOKENS, "temperature": 1.0, "ignore_eos": True},
        prompts_per_request=4, requests_per_engine=1))
    source = prompt_stream()
    steps = []
    for step in (1, 2):
        kept, records = mgr.collect_step(step=step, learner_version=step - 1, inputs=Feed(source, every_other_kept),
                                         rule=SamplingRule(train_batch_size=2, gen_batch_size=8, max_staleness=0))
        steps.append({
            "kept": [(g.prompt_id, [s.token_ids for s in g.samples]) for g in kept],
            "rows": [(s.step, s.prompt_id, s.sample_index, tuple(s.token_ids), s.response_text, s.reward,
                      s.reject_reason, s.gen_round, s.seed) for s in records],
            "state": (mgr.sampling.keep_rate, [p.id for p in mgr.sampling.pending], len(mgr.sampling.carry)),
            "metrics": dict(mgr.metrics), "engines": {g.engine_id for g in kept}})
    return steps


def test_kept_groups_and_rows_do_not_depend_on_which_engine_is_slow(fast_and_slow):
    fast, slow = fast_and_slow
    a = two_steps([fast, slow])
    b = two_steps([slow, fast])
    # the completion order differed: A's chunk 1 was still decoding (aborted), B's had finished;
    # both discard p3 (finished with chunk 0, after the last group needed), B chunk 1's too
    assert a[0]["engines"] == {fast.url} and b[0]["engines"] == {slow.url}
    assert a[0]["metrics"]["rollout/aborted_requests"] == 1 and a[0]["metrics"]["rollout/discarded_groups"] == 1
    assert b[0]["metrics"]["rollout/aborted_requests"] == 0 and b[0]["metrics"]["rollout/discarded_groups"] == 5
    assert b[0]["metrics"]["rollout/discarded_samples"] == 5 * G
    for sa, sb in zip(a, b):
        assert sa["kept"] == sb["kept"]                    # prompt ids and token ids
        assert sa["rows"] == sb["rows"] and sa["state"] == sb["state"]
        assert sa["metrics"]["rollout/carried_groups"] == 0
    # the first groups in prompt order that pass the filter; undecided prompts come back first
    assert [pid for pid, _ in a[0]["kept"]] == ["p0", "p2"]
    assert sorted({r[1] for r in a[0]["rows"]}) == ["p0", "p1", "p2"]   # p3 came after the last one needed
    assert a[0]["state"][1:] == (["p3", "p4", "p5", "p6", "p7"], 0)
    assert [pid for pid, _ in a[1]["kept"]] == ["p4", "p6"]
    assert sorted({r[1] for r in a[1]["rows"]}) == ["p3", "p4", "p5", "p6"]
    assert all(len(tokens) == TOKENS for _, group in a[0]["kept"] + a[1]["kept"] for tokens in group)
