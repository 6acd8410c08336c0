"""RolloutSource (prompts -> encode -> generate -> score -> filter) and AsyncRollouts (on a thread)."""

import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "driver"))  # the driver tests' sample builders
from helpers_driver import group, sample  # noqa: E402

from dapo_mega.config import DapoConfig  # noqa: E402
from dapo_mega.data import Problem, PromptIterator
from dapo_mega.reward import build_verifier
from dapo_mega.rollout.samples import Group
from dapo_mega.rollout.source import AsyncRollouts, RolloutBatch, RolloutSource


class CharEncoder:
    """One id per character: prompt length = len(text)."""

    def encode(self, problem):
        return [ord(c) % 50 for c in problem.prompt]


class EchoManager:
    """A rollout manager whose engine answers each prompt's k-th sample with `answers[k]`."""

    def __init__(self, answers, lengths):
        self.answers, self.lengths = answers, lengths
        self.metrics = {"rollout/gen_batches": 1}
        self.settings = SimpleNamespace(environment=None)  # one turn per sample
        self.prompts_seen = []

    def collect_step(self, step, learner_version, inputs, rule):
        prompts = inputs.draw(rule.gen_batch_size)
        self.prompts_seen += [p.id for p in prompts]
        groups = []
        for p in prompts:
            samples = [sample(p.id, k, [1] * n) for k, n in enumerate(self.lengths)]
            for s, text in zip(samples, self.answers):
                s.response_text = text
            groups.append(Group(prompt=p, prompt_input=[1], samples=samples, engine_id="e", queue_delay_s=0.0,
                                latency_s=0.0))
        for g, rewards in zip(groups, inputs.score(groups)):
            for s, r in zip(g.samples, rewards):
                s.score = r
        return groups, [s for g in groups for s in g.stamp(step, learner_version)]

    def state_dict(self):
        return {"carry": []}


def problems():
    # prompts of 5 characters fit max_prompt_length=8; the 20-character ones do not
    return [Problem(f"p{i}", "x" * (20 if i % 3 == 0 else 5), ground_truth="46", data_source="t") for i in range(12)]


def test_collect_skips_long_prompts_and_scores_with_the_verifier():
    cfg = DapoConfig()
    cfg.algo.max_prompt_length, cfg.algo.gen_batch_size, cfg.algo.train_batch_size = 8, 4, 4
    cfg.algo.max_response_length, cfg.algo.overlong_buffer_length, cfg.algo.overlong_penalty_factor = 20, 4, 1.0
    cfg.data.prompt_template = "raw"
    manager = EchoManager(answers=["Answer: 46", "Answer: 45", "Answer: 46"], lengths=[3, 3, 18])
    source = RolloutSource(cfg, PromptIterator(problems(), seed=0, shuffle=False), CharEncoder(),
                           build_verifier("dapo"), manager)
    batch = source.collect(step=1, learner_version=0)
    assert isinstance(batch, RolloutBatch) and batch.step == 1
    assert manager.prompts_seen == ["p1", "p2", "p4", "p5"]           # p0 and p3 are too long
    assert batch.metrics["data/prompts_too_long"] == 2.0
    # correctness +1 / -1 / +1, overlong penalty (16 - 18) / 4 = -0.5 on the 18-token answer
    assert [s.reward for s in batch.samples[:3]] == [1.0, -1.0, 0.5]
    assert batch.samples[2].score.overlong_penalty == -0.5 and batch.samples[2].score.verifier == "dapo"
    assert batch.metrics["verifier/num_responses"] == 12.0
    assert batch.metrics["rollout/num_samples"] == 12.0
    assert batch.data_cursor == source.prompts.state_dict()


class CountingSource:
    """Records the engine version each step was generated at."""

    def __init__(self, fail_at=None):
        self.started = []
        self.fail_at = fail_at

    def collect(self, step, learner_version, num_groups=None):
        if step == self.fail_at:
            raise ValueError("engine on fire")
        refill = num_groups is not None  # a refill of `step` after stale groups were dropped
        self.started.append((step, learner_version) + (("refill",) if refill else ()))
        kept = group(f"{'f' if refill else 's'}{step}", [1.0, -1.0], version=learner_version)
        rejected = group(f"r{step}", [1.0, 1.0], version=learner_version)
        rejected.set_reasons(["all_correct_group"] * 2)
        samples = rejected.stamp(step, learner_version) + kept.stamp(step, learner_version)
        return RolloutBatch(step=step, groups=[kept], samples=samples)


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_async_generation_waits_for_the_engines_version():
    source = CountingSource()
    rollouts = AsyncRollouts(source, first_step=1, last_step=4, max_staleness=1, engine_version=0)
    try:
        # k = 1: steps 1 and 2 may start at version 0; step 3 needs version 1
        assert wait_for(lambda: len(source.started) == 2)
        time.sleep(0.2)
        assert source.started == [(1, 0), (2, 0)]
        batch = rollouts.take(1, learner_version=0)
        assert [g.prompt_id for g in batch.groups] == ["s1"] and batch.metrics["rollout/stale_groups"] == 0
        rollouts.engines_serve(1)
        assert wait_for(lambda: len(source.started) == 3) and source.started[2] == (3, 1)
        # step 2 consumed at version 1: its tokens (version 0) are 1 old, within k
        batch = rollouts.take(2, learner_version=1)
        assert [g.prompt_id for g in batch.groups] == ["s2"]
        kept = [s for s in batch.samples if s.reject_reason == "kept"]
        assert len(batch.samples) == 4 and len(kept) == 2            # no row twice
        assert all(s.learner_version == 1 and s.age == 1 for s in kept)
        # step 3 consumed at version 3: 2 versions old > k, dropped as stale and refilled at version 3
        rollouts.engines_serve(3)
        batch = rollouts.take(3, learner_version=3)
        assert [g.prompt_id for g in batch.groups] == ["f3"] and batch.metrics["rollout/stale_groups"] == 1
        assert batch.metrics["rollout/refilled_groups"] == 1 and (3, 3, "refill") in source.started
        assert sorted(s.reject_reason for s in batch.samples) == ["all_correct_group"] * 4 + ["kept"] * 2 + \
            ["stale"] * 2
        assert all(s.age == 0 for s in batch.samples if s.reject_reason == "kept")
    finally:
        rollouts.stop()


def test_async_failure_reaches_the_main_thread_and_stop_is_prompt():
    rollouts = AsyncRollouts(CountingSource(fail_at=2), first_step=1, last_step=3, max_staleness=2, engine_version=0)
    try:
        rollouts.take(1, learner_version=0)
        with pytest.raises(RuntimeError, match="engine on fire"):
            rollouts.take(2, learner_version=1)
    finally:
        rollouts.stop()
    waiting = AsyncRollouts(CountingSource(), first_step=5, last_step=6, max_staleness=0, engine_version=0)
    t = time.monotonic()
    waiting.stop()                                          # blocked on version 4: wakes up and ends
    assert time.monotonic() - t < 5 and not any(t.name == "rollouts" and t.is_alive() for t in threading.enumerate())


def test_the_queue_and_the_age_limit_are_two_settings():
    """cluster.max_staleness=2 (generation runs two versions ahead) with max_sample_age=0: the
    batches generated ahead are too old when consumed, dropped as stale and refilled at the
    engines' version, so every trained sample is on-policy while the queue stays as it was."""
    source = CountingSource()
    rollouts = AsyncRollouts(source, first_step=1, last_step=3, max_staleness=2, engine_version=0, max_sample_age=0)
    try:
        assert wait_for(lambda: len(source.started) == 3)  # all three steps start at version 0: the queue
        assert source.started == [(1, 0), (2, 0), (3, 0)]
        batch = rollouts.take(1, learner_version=0)
        assert [g.prompt_id for g in batch.groups] == ["s1"] and batch.metrics["rollout/refilled_groups"] == 0
        rollouts.engines_serve(1)
        batch = rollouts.take(2, learner_version=1)  # generated at 0, 1 old > 0: refilled at version 1
        assert [g.prompt_id for g in batch.groups] == ["f2"] and (2, 1, "refill") in source.started
        assert batch.metrics["age/0/num_samples"] == 2 and "age/1/num_samples" in batch.metrics  # the stale ones
        assert all(s.age == 0 for s in batch.samples if s.reject_reason == "kept")
    finally:
        rollouts.stop()


def test_a_reward_plugin_is_given_each_samples_problem(tmp_path, monkeypatch):
    """The step's scoring hands the plugin the problem of each sample (reward.problem_metadata)."""
    (tmp_path / "meta_plugin.py").write_text(
        "from dapo_mega.reward.plugin import RewardResult\n\n"
        "def score(response, ground_truth, metadata):\n"
        "    return RewardResult(score=1.0, correct=True, extracted=metadata['id'] + '|' + metadata['prompt'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    cfg = DapoConfig()
    cfg.algo.max_prompt_length, cfg.algo.gen_batch_size, cfg.algo.train_batch_size = 8, 4, 4
    cfg.algo.dynamic_sampling = False
    cfg.data.prompt_template = "raw"
    manager = EchoManager(answers=["Answer: 46"] * 2, lengths=[3, 3])
    source = RolloutSource(cfg, PromptIterator(problems(), seed=0, shuffle=False), CharEncoder(),
                           build_verifier("meta_plugin:score"), manager)
    batch = source.collect(step=1, learner_version=0)
    by_id = {p.id: p.prompt for p in problems()}
    assert batch.samples and all(s.score.extracted == f"{s.prompt_id}|{by_id[s.prompt_id]}" for s in batch.samples)
