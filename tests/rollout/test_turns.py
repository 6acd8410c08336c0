"""Multi-turn samples (rollout/turns.py, issue #39 item 2).

On the embedded engine with a test environment loaded by path (`vowel_env.py`: a turn ends at
a vowel, the environment answers `<turn:length>`): samples come back as several turns, the
environment's tokens are the tokenizer's encoding of its answers, carry log-prob 0 and are in
the loss mask's zeros, and every model token's log-prob is the one transformers computes with
the whole context before it (prompt, earlier turns, environment answers): the engine saw what
the sample says it saw. Then the pure rules: the budget, the seeds, the metrics, the ledger."""

import json
import re
from pathlib import Path

import pytest
import torch

from dapo_mega.aio import run_coroutine
from dapo_mega.config import DataConfig, RolloutConfig
from dapo_mega.data import PromptEncoder
from dapo_mega.data.problem import Problem
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.environments.base import StepResult, build_environment
from dapo_mega.records import ledger
from dapo_mega.records.console import format_console_line
from dapo_mega.rollout.manager import RolloutManager, RoundSettings
from dapo_mega.rollout.metrics import compute_rollout_metrics
from dapo_mega.rollout.samples import ScoredSample
from dapo_mega.rollout.turns import SEED_STRIDE, add_observation, turn_params

ENV = str(Path(__file__).with_name("vowel_env.py")) + ":VowelEnv"
BUDGET = 48


def problems(n):
    return [Problem(id=f"t{i}", prompt=f"{i}+{i}=", ground_truth=str(2 * i), data_source="test") for i in range(n)]


@pytest.fixture(scope="module")
def multi_turn(tiny_model_dir):
    fleet = EngineFleet(RolloutConfig(), str(tiny_model_dir), num_threads=1, weight_version="0")
    fleet.start(1)
    try:
        encoder = PromptEncoder.from_pretrained(tiny_model_dir, DataConfig(prompt_template="raw"))
        env = build_environment(ENV, {"done_after": 3})
        settings = RoundSettings(n_samples=3, sampling_params={"max_new_tokens": BUDGET, "temperature": 1.0},
                                 environment=env, max_turns=4, seed=3, prompts_per_request=2)
        mgr = RolloutManager(fleet.endpoints, settings, encoder)
        groups = run_coroutine(mgr.generate_groups(problems(4)))
        yield groups, encoder, mgr
    finally:
        fleet.close()


def test_samples_come_back_as_turns_with_the_environment_answers_masked(multi_turn):
    groups, encoder, _ = multi_turn
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 12 and max(s.turns for s in samples) >= 2, [s.turns for s in samples]
    for s in samples:
        assert 1 <= s.turns <= 4 and len(s.token_ids) <= BUDGET and len(s.logprobs) == len(s.token_ids)
        assert s.tool_calls == len(s.env_spans) and s.turns <= len(s.env_spans) + 1
        observations = re.findall(r"<\d+:\d+>", s.response_text)
        assert len(observations) == s.tool_calls
        for (start, end), text in zip(s.env_spans, observations):
            assert s.token_ids[start:end] == encoder.encode_text(text)[:end - start]
            assert s.logprobs[start:end] == [0.0] * (end - start)
            assert s.response_text.count(text) >= 1
        mask = s.env_mask()
        assert mask is None or sum(mask) == len(s.token_ids) - s.env_tokens
        # a turn that went on ended at one of the environment's stop strings, kept in the text
        for start, _ in s.env_spans:
            assert encoder.tokenizer.decode(s.token_ids[start - 1:start]) in "aeiou"
        assert s.env_tokens + sum(mask or [1] * len(s.token_ids)) == len(s.token_ids)


def test_every_model_token_was_sampled_from_the_whole_context_before_it(multi_turn, tiny_model_dir):
    """transformers' log-probs of the sample as one sequence equal the engine's at every model
    token: the continuation requests carried the prompt, the earlier turns and the answers."""
    from transformers import AutoModelForCausalLM

    groups, _, _ = multi_turn
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    worst, compared = 0.0, 0
    for g in groups:
        for s in (s for s in g.samples if s.turns >= 2):
            ids = torch.tensor([list(g.prompt_input) + s.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            p = len(g.prompt_input)
            ref = logp[p - 1:, :].gather(1, ids[0, p:, None])[:, 0]
            for t, keep in enumerate(s.env_mask()):
                if keep:
                    worst = max(worst, abs(float(ref[t]) - s.logprobs[t]))
                    compared += 1
    assert compared > 20 and worst < 2e-3, (compared, worst)


def test_the_ledger_and_the_step_metrics_carry_the_turns(multi_turn, tmp_path):
    groups, _, _ = multi_turn
    samples = [s for g in groups for s in g.samples]
    rows = [ledger.ledger_record(s, "run") for s in samples]
    ledger.write_step(tmp_path, 0, rows)
    back = ledger.read_records(tmp_path)  # through parquet: one row per sample, with its turns
    assert len(back) == len(samples)
    for s, r in zip(samples, back):
        assert r.turns == s.turns and r.tool_calls == s.tool_calls and r.env_tokens == s.env_tokens
        assert json.loads(r.env_spans or "[]") == s.env_spans
        assert json.loads(r.tool_errors or "{}") == s.tool_errors
    m = compute_rollout_metrics(samples, seconds=1.0, multi_turn=True)
    assert "rollout/turns_mean" not in compute_rollout_metrics(samples, seconds=1.0)
    assert m["rollout/turns_mean"] == pytest.approx(sum(s.turns for s in samples) / len(samples))
    assert m["rollout/tool_calls"] == sum(s.tool_calls for s in samples)
    assert m["rollout/env_tokens"] + m["rollout/model_tokens"] == m["rollout/generated_tokens"]
    line = format_console_line({"step": 1, **m})
    assert "turns " in line and "tool_err " in line


def _sample(tokens, **kw):
    return ScoredSample(prompt_id="p", sample_index=1, token_ids=list(tokens), logprobs=[-1.0] * len(tokens),
                        weight_versions=[], response_text="x" * len(tokens), truncated=False, seed=None,
                        engine_id="e", queue_delay_s=0.0, generation_latency_s=0.0, **kw)


def test_an_answer_that_does_not_fit_the_budget_is_cut_and_the_sample_truncated():
    result = StepResult(observation="<out>", done=False, tool_calls=1, tool_errors={"timeout": 1}, tool_time_s=2.0,
                        reward_parts={"format": 0.5})
    s = add_observation(_sample([1, 2, 3], tool_errors={"timeout": 1}), result, [7, 8, 9, 10], budget=5)
    assert s.token_ids == [1, 2, 3, 7, 8] and s.env_spans == [[3, 5]] and s.truncated
    assert s.logprobs == [-1.0] * 3 + [0.0] * 2 and s.env_mask() == [1, 1, 1, 0, 0]
    assert s.tool_errors == {"timeout": 2} and s.tool_time_s == 2.0 and s.turn_rewards == [0.5]
    assert s.turn_text_at == len("xxx<out>")
    fits = add_observation(_sample([1, 2, 3]), result, [7, 8], budget=10)
    assert not fits.truncated and fits.env_spans == [[3, 5]]


def test_a_turn_asks_for_the_budget_left_with_its_own_seed():
    s = _sample([1] * 10, turns=2)
    params = turn_params({"n": 3, "max_new_tokens": 48, "sampling_seed": 100, "stop": ["a"]}, s, 48)
    assert params["n"] == 1 and params["max_new_tokens"] == 38 and params["stop"] == ["a"]
    assert params["sampling_seed"] == 100 + 1 + 2 * SEED_STRIDE
    assert "sampling_seed" not in turn_params({"n": 3, "max_new_tokens": 48}, s, 48)


def test_the_settings_stop_every_turn_at_the_environment_strings_and_keep_them():
    env = build_environment(ENV, {})
    s = RoundSettings(n_samples=2, sampling_params={"max_new_tokens": 8, "stop": ["\n\n"]}, environment=env)
    assert s.sampling_params["stop"] == ["\n\n", *"aeiou"] and s.sampling_params["no_stop_trim"] is True
    with pytest.raises(TypeError, match="encode_text"):
        RolloutManager(["http://127.0.0.1:1"], s)


class _Broken:
    stop = ["a"]

    def reset(self, problem):
        pass

    def step(self, model_text):
        raise KeyError("boom")


class _Chars:
    """encode_text for the pure tests: one id per character; a chat framing of a tool answer."""

    @staticmethod
    def encode_text(text):
        return [ord(c) for c in text]

    @staticmethod
    def tool_message(texts, after=None):
        return "".join(f"|T|{text}|/T|" for text in texts)


def _reply(tokens, text, reason):
    from dapo_mega.engines.sglang.client import SampleResult

    return SampleResult(prompt_index=0, sample_index=0, text=text, output_ids=list(tokens), token_ids=list(tokens),
                        finish_reason=reason, logprobs=[-0.5] * len(tokens),
                        weight_versions=[{"version": "3", "start": 0, "end": len(tokens)}], prompt_tokens=2,
                        completion_tokens=len(tokens))


def _episodes(env, budget=12, chat=False):
    from dapo_mega.rollout.partial import PartialGroup
    from dapo_mega.rollout.samples import Group
    from dapo_mega.rollout.turns import Episodes

    stopped = _reply([1, 2, 97], "xya", {"type": "stop", "matched": "a"})
    answered = _reply([5, 6], "zz", {"type": "stop", "matched": 0})
    samples = [replace_sample(_sample([1, 2, 97]), sample_index=0, response_text="xya",
                              weight_versions=[{"version": "3", "start": 0, "end": 3}]),
               replace_sample(_sample([5, 6]), sample_index=1, response_text="zz")]
    group = Group(prompt=problems(1)[0], prompt_input=[40, 41], samples=samples, engine_id="e", queue_delay_s=0.0,
                  latency_s=0.0)
    return Episodes(env, _Chars(), 3, [PartialGroup(group, [], budget)], {(0, 0): stopped, (0, 1): answered},
                    [{"n": 2, "max_new_tokens": budget, "sampling_seed": 10}], budget, chat=chat)


def answer_and_go_on(episodes):
    """The environment's answers to the samples whose tool is pending, then the next turns of
    those that go on: [(state, turn)] (what each episode does between two of its turns)."""
    async def run():
        going = [st for st in episodes.pending() if await episodes.answer(st)]
        return [(st, episodes.next_turn(st)) for st in going]
    return run_coroutine(run())


def replace_sample(s, **kw):
    from dataclasses import replace

    return replace(s, **kw)


def test_a_turn_that_stopped_goes_on_with_the_answer_in_its_context():
    episodes = _episodes(build_environment(ENV, {"stops": "a"}))
    # only sample 0 stopped at the environment's string; sample 1 answered (EOS)
    ((st, turn),) = answer_and_go_on(episodes)
    assert st.key == (0, 0)
    answer = [ord(c) for c in "<1:3>"]
    assert turn.input == [40, 41, 1, 2, 97] + answer
    assert turn.params["n"] == 1 and turn.params["max_new_tokens"] == 12 - 3 - 5
    sample = episodes.sample(st)
    assert sample.env_spans == [[3, 8]] and sample.tool_calls == 1 and sample.turn_text_at == len("xya<1:3>")
    assert not episodes.take(st, _reply([7, 8], "bc", {"type": "length", "length": 2}), "e", 0.1)
    sample = episodes.sample(st)
    assert sample.turns == 2 and sample.token_ids == [1, 2, 97, *answer, 7, 8]
    assert sample.weight_versions == [{"version": "3", "start": 0, "end": 3}, {"version": "3", "start": 8, "end": 10}]
    assert answer_and_go_on(episodes) == []  # it ended at the length limit


def test_an_environment_that_raises_fails_the_round_naming_it():
    from dapo_mega.rollout.turns import EnvironmentFailed

    with pytest.raises(EnvironmentFailed, match=r"_Broken.step raised KeyError.*prompt p, sample 0"):
        answer_and_go_on(_episodes(_Broken()))


@pytest.mark.parametrize("overrides, field, named", [
    (["rollout.environment=nope.mod:X"], "rollout.environment", "'nope.mod:X' cannot be imported"),
    (["rollout.environment=python", "+rollout.environment_kwargs.walls=3"], "rollout.environment_kwargs",
     "{'walls': 3} do not fit 'python'"),
    (["+rollout.environment_kwargs.wall_s=3"], "rollout.environment_kwargs", "['wall_s'] given"),
    (["rollout.environment=python", "rollout.max_turns=0"], "rollout.max_turns", "must be >= 1"),
    ([f"rollout.environment={ENV.replace('VowelEnv', 'Seen')}"], "rollout.environment", "is not an environment class"),
])
def test_a_bad_environment_setting_is_refused_before_anything_is_built(overrides, field, named):
    from dapo_mega.config import ConfigError, load_config, validate_config
    from dapo_mega.plan.preflight import check_environment

    with pytest.raises(ConfigError) as info:
        cfg = load_config(overrides)
        validate_config(cfg)
        check_environment(cfg)  # dapo-mega train's and eval's preflight
    assert str(info.value).startswith(field + ":") and named in str(info.value), str(info.value)


def test_the_tool_task_without_the_tool_is_refused():
    from dapo_mega.config import ConfigError, load_config, validate_config

    with pytest.raises(ConfigError, match=r"^data.synthetic_task: is sum_tool.*rollout.environment=python"):
        validate_config(load_config(["data.synthetic_task=sum_tool"]))
    validate_config(load_config(["data.synthetic_task=sum_tool", "rollout.environment=python"]))


def test_in_chat_form_the_answer_is_framed_as_the_templates_tool_turn():
    """rollout.tool_message=chat: the encoding's framing (PromptEncoder.tool_message, held to
    Qwen2.5's template in tests/data/test_prompt_encoder.py) goes around the answer, in the
    tokens and the text, and all of it is the environment's (masked)."""
    episodes = _episodes(build_environment(ENV, {"stops": "a"}), budget=40, chat=True)
    ((st, turn),) = answer_and_go_on(episodes)
    framed = "|T|<1:3>|/T|"
    assert turn.input == [40, 41, 1, 2, 97] + [ord(c) for c in framed]
    sample = episodes.sample(st)
    assert sample.env_spans == [[3, 3 + len(framed)]] and sample.response_text == "xya" + framed


def test_the_turns_rewards_fold_by_the_rule_the_config_names():
    """Each environment answer's reward parts, summed, are one turn's reward (0.0 for an answer
    without reward; none for the answer that only ends the episode); rollout.turn_reward folds
    them: by hand, for rewards 0.5, 0.0 (a plain answer) and -1 + 2 (two parts of one answer)."""
    from dapo_mega.config import ConfigError, RolloutConfig
    from dapo_mega.rollout.turns import fold_turn_rewards

    s = _sample([1])
    for parts, ids in (({"format": 0.5}, [2]), ({}, [3]), ({"a": -1.0, "b": 2.0}, [4])):
        s = add_observation(s, StepResult(observation="o", done=False, reward_parts=parts), ids, budget=10)
    ended = add_observation(s, StepResult(observation="", done=True), [], budget=10)  # the model's final answer
    assert s.turn_rewards == ended.turn_rewards == [0.5, 0.0, 1.0]
    expected = {"sum": 1.5, "mean": 0.5, "last": 1.0, "max": 1.0, "min": 0.0}
    assert {rule: fold_turn_rewards(s.turn_rewards, rule) for rule in expected} == expected
    assert fold_turn_rewards([], "mean") == 0.0
    with pytest.raises(ConfigError, match="rollout.turn_reward"):
        RolloutConfig(turn_reward="median").validate()
