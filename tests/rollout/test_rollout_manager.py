"""Rollout manager: engine failure mid-rollout, dynamic sampling, ledger, staleness, seeds."""

import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Callable

import pytest

from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.engines.sglang.endpoint import EngineEndpoint
from dapo_mega.records import ledger
from dapo_mega.reward import SampleReward
from dapo_mega.rollout.batch_fill import SamplingRule
from dapo_mega.rollout.manager import (
    DynamicSamplingExhausted,
    RolloutManager,
    RoundSettings,
    drop_stale_groups,
    request_seed,
    run_coroutine,
)


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

    @classmethod
    def decode(cls, plain):  # a PromptDecoding
        return cls(**plain)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models(7)


@dataclass
class Feed:
    """A step's StepInputs (rollout/dynamic_sampling.py): prompts from `draw`, rewards from `score`."""

    draw: Callable[[int], list]
    score: Callable[[list], list]


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
        mgr = RolloutManager([EngineEndpoint(e.url, timeout_s=60) for e in engines], RoundSettings(
            n_samples=G, run_id="t", sampling_params={"max_new_tokens": 120, "temperature": 1.0, "ignore_eos": True},
            prompts_per_request=1, max_retries=3,
            requests_per_engine=1,  # one at a time: engine 1 still has work queued at the kill
            seed=11))
        killed_at = []
        finished_before = mgr.book.finished_requests()

        def kill_engine_1_mid_request():
            """SIGKILL engine 1 once 4 requests finished and it runs one (bounded: 30 s)."""
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if mgr.book.finished_requests() - finished_before >= 4:
                    with urllib.request.urlopen(engines[1].url + "/v1/loads", timeout=5) as r:
                        if json.load(r)["loads"][0]["num_running_reqs"] > 0:
                            break
                time.sleep(0.01)
            killed_at.append(time.monotonic())
            engines[1].kill(0)

        killer = threading.Thread(target=kill_engine_1_mid_request, daemon=True)
        t0 = time.monotonic()
        killer.start()
        kept, records = mgr.collect_step(step=1, learner_version=3, inputs=Feed(prompt_stream(), lambda gs: [[SampleReward(1.0, True)] * G for _ in gs]),
                                         rule=SamplingRule(train_batch_size=16, gen_batch_size=16, dynamic_sampling=False))
        killer.join(timeout=60)
        assert killed_at and time.monotonic() > killed_at[0], "rollout finished before the kill"
        assert engines[1].url in mgr.book.dead()
        assert len(kept) == 16 and all(len(g.samples) == G for g in kept)
        # Groups finished after the kill (round-relative dispatch + latency, 0.2 s slack for a reply
        # already on the wire) all came from the live engine; there were some (its in-flight retry).
        late = [g for g in kept if t0 + g.queue_delay_s + g.latency_s > killed_at[0] + 0.2]
        assert late and {g.engine_id for g in late} == {engines[0].url}
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
        mgr = RolloutManager([EngineEndpoint(engines[0].url, timeout_s=60)], RoundSettings(
            n_samples=G, run_id="t", sampling_params={"max_new_tokens": 3, "ignore_eos": True}))

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

        kept, records = mgr.collect_step(step=2, learner_version=0, inputs=Feed(prompt_stream(), reward_fn),
                                         rule=SamplingRule(train_batch_size=3, gen_batch_size=4))
        assert [g.prompt_id for g in kept] == ["p0", "p4", "p8"]
        assert mgr.metrics["rollout/gen_batches"] == 3 and mgr.metrics["rollout/groups_generated"] == 12
        reasons = {}
        for r in records:
            reasons[r.reject_reason] = reasons.get(r.reject_reason, 0) + 1
        assert reasons == {"kept": 12, "all_correct_group": 3 * G, "all_wrong_group": 6 * G}
        assert all(s.step == 2 and s.learner_version == 0 and s.seed is None for s in records)
        ledger.write_step(tmp_path, 2, [ledger.ledger_record(s, "t") for s in records])

        mgr2 = RolloutManager([engines[0].url], RoundSettings(
            n_samples=G, run_id="t", sampling_params={"max_new_tokens": 3, "ignore_eos": True}))
        with pytest.raises(DynamicSamplingExhausted) as err:
            mgr2.collect_step(step=3, learner_version=0, inputs=Feed(prompt_stream(), reward_fn),
                              rule=SamplingRule(train_batch_size=3, gen_batch_size=4, max_num_gen_batches=2))
        msg = str(err.value)
        for part in ("after 2 rounds", "8 groups generated", "2 all-correct", "4 all-wrong",
                     "max_num_gen_batches", "dynamic_sampling=false", "n_samples_per_prompt"):
            assert part in msg, (part, msg)

        # Surplus kept groups carry over to the next step.
        mgr3 = RolloutManager([engines[0].url], RoundSettings(n_samples=G, sampling_params={"max_new_tokens": 2}))
        kept, _ = mgr3.collect_step(step=1, learner_version=0, inputs=Feed(prompt_stream(), lambda gs: [[SampleReward(float(s.sample_index % 2),
                                                                                   bool(s.sample_index % 2))
                                                                      for s in g.samples] for g in gs]),
                                                                      rule=SamplingRule(train_batch_size=3, gen_batch_size=5))
        assert len(kept) == 3 and len(mgr3.sampling.carry) == 2
        assert [g.prompt_id for g in mgr3.sampling.carry] == ["p3", "p4"]
        # The carry survives a checkpoint as plain data, scores and reasons included.
        restored = RolloutManager([engines[0].url], RoundSettings(n_samples=G, sampling_params={}))
        restored.load_state_dict(mgr3.state_dict(), Prompt)
        assert [g.prompt_id for g in restored.sampling.carry] == ["p3", "p4"]
        assert [s.score for g in restored.sampling.carry for s in g.samples] == [s.score for g in mgr3.sampling.carry for s in g.samples]
        assert [g.samples[1].token_ids for g in restored.sampling.carry] == [g.samples[1].token_ids for g in mgr3.sampling.carry]
        fresh, stale = drop_stale_groups(mgr3.sampling.carry, learner_version=2, max_staleness=1)
        assert fresh == [] and len(stale) == 2 and stale[0].reasons == ["stale"] * G
    finally:
        engines[0].kill()


def every_other_kept(groups):
    """Prompt p<k> has mixed rewards (kept) for even k, all wrong (rejected) for odd k."""
    return [[SampleReward(float(s.sample_index % 2), bool(s.sample_index % 2)) if int(g.prompt_id[1:]) % 2 == 0
             else SampleReward(-1.0, False) for s in g.samples] for g in groups]


def test_synchronous_rounds_sized_from_the_keep_rate_and_resume_keeps_it(model_dir, tmp_path):
    engines = start_engines(model_dir, 1, weight_version="0")
    try:
        G = 2
        make = lambda: RolloutManager([engines[0].url], RoundSettings(
            n_samples=G, sampling_params={"max_new_tokens": 2}, prompts_per_request=1, requests_per_engine=1))
        mgr = make()
        source = prompt_stream()
        kept, records = mgr.collect_step(step=1, learner_version=0, inputs=Feed(source, every_other_kept),
                                         rule=SamplingRule(train_batch_size=3, gen_batch_size=4, max_staleness=0))
        # round 0: gen_batch_size=4 prompts (no keep rate yet) keeps p0, p2; the measured keep
        # rate is ~1/2, so round 1 asks for ceil(1 x 1.2 / rate) = 3 prompts and stops at p4.
        assert [g.prompt_id for g in kept] == ["p0", "p2", "p4"]
        assert abs(mgr.sampling.keep_rate - 3 / 5) < 0.02                        # 3 of the 5 groups seen were kept
        m = mgr.metrics
        assert (m["rollout/gen_batches"], m["rollout/groups_generated"], m["rollout/prompts_requested"]) == (2, 5, 7)
        assert m["rollout/aborted_requests"] == 0 and m["rollout/carried_groups"] == 0
        # p5, p6 were drawn but never sent: pending, not ledger rows, drawn first next time
        assert [p.id for p in mgr.sampling.pending] == ["p5", "p6"] and m["rollout/pending_prompts"] == 2
        assert sorted({s.prompt_id for s in records}) == ["p0", "p1", "p2", "p3", "p4"]
        assert all(s.reject_reason == ("kept" if int(s.prompt_id[1:]) % 2 == 0 else "all_wrong_group")
                   for s in records)
        # A checkpoint keeps the estimate and the pending prompts.
        restored = make()
        restored.load_state_dict(mgr.state_dict(), Prompt)
        assert restored.sampling.keep_rate == mgr.sampling.keep_rate and [p.id for p in restored.sampling.pending] == ["p5", "p6"]
        assert restored.sampling.round_size(3, 4) == mgr.sampling.round_size(3, 4) == 6   # ceil(3 x 1.2 / ~0.6); not gen_batch_size
        kept, records = restored.collect_step(step=2, learner_version=1, inputs=Feed(source, every_other_kept),
                                              rule=SamplingRule(train_batch_size=3, gen_batch_size=4, max_staleness=0))
        assert [g.prompt_id for g in kept] == ["p6", "p8", "p10"]    # pending first, then the cursor (p7 on)
        assert restored.metrics["rollout/gen_batches"] == 1
        # A checkpoint written before streaming (carry only) still loads.
        old = make()
        old.load_state_dict({"carry": []}, Prompt)
        assert old.sampling.keep_rate is None and old.sampling.pending == [] and old.sampling.round_size(3, 4) == 4
    finally:
        engines[0].kill()


@dataclass(frozen=True)
class ShortFirst(RoundSettings):
    """p0's request is short, every other one long: the batch fills while they are in flight."""

    def params_for(self, prompts, step, gen_round):
        return [{**self.sampling_params, "max_new_tokens": 2 if p.id == "p0" else 250} for p in prompts]


def test_requests_in_flight_are_aborted_once_the_batch_is_full(model_dir, tmp_path):
    engines = start_engines(model_dir, 1, weight_version="0")
    try:
        G = 2
        mgr = RolloutManager([EngineEndpoint(engines[0].url, timeout_s=120)], ShortFirst(
            n_samples=G, sampling_params={"ignore_eos": True}, prompts_per_request=1, requests_per_engine=3))
        kept, records = mgr.collect_step(step=1, learner_version=0, inputs=Feed(prompt_stream(), every_other_kept),
                                         rule=SamplingRule(train_batch_size=1, gen_batch_size=6, max_staleness=0))
        assert [g.prompt_id for g in kept] == ["p0"]
        m = mgr.metrics
        # p1, p2 were in flight and aborted (partial, never completed: no ledger rows); p3-p5 never sent
        assert m["rollout/aborted_requests"] == 2 and m["rollout/aborted_samples"] == 2 * G
        assert 0 <= m["rollout/aborted_tokens"] < 2 * G * 250
        assert m["rollout/groups_generated"] == 1 and m["rollout/carried_groups"] == 0
        assert {s.prompt_id for s in records} == {"p0"} and len(records) == G
        assert [p.id for p in mgr.sampling.pending] == ["p1", "p2", "p3", "p4", "p5"]
        # the engine is not marked dead, and generates normally afterwards
        assert mgr.book.dead() == {}
        ledger.write_step(tmp_path, 1, [ledger.ledger_record(s, "t") for s in records])
        assert len(ledger.read_records(tmp_path)) == G
    finally:
        engines[0].kill()


class ResettingProxy:
    """A TCP proxy in front of an engine (its own event loop in a thread) that resets (RST) the
    first `resets` connections carrying a `POST /generate`, as a server closing an idle
    keep-alive connection does to the request that reuses it; the rest it forwards."""

    def __init__(self, upstream_port: int, resets: int):
        import asyncio
        self.upstream_port, self.resets_left, self.resets_done, self.generates_forwarded = upstream_port, resets, 0, 0
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _serve(self, reader, writer):
        import asyncio
        import socket
        import struct
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def client_to_engine():
            while chunk := await reader.read(65536):
                if chunk.startswith(b"POST /generate"):
                    if self.resets_left > 0:
                        self.resets_left -= 1
                        self.resets_done += 1
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        writer.transport.abort()  # RST, not FIN
                        up_writer.close()
                        return
                    self.generates_forwarded += 1
                up_writer.write(chunk)
                await up_writer.drain()
            up_writer.close()

        async def engine_to_client():
            while chunk := await up_reader.read(65536):
                writer.write(chunk)
                await writer.drain()
            writer.close()

        await asyncio.gather(client_to_engine(), engine_to_client(), return_exceptions=True)

    def close(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def test_a_reset_connection_to_a_healthy_engine_is_retried_not_a_dead_engine(model_dir):
    """A request whose connection is reset while the engine still answers /health goes again
    (one of max_retries), and the engine keeps serving: a killed engine is refused at /health."""
    engines = start_engines(model_dir, 1, weight_version="0")
    proxy = ResettingProxy(engines[0].port, resets=2)
    try:
        mgr = RolloutManager([EngineEndpoint(proxy.url, timeout_s=60)], RoundSettings(
            n_samples=2, sampling_params={"max_new_tokens": 8, "temperature": 1.0}, prompts_per_request=1,
            max_retries=3, requests_per_engine=2))
        groups = run_coroutine(mgr.generate_groups([Prompt(id=f"p{i}", prompt=[4 + i, 5]) for i in range(4)]))
        assert proxy.resets_done == 2
        assert mgr.book.dead() == {}, mgr.book.dead()
        assert len(groups) == 4 and all(len(g.samples) == 2 for g in groups)
        assert proxy.generates_forwarded == 4  # each prompt's request answered once
    finally:
        proxy.close()
        for e in engines:
            e.kill()
