"""Rollout manager: engine failure mid-rollout, dynamic sampling, ledger, staleness, seeds."""

import threading
import time
from dataclasses import dataclass

import pytest

from dapo_mega.backends.sglang.endpoint import EngineEndpoint
from dapo_mega.config import RolloutConfig
from dapo_mega.reward import SampleReward
from dapo_mega.rollout import ledger
from dapo_mega.rollout.manager import DynamicSamplingExhausted, RolloutManager, drop_stale_groups, request_seed
from dapo_mega.rollout.fleet import EngineFleet


def start_engines(model_dir, count, weight_version):
    """`count` embedded engines (one CPU thread each) started by the fleet, healthy."""
    fleet = EngineFleet(RolloutConfig(), str(model_dir), num_threads=1, weight_version=weight_version)
    fleet.start(count)
    return fleet.engines


@dataclass
class Prompt:
    id: str
    prompt: list
    dataset_revision: str = "synthetic-v1"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dapo_mega.models.tiny import build_tiny_model_dir

    d = tmp_path_factory.mktemp("tiny_mgr")
    build_tiny_model_dir(d, seed=7)
    return d


def prompt_stream():
    counter = [0]

    def take(k):
        out = [Prompt(id=f"p{counter[0] + i}", prompt=[4 + (counter[0] + i) % 20, 5]) for i in range(k)]
        counter[0] += k
        return out
    return take


def test_engine_killed_mid_rollout_loses_and_duplicates_nothing(model_dir, tmp_path):
    engines = start_engines(model_dir, 2, weight_version="3")
    try:
        G = 4
        mgr = RolloutManager([EngineEndpoint(e.url, timeout_s=60) for e in engines], n_samples=G, run_id="t",
                             sampling_params={"max_new_tokens": 120, "temperature": 1.0, "ignore_eos": True},
                             prompts_per_request=1, max_retries=3,
                             requests_per_engine=1,  # one at a time: engine 1 still has work queued at the kill
                             seed=11)
        killer = threading.Timer(0.8, engines[1].kill, args=(0,))  # SIGKILL
        killer.start()
        t0 = time.monotonic()
        kept, records = mgr.collect_step(step=1, learner_version=3, prompt_source=prompt_stream(),
                                         reward_fn=lambda gs: [[SampleReward(1.0, True)] * G for _ in gs],
                                         train_batch_size=16, gen_batch_size=16, dynamic_sampling=False)
        killer.join()
        assert time.monotonic() - t0 > 0.8, "rollout finished before the kill: make generation longer"
        assert engines[1].url in mgr.dead
        assert len(kept) == 16 and all(len(g.samples) == G for g in kept)
        assert {g.engine_id for g in kept[-4:]} == {engines[0].url}
        ledger.write_step(tmp_path, 1, [ledger.ledger_record(s, "t") for s in records])
        rows = ledger.read_records(tmp_path)
        keys = [(r.prompt_id, r.sample_index) for r in rows]
        assert sorted(keys) == sorted((f"p{i}", j) for i in range(16) for j in range(G))  # no gap, no duplicate
        assert all(r.policy_version_min == 3 and r.age == 0 and r.reject_reason == "kept" for r in rows)
        # The ledger's seed is the sampling_seed the request carried (same for a retried chunk).
        assert all(r.seed == request_seed(11, 1, 0, r.prompt_id) for r in rows)
        # The learner's tokens and the engine's log-probs travel with the sample.
        assert all(len(s.token_ids) == s.response_length == len(s.logprobs) > 0 for s in records)
        # Rewriting the step (resume) replaces the shard.
        ledger.write_step(tmp_path, 1, [ledger.ledger_record(s, "t") for s in records])
        assert len(ledger.read_records(tmp_path)) == 16 * G
    finally:
        for e in engines:
            e.kill()


def test_dynamic_sampling_rounds_and_round_limit(model_dir, tmp_path):
    engines = start_engines(model_dir, 1, weight_version="0")
    try:
        G = 4
        mgr = RolloutManager([EngineEndpoint(engines[0].url, timeout_s=60)], n_samples=G, run_id="t",
                             sampling_params={"max_new_tokens": 3, "ignore_eos": True})

        def reward_fn(groups):
            # Only every 4th prompt has mixed rewards; the others are all wrong or all correct.
            out = []
            for g in groups:
                k = int(g.prompt_id[1:])
                if k % 4 == 0:
                    out.append([SampleReward(1.0 if s.sample_index % 2 else -1.0, bool(s.sample_index % 2))
                                for s in g.samples])
                else:
                    ok = k % 4 == 1
                    out.append([SampleReward(1.0 if ok else -1.0, ok)] * len(g.samples))
            return out

        kept, records = mgr.collect_step(step=2, learner_version=0, prompt_source=prompt_stream(),
                                         reward_fn=reward_fn, train_batch_size=3, gen_batch_size=4)
        assert [g.prompt_id for g in kept] == ["p0", "p4", "p8"]
        assert mgr.metrics["rollout/gen_batches"] == 3 and mgr.metrics["rollout/groups_generated"] == 12
        reasons = {}
        for r in records:
            reasons[r.reject_reason] = reasons.get(r.reject_reason, 0) + 1
        assert reasons == {"kept": 12, "all_correct_group": 3 * G, "all_wrong_group": 6 * G}
        assert all(s.step == 2 and s.learner_version == 0 and s.seed is None for s in records)
        ledger.write_step(tmp_path, 2, [ledger.ledger_record(s, "t") for s in records])

        mgr2 = RolloutManager([engines[0].url], n_samples=G, run_id="t",
                              sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        with pytest.raises(DynamicSamplingExhausted) as err:
            mgr2.collect_step(step=3, learner_version=0, prompt_source=prompt_stream(), reward_fn=reward_fn,
                              train_batch_size=3, gen_batch_size=4, max_num_gen_batches=2)
        msg = str(err.value)
        for part in ("after 2 rounds", "8 groups generated", "2 all-correct", "4 all-wrong",
                     "max_num_gen_batches", "dynamic_sampling=false", "n_samples_per_prompt"):
            assert part in msg, (part, msg)

        # Surplus kept groups carry over to the next step.
        mgr3 = RolloutManager([engines[0].url], n_samples=G, sampling_params={"max_new_tokens": 2})
        kept, _ = mgr3.collect_step(step=1, learner_version=0, prompt_source=prompt_stream(),
                                    reward_fn=lambda gs: [[SampleReward(float(s.sample_index % 2),
                                                                        bool(s.sample_index % 2)) for s in g.samples]
                                                          for g in gs],
                                    train_batch_size=3, gen_batch_size=5)
        assert len(kept) == 3 and len(mgr3.carry) == 2
        assert [g.prompt_id for g in mgr3.carry] == ["p3", "p4"]
        # The carry survives a checkpoint as plain data, scores and reasons included.
        restored = RolloutManager([engines[0].url], n_samples=G, sampling_params={})
        restored.load_state_dict(mgr3.state_dict(), lambda d: Prompt(**d))
        assert [g.prompt_id for g in restored.carry] == ["p3", "p4"]
        assert [s.score for g in restored.carry for s in g.samples] == [s.score for g in mgr3.carry for s in g.samples]
        assert [g.samples[1].token_ids for g in restored.carry] == [g.samples[1].token_ids for g in mgr3.carry]
        fresh, stale = drop_stale_groups(mgr3.carry, learner_version=2, max_staleness=1)
        assert fresh == [] and len(stale) == 2 and stale[0].reasons == ["stale"] * G
    finally:
        engines[0].kill()
