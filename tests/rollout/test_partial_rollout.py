"""Partial rollouts (rollout/partial.py): the carry of samples cut short, resumed later.

Pure tests of the carry (tokens, log-probs and weight-version spans concatenated; the budget
left; age by the oldest token; the checkpoint round trip; the config rule), then one run on
the embedded engine: samples aborted when step 1's batch filled are resumed in step 2 under
the next weights, and the ledger says which versions produced which tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Callable

import pytest

from dapo_mega.config import ConfigError, RolloutConfig, load_config, partial_rollout_enabled
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.engines.sglang.client import SampleResult
from dapo_mega.engines.sglang.endpoint import EngineEndpoint
from dapo_mega.records import ledger
from dapo_mega.reward import SampleReward
from dapo_mega.rollout.batch_fill import SamplingRule
from dapo_mega.rollout.dynamic_sampling import DynamicSampler
from dapo_mega.rollout.manager import RolloutManager, RoundSettings
from dapo_mega.rollout.partial import PartialGroup, cut_chunks, merge_spans, resume_request
from dapo_mega.rollout.samples import Group, TextPrompts, scored_sample


@dataclass
class Feed:
    """A step's StepInputs (rollout/dynamic_sampling.py)."""

    draw: Callable[[int], list]
    score: Callable[[list], list]


@dataclass
class Prompt:
    id: str
    prompt: list
    dataset_revision: str = "r1"

    @classmethod
    def decode(cls, plain):  # a PromptDecoding
        return cls(**plain)


def reply(tokens, version, finish="abort", logprob_base=-0.5, text=None, index=0):
    """A parsed /generate reply of `tokens`, all from weight `version`."""
    return SampleResult(prompt_index=0, sample_index=index, text=text if text is not None else "".join(
        f"<{t}>" for t in tokens), output_ids=list(tokens), token_ids=list(tokens),
        finish_reason={"type": finish}, logprobs=[logprob_base - k for k in range(len(tokens))],
        weight_versions=[{"version": str(version), "start": 0, "end": len(tokens)}],
        prompt_tokens=3, completion_tokens=len(tokens), meta_info={"e2e_latency": 0.25})


def cut_group(replies, budget=10, prompt=None):
    prompt = prompt or Prompt("p0", [7, 8, 9])
    group = Group(prompt=prompt, prompt_input=list(prompt.prompt), engine_id="e0", queue_delay_s=0.0,
                  latency_s=0.1, samples=[scored_sample(r, prompt, 1000, "e0", 0.0, 0.1, 0) for r in replies])
    return PartialGroup.cut(group, replies, budget)


def test_cut_resume_and_merge_concatenate_tokens_logprobs_and_versions():
    # sample 0 finished (stop) with 2 tokens; sample 1 cut after 3 tokens; sample 2 cut with its
    # whole budget spent (SGLang can say abort for a sample that made its last token then)
    pg = cut_group([reply([1, 2], 4, "stop", index=0), reply([5, 6, 7], 4, index=1),
                    reply(list(range(10)), 4, index=2)])
    assert pg.open == [1] and pg.budget == 10
    assert [s.truncated for s in pg.group.samples] == [False, False, True]
    # the resume request: prompt + tokens so far, n = 1, the budget left, the sample's own seed
    req = resume_request([pg], [{"n": 4, "max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 50}])
    assert req.inputs == [[7, 8, 9, 5, 6, 7]]
    assert req.params == [{"n": 1, "max_new_tokens": 7, "temperature": 1.0, "sampling_seed": 51}]
    assert req.owners == [(0, 1)]
    # resumed under version 5: 4 more tokens, then finished
    done = pg.merge([reply([8, 9, 10, 11], 5, "stop", logprob_base=-2.0, text="<c>")], "e1", 1.0)
    s = done.group.samples[1]
    assert done.open == [] and done.group.engine_id == "e1"
    assert s.token_ids == [5, 6, 7, 8, 9, 10, 11]
    assert s.logprobs == [-0.5, -1.5, -2.5, -2.0, -3.0, -4.0, -5.0]
    assert s.weight_versions == [{"version": "4", "start": 0, "end": 3}, {"version": "5", "start": 3, "end": 7}]
    assert s.response_text == "<5><6><7><c>" and not s.truncated
    assert s.generation_latency_s == pytest.approx(0.5)          # 0.25 + 0.25 (each reply's e2e_latency)
    assert done.group.samples[0] is pg.group.samples[0]           # finished samples untouched
    # cut again (aborted with budget left): still open, spans of one version joined
    again = pg.merge([reply([8], 4)], "e0", 1.0)
    assert again.open == [1] and again.group.samples[1].weight_versions == [{"version": "4", "start": 0, "end": 4}]


def test_a_resumed_sample_keeps_the_report_of_its_last_request():
    """A mixture's routed experts (SGLang's base64 int32 [positions, layers, k]): the resumed
    request routes the prompt and the carried tokens again, so its report covers the whole
    sample; the first request's would be short by the tokens after it."""
    import base64

    import numpy as np

    from dapo_mega.backends.megatron.routing import decode_routed_experts

    def routed(r, positions, value):
        r.meta_info["routed_experts"] = base64.b64encode(np.full((positions, 2, 2), value, np.int32).tobytes()).decode()
        return r

    pg = cut_group([routed(reply([1, 2], 4, "stop", index=0), 4, 1), routed(reply([5, 6, 7], 4, index=1), 5, 2)])
    assert pg.group.samples[1].routed_experts.startswith("u8:")  # kept as a byte per choice
    done = pg.merge([routed(reply([8, 9], 5, "stop"), 3 + 5 - 1, 3)], "e1", 1.0)
    report = decode_routed_experts(done.group.samples[1].routed_experts, 3 + 5 - 1, 2, 2)
    assert report is not None and (report == 3).all()


def test_a_sample_waiting_for_its_tool_is_left_to_it_and_carried_so():
    """A multi-turn sample cut as its turn ended at a tool call (rollout/turns.py): open, but
    not in the resume request (its tool answers first), still open after the others merge,
    and so through the checkpoint."""
    from dataclasses import replace

    pg = cut_group([reply([1, 2], 4, "stop", index=0), reply([5, 6, 7], 4, index=1)])
    waiting = replace(pg.group.samples[0], tool_pending=True)
    pg = replace(pg, open=[0, 1], group=replace(pg.group, samples=[waiting, pg.group.samples[1]]))
    assert pg.to_generate == [1] and resume_request([pg], [{"n": 2, "max_new_tokens": 10}]).owners == [(0, 1)]
    merged = pg.merge([reply([8], 5, "stop")], "e1", 0.1)
    assert merged.open == [0] and merged.group.samples[0] is waiting
    back = PartialGroup.from_dict(json.loads(json.dumps(pg.to_dict())), Prompt)
    assert back.group.samples[0].tool_pending and back.to_generate == [1]


def test_merge_spans_shift_drop_empty_and_join():
    old = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 2}]
    new = [{"version": "1", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 4}]
    assert merge_spans(old, new, 2) == [{"version": "1", "start": 0, "end": 3}, {"version": "3", "start": 3, "end": 6}]


def test_age_counts_the_oldest_token_and_too_old_groups_are_dropped_and_counted():
    pg = cut_group([reply([1, 2], 3, "stop", index=0), reply([5, 6], 2, index=1)])
    merged = pg.merge([reply([7, 8], 6, "stop")], "e0", 0.1)
    s = merged.group.samples[1]
    s.learner_version = 6
    assert (s.policy_version_min, s.policy_version_max, s.age) == (2, 6, 4)   # the oldest token, not the newest
    assert merged.oldest_version() == 2
    assert not merged.too_old(6, 4) and merged.too_old(6, 3) and not merged.too_old(6, None)
    # a carried group too old for the learner that draws it is dropped, its prompt generated afresh
    sampler = DynamicSampler(TextPrompts(), partial_rollout=True)
    young = cut_group([reply([1], 5, index=0), reply([2, 3], 5, index=1)], prompt=Prompt("p1", [1]))
    sampler.pending = [pg.prompt, young.prompt]
    sampler.partials = {id(pg.prompt): pg, id(young.prompt): young}
    counts = {k: 0 for k in ("partial_stale_groups", "partial_stale_tokens", "resumed_groups", "resumed_tokens")}
    prompts, resumed = sampler._draw(None, 2, learner_version=6, age_limit=1, counts=counts)
    assert [p.id for p in prompts] == ["p0", "p1"] and resumed == {1: young}
    assert counts == {"partial_stale_groups": 1, "partial_stale_tokens": 4, "resumed_groups": 1, "resumed_tokens": 3}
    assert sampler.partials == {}


def test_the_carry_round_trips_through_the_checkpoint_state():
    sampler = DynamicSampler(TextPrompts(), partial_rollout=True)
    pg = cut_group([reply([1, 2], 3, "stop", index=0), reply([5, 6, 7], 3, index=1)], budget=12)
    fresh = Prompt("p9", [4, 4])
    sampler.pending = [fresh, pg.prompt]
    sampler.partials = {id(pg.prompt): pg}
    state = json.loads(json.dumps(sampler.state_dict()))           # what the checkpoint's JSON holds
    restored = DynamicSampler(TextPrompts(), partial_rollout=True)
    restored.load_state_dict(state, Prompt)
    assert [p.id for p in restored.pending] == ["p9", "p0"]
    back = restored.partials[id(restored.pending[1])]             # found by the pending prompt itself
    assert back.open == [1] and back.budget == 12
    plain = lambda samples: json.loads(json.dumps([asdict(s) for s in samples]))  # noqa: E731 - tuples as lists
    assert plain(back.group.samples) == plain(pg.group.samples)
    assert back.group.prompt_input == [7, 8, 9]
    assert id(restored.pending[0]) not in restored.partials
    # and the resume it gives is the one the original would give
    base = [{"n": 2, "max_new_tokens": 12}]
    assert resume_request([back], base) == resume_request([pg], base)


def test_chunks_never_mix_resumed_and_fresh_prompts():
    assert cut_chunks(7, 2, {1, 2, 3, 6}) == [[0], [1, 2], [3], [4, 5], [6]]
    assert cut_chunks(3, 4, set()) == [[0, 1, 2]]


def test_partial_rollout_default_and_refusals():
    cfg = load_config([])
    assert cfg.rollout.partial_rollout is None and not partial_rollout_enabled(cfg)   # age limit 0: off
    assert partial_rollout_enabled(load_config(["cluster.max_sample_age=1"]))          # synchronous, age 1: on
    assert not partial_rollout_enabled(load_config(["cluster.max_sample_age=1", "rollout.partial_rollout=false"]))
    assert not partial_rollout_enabled(load_config(["cluster.mode=disaggregated", "cluster.max_staleness=1"]))
    with pytest.raises(ConfigError, match="rollout.partial_rollout.*max_sample_age=1"):
        load_config(["rollout.partial_rollout=true"])
    with pytest.raises(ConfigError, match="rollout.partial_rollout.*retract"):
        load_config(["rollout.partial_rollout=true", "cluster.mode=disaggregated", "cluster.max_staleness=1"])


def test_ledger_row_says_which_versions_produced_which_tokens():
    pg = cut_group([reply([1], 2, "stop", index=0), reply([5, 6], 2, index=1)])
    s = pg.merge([reply([7, 8, 9], 3, "stop")], "e0", 0.1).group.samples[1]
    s.step, s.learner_version = 4, 3
    row = ledger.ledger_record(s, "run")
    assert (row.policy_version_min, row.policy_version_max, row.age) == (2, 3, 1)
    assert json.loads(row.weight_versions) == [{"version": "2", "start": 0, "end": 2},
                                               {"version": "3", "start": 2, "end": 5}]


# ------------------------------------------------------------------------------ on the embedded engine


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models(7)


@dataclass(frozen=True)
class LongAfterFirst(RoundSettings):
    """p0 asks for 2 tokens, every other prompt for LONG: step 1's batch fills while they run."""

    def params_for(self, prompts, step, gen_round):
        return [{**self.sampling_params, "max_new_tokens": 2 if p.id == "p0" else LONG} for p in prompts]


LONG = 120


def mixed_rewards(groups):
    """Every group informative (sample 0 wrong, sample 1 right): all are kept, in prompt order."""
    return [[SampleReward(float(s.sample_index % 2), bool(s.sample_index % 2)) for s in g.samples] for g in groups]


def test_samples_aborted_when_the_batch_fills_are_resumed_next_step_under_the_new_weights(model_dir, tmp_path):
    from dapo_mega.aio import run_coroutine
    from dapo_mega.engines.sglang.client import EngineClient

    fleet = EngineFleet(RolloutConfig(), str(model_dir), num_threads=1, weight_version="0")
    fleet.start(1)
    url = fleet.engines[0].url
    try:
        G, counter = 2, [0]

        def draw(k):
            out = [Prompt(id=f"p{counter[0] + i}", prompt=[4 + counter[0] + i, 5]) for i in range(k)]
            counter[0] += k
            return out

        settings = LongAfterFirst(n_samples=G, sampling_params={"ignore_eos": True}, prompts_per_request=1,
                                  requests_per_engine=3, partial_rollout=True)
        mgr = RolloutManager([EngineEndpoint(url, timeout_s=120)], settings)
        feed = Feed(draw, mixed_rewards)
        kept, rows1 = mgr.collect_step(step=1, learner_version=0, inputs=feed,
                                       rule=SamplingRule(train_batch_size=1, gen_batch_size=3, max_staleness=1, stream=True))
        assert [g.prompt_id for g in kept] == ["p0"]
        m = mgr.metrics
        # p1 and p2 were in flight when the batch filled: aborted, their samples kept, nothing thrown away
        assert m["rollout/aborted_requests"] == 2 and m["rollout/aborted_tokens"] == 0
        assert m["rollout/partial_groups"] == 2 and 0 < m["rollout/partial_tokens"] < 2 * G * LONG
        carried = {p.id: mgr.sampling.partials[id(p)] for p in mgr.sampling.pending}
        cut = {pid: [len(s.token_ids) for s in pg.group.samples] for pid, pg in carried.items()}
        # a checkpoint taken now keeps them (the trainer saves this state as rollout_carry)
        resumed_mgr = RolloutManager([EngineEndpoint(url, timeout_s=120)], settings)
        resumed_mgr.load_state_dict(json.loads(json.dumps(mgr.state_dict())), Prompt)

        async def new_version():
            async with EngineClient(url) as c:
                await c.update_weight_version("1")
        run_coroutine(new_version())                                    # the learner's step: version 1
        kept, rows2 = resumed_mgr.collect_step(step=2, learner_version=1, inputs=feed,
                                               rule=SamplingRule(train_batch_size=2, gen_batch_size=3, max_staleness=1, stream=True))
        assert [g.prompt_id for g in kept] == ["p1", "p2"]              # the carried prompts come first
        assert resumed_mgr.metrics["rollout/resumed_groups"] == 2
        assert resumed_mgr.metrics["rollout/resumed_tokens"] == m["rollout/partial_tokens"]
        for g in kept:
            for s, before in zip(g.samples, cut[g.prompt_id]):
                assert len(s.token_ids) == len(s.logprobs) == LONG      # the budget: old + new tokens, not more
                spans = s.weight_versions
                assert spans[0]["start"] == 0 and spans[-1]["end"] == LONG
                if 0 < before < LONG:                                   # cut short: version 0, then version 1
                    assert [(sp["version"], sp["start"], sp["end"]) for sp in spans] == \
                        [("0", 0, before), ("1", before, LONG)]
        ledger.write_step(tmp_path, 2, [ledger.ledger_record(s, "t") for s in rows2])
        table = [r for r in ledger.read_records(tmp_path) if r.prompt_id in ("p1", "p2")]
        assert len(table) == 2 * G
        mixed = [r for r in table if r.policy_version_min == 0 and r.policy_version_max == 1]
        assert mixed and all(r.age == 1 for r in mixed)                 # age counts the oldest token
        assert all(json.loads(r.weight_versions)[0]["version"] == "0" for r in mixed)
    finally:
        fleet.close()


def test_a_resumed_prefix_of_older_weights_can_be_masked_from_the_loss():
    """rollout.mask_offpolicy_in_partial_rollout (slime's flag, issue #37 item 8): sample 1 was
    cut after 3 tokens under version 4 and finished under 5; its 3 version-4 tokens carry no
    loss, its 4 version-5 tokens do; a sample of one version is untouched. The overlong filter
    still masks a truncated sample whole. Off (the default), nothing is masked."""
    from dapo_mega.driver.advantages import build_train_samples
    from dapo_mega.rollout.partial import offpolicy_prefix_mask

    pg = cut_group([reply([1, 2], 4, "stop", index=0), reply([5, 6, 7], 4, index=1)])
    done = pg.merge([reply([8, 9, 10, 11], 5, "stop")], "e1", 1.0)
    whole, resumed = done.group.samples
    assert offpolicy_prefix_mask(resumed) == [0, 0, 0, 1, 1, 1, 1] and offpolicy_prefix_mask(whole) is None
    for s, r in zip(done.group.samples, (1.0, -1.0)):
        s.score = SampleReward(r, r > 0)
    cfg = load_config(["cluster.max_sample_age=1", "rollout.mask_offpolicy_in_partial_rollout=true"])
    masked = build_train_samples([done.group], cfg.algo, mask_offpolicy=True)
    assert [t.response_loss_mask() for t in masked] == [[1, 1], [0, 0, 0, 1, 1, 1, 1]]
    assert all(t.loss_mask is None for t in build_train_samples([done.group], cfg.algo))
    with pytest.raises(ConfigError, match="rollout.mask_offpolicy_in_partial_rollout.*partial rollouts are off"):
        load_config(["rollout.mask_offpolicy_in_partial_rollout=true"])
