"""Typed samples: versions and age from the engine's spans, plain-data round trip, old checkpoints."""

from dataclasses import dataclass

from dapo_mega.reward import SampleReward
from dapo_mega.rollout.samples import Group, ScoredSample, drop_stale_groups


@dataclass
class Prompt:
    id: str
    prompt: str
    dataset_revision: str = "rev"

    @classmethod
    def decode(cls, plain):  # a PromptDecoding
        return cls(**plain)


class Ords:
    @staticmethod
    def encode(prompt):  # a PromptEncoding
        return [ord(c) for c in prompt.prompt]


def make(versions, reward=1.0):
    spans = [{"version": str(v), "start": i, "end": i + 1} for i, v in enumerate(versions)]
    return ScoredSample(prompt_id="p", sample_index=0, token_ids=[5] * len(versions), logprobs=[-1.0] * len(versions),
                        weight_versions=spans, response_text="x", truncated=False, seed=3, engine_id="e",
                        queue_delay_s=0.0, generation_latency_s=0.1, score=SampleReward(reward, reward > 0))


def test_versions_age_and_stale_groups():
    s = make([2, 2, 3])
    s.learner_version = 4
    assert (s.policy_version_min, s.policy_version_max, s.age, s.response_length) == (2, 3, 2, 3)
    assert make([]).policy_version_min == 0                  # an engine that reports no spans: version 0
    g_old = Group(Prompt("a", "q"), [1], [make([1, 2])], "e", 0.0, 0.1)
    g_new = Group(Prompt("b", "q"), [1], [make([3])], "e", 0.0, 0.1)
    fresh, stale = drop_stale_groups([g_old, g_new], learner_version=3, max_staleness=1)
    assert fresh == [g_new] and stale == [g_old] and g_old.reasons == ["stale"]
    assert g_new.stamp(5, 3)[0].step == 5 and g_new.samples[0].learner_version == 3


def test_round_trip_and_checkpoints_written_before_typed_samples():
    g = Group(Prompt("a", "q"), [7, 8], [make([1]), make([1], reward=-1.0)], "e", 0.5, 0.25, gen_round=2)
    g.samples[1].reject_reason = "verifier_error"
    back = Group.from_dict(g.to_dict(), Prompt)
    assert back == g
    # the carry-over as checkpoints held it before: engine replies beside reward dicts
    old = {"prompt": {"id": "a", "prompt": "q", "dataset_revision": "rev"}, "engine_id": "e", "queue_delay_s": 0.5,
           "latency_s": 0.25, "gen_round": 2,
           "rewards": [{"reward": -1.5, "correct": False, "error": None, "verifier": "dapo", "verifier_version": "1",
                        "components": {"correctness": -1.0, "overlong_penalty": -0.5}}],
           "samples": [{"prompt_index": 0, "sample_index": 1, "text": " 4", "output_ids": [9], "token_ids": [9, 2],
                        "finish_reason": {"type": "length"}, "logprobs": [-0.1, -0.2],
                        "weight_versions": [{"version": "3", "start": 0, "end": 2}], "prompt_tokens": 2,
                        "completion_tokens": 2, "meta_info": {"e2e_latency": 0.125}}]}
    legacy = Group.from_dict(old, Prompt, Ords())
    s = legacy.samples[0]
    assert legacy.prompt_input == [ord("q")] and legacy.gen_round == 2
    assert (s.token_ids, s.logprobs, s.truncated, s.response_text, s.generation_latency_s) == (
        [9, 2], [-0.1, -0.2], True, " 4", 0.125)
    assert s.score == SampleReward(-1.5, False, -1.0, -0.5, "dapo", "1") and s.policy_version_min == 3


def test_a_problem_gets_the_revision_the_manager_was_given():
    """The data's `Problem` carries no revision: the run's (the manager's argument) fills the
    row, and a prompt that carries its own keeps it."""
    from dapo_mega.data.problem import Problem
    from dapo_mega.engines.sglang.client import SampleResult
    from dapo_mega.rollout.round import scored_sample

    reply = SampleResult(prompt_index=0, sample_index=1, text=" 4", output_ids=[7], token_ids=[7],
                         finish_reason={"type": "stop"}, logprobs=[-0.5], weight_versions=[], prompt_tokens=3,
                         completion_tokens=1)
    problem = Problem(id="p1", prompt="2+2=", ground_truth="4", data_source="synthetic_arithmetic")
    sample = scored_sample(reply, problem, 5, "e", 0.0, 0.1, 0, dataset_revision="04f16f7a7ae9")
    assert sample.dataset_revision == "04f16f7a7ae9" and sample.prompt_id == "p1" and sample.seed == 5
    own = scored_sample(reply, Prompt("p2", "x", "r2"), None, "e", 0.0, 0.1, 0, dataset_revision="run")
    assert own.dataset_revision == "r2"
