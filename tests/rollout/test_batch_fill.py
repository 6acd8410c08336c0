"""The step's batch fill (rollout/batch_fill.py) on hand-made groups, no engine: groups are
decided in prompt order, none after the batch is full is scored, and the keep-rate estimate
depends on the groups decided, not on how they were cut into requests."""

from dataclasses import dataclass, replace
from types import SimpleNamespace

from dapo_mega.reward import SampleReward
from dapo_mega.rollout.batch_fill import BatchFill, SamplingRule
from dapo_mega.rollout.manager import RolloutManager, RoundSettings
from dapo_mega.rollout.samples import Group, ScoredSample

G = 2


@dataclass
class Prompt:
    id: str
    prompt: list

    @classmethod
    def decode(cls, plain):  # a PromptDecoding
        return cls(**plain)


def group(prompt):
    samples = [ScoredSample(prompt_id=prompt.id, sample_index=j, token_ids=[j], logprobs=None, weight_versions=[],
                            response_text="", truncated=False, seed=None, engine_id="e", queue_delay_s=0.0,
                            generation_latency_s=0.0) for j in range(G)]
    return Group(prompt=prompt, prompt_input=prompt.prompt, samples=samples, engine_id="e", queue_delay_s=0.0,
                 latency_s=0.0)


def fill_of(stream, scored):
    """A fill for 2 groups where p<k> passes the filter for even k; `scored` logs each call."""
    def reward_fn(groups):
        scored.append([g.prompt_id for g in groups])
        return [[SampleReward(float(s.sample_index % 2), bool(s.sample_index % 2)) if int(g.prompt_id[1:]) % 2 == 0
                 else SampleReward(-1.0, False) for s in g.samples] for g in groups]
    mgr = RolloutManager(["http://127.0.0.1:1"], RoundSettings(n_samples=G, sampling_params={}))
    fill = BatchFill(1, 0, SimpleNamespace(score=reward_fn),
                     SamplingRule(train_batch_size=2, gen_batch_size=4, stream=stream), carried=[],
                     keep_rate=mgr.sampling.keep)
    return fill, mgr


def test_streamed_fill_decides_in_prompt_order_and_scores_nothing_after_the_batch():
    prompts = [Prompt(f"p{i}", [i]) for i in range(8)]
    groups = [group(p) for p in prompts]
    scored = []
    fill, _ = fill_of(True, scored)
    fill.start_round(prompts)
    assert fill.take(groups[4:8]) is False          # not the next in prompt order: left undecided
    assert fill.decided == 0 and scored == []
    assert fill.take(groups[0:4]) is True           # p0 kept, p1 rejected, p2 kept: full
    assert [g.prompt_id for g in fill.kept] == ["p0", "p2"] and fill.decided == 3
    assert scored == [["p0", "p1"], ["p2"]]         # at most the groups still needed at a time: p3 never scored
    assert [s.prompt_id for s in fill.samples] == ["p1"] * G
    assert fill.take(groups[4:8]) is True and fill.decided == 3   # after the batch: nothing more


def test_unstreamed_fill_decides_everything_and_keeps_the_surplus():
    prompts = [Prompt(f"p{i}", [i]) for i in range(6)]
    scored = []
    fill, _ = fill_of(False, scored)
    fill.start_round(prompts)
    assert fill.take([group(p) for p in prompts]) is True
    assert [g.prompt_id for g in fill.kept] == ["p0", "p2", "p4"] and fill.decided == 6 and len(scored) == 1


def test_keep_rate_does_not_depend_on_how_groups_were_cut_into_requests():
    prompts = [Prompt(f"p{i}", [i]) for i in range(8)]
    rates = []
    for size in (1, 3, 8):
        fill, mgr = fill_of(False, [])
        fill.rule = replace(fill.rule, train_batch_size=99)
        fill.start_round(prompts)
        groups = [group(p) for p in prompts]
        for i in range(0, len(groups), size):
            fill.take(groups[i:i + size])
        rates.append((mgr.sampling.keep_rate, mgr.sampling.keep.counts))
    assert rates[0] == rates[1] == rates[2]


def test_the_filter_metric_acc_drops_an_all_correct_group_that_score_keeps():
    """verl's `algorithm.filter_groups.metric` as algo.dynamic_sampling_metric: p0's two answers
    are both correct, one penalised for length (rewards 1.0 and 0.5); p1's differ in verdict.
    "acc" (the reference recipe) keeps p1 only; "score" keeps both, p0 having nonzero
    advantages. The run's config reaches the rule through SamplingRule.from_config alone."""
    import pytest

    from dapo_mega.config import ConfigError, load_config, validate_config

    def rewards(groups):
        return [[SampleReward(1.0, True), SampleReward(0.5, True)] if g.prompt_id == "p0"
                else [SampleReward(1.0, True), SampleReward(-1.0, False)] for g in groups]

    kept = {}
    for metric in ("acc", "score"):
        cfg = load_config([f"algo.dynamic_sampling_metric={metric}"])
        rule = SamplingRule.from_config(cfg.algo, cfg.cluster, train_batch_size=2)
        assert rule.metric == metric and rule.train_batch_size == 2
        mgr = RolloutManager(["http://127.0.0.1:1"], RoundSettings(n_samples=G, sampling_params={}))
        fill = BatchFill(1, 0, SimpleNamespace(score=rewards), rule, carried=[], keep_rate=mgr.sampling.keep)
        prompts = [Prompt("p0", [1]), Prompt("p1", [2])]
        fill.start_round(prompts)
        fill.take([group(p) for p in prompts])
        kept[metric] = [g.prompt_id for g in fill.kept]
        assert fill.counts["all_correct"] == (1 if metric == "acc" else 0)
    assert kept == {"acc": ["p1"], "score": ["p0", "p1"]}
    with pytest.raises(ConfigError, match="algo.dynamic_sampling_metric"):
        validate_config(load_config(["algo.dynamic_sampling_metric=seq_reward"]))


def test_a_bare_score_is_no_verdict_so_the_filter_reads_the_score():
    """Issue #37, item 7: a plugin's float carries no verdict. p0's answers are both wrong, one
    given a 0.1 format credit (rewards 0.1 and 0.0); p1's are both wrong and both formatted
    (0.1, 0.1). Before, `score > 0` read 0.1 as correct: p0 counted as a mixed group by its
    "verdicts" and p1 as all correct. Now neither has a verdict: the default metric "acc"
    falls back to the score for them (p0 varies: kept; p1 does not: dropped), counted as
    score-filtered, and no sample is correct."""
    def rewards(groups):
        return [[SampleReward(0.1, None), SampleReward(0.0, None)] if g.prompt_id == "p0"
                else [SampleReward(0.1, None), SampleReward(0.1, None)] for g in groups]

    mgr = RolloutManager(["http://127.0.0.1:1"], RoundSettings(n_samples=G, sampling_params={}))
    fill = BatchFill(1, 0, SimpleNamespace(score=rewards),
                     SamplingRule(train_batch_size=2, gen_batch_size=2, stream=False), carried=[],
                     keep_rate=mgr.sampling.keep)
    prompts = [Prompt("p0", [1]), Prompt("p1", [2])]
    fill.start_round(prompts)
    fill.take([group(p) for p in prompts])
    assert [g.prompt_id for g in fill.kept] == ["p0"]
    assert fill.counts["score_filtered_groups"] == 2
    assert all(s.correct is None for g in fill.kept for s in g.samples)
