"""Agent code drives episodes through the OpenAI-compatible endpoint (issue #47 item 4).

The agent is written against the `openai` client package, as users write theirs; the endpoint
runs over a real embedded engine. References: the tokenizer's own chat template rendering the
whole conversation, and transformers' log-probs of the assembled sample.
"""

from __future__ import annotations

import asyncio

import openai  # the dev extra installs it
import pytest
import torch

from dapo_mega.aio import run_coroutine
from dapo_mega.config import DataConfig, ModelConfig, RolloutConfig
from dapo_mega.data import PromptEncoder
from dapo_mega.data.problem import Problem
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.models.tiny import build_tiny_model_dir
from dapo_mega.rollout.openai_endpoint import AgentEndpoint

PROBLEM = Problem(id="p", prompt="2+2=", ground_truth="4", data_source="t")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = build_tiny_model_dir(tmp_path_factory.mktemp("chat_tiny") / "tiny",
                                     ModelConfig(tiny_chat_template=True), seed=5)
    fleet = EngineFleet(RolloutConfig(health_timeout_s=120), str(model_dir), num_threads=1, weight_version="3")
    (engine,) = fleet.start(1)
    try:
        yield model_dir, engine, PromptEncoder.from_pretrained(model_dir, DataConfig(prompt_template="raw",
                                                                                     apply_chat_template=True))
    finally:
        fleet.close()


def drive(engine, encoder, agent):
    """Run `agent(endpoint)` against a started endpoint; the endpoint after it closed."""
    async def run():
        endpoint = AgentEndpoint(engine, encoder, {"temperature": 1.0})
        await endpoint.start()
        try:
            result = await agent(endpoint)
        finally:
            await endpoint.close()
        return endpoint, result
    return run_coroutine(run())


def test_an_openai_agent_episode_trains_on_the_engines_own_tokens(served):
    model_dir, engine, encoder = served

    async def agent(endpoint):
        client = openai.AsyncOpenAI(base_url=endpoint.base_url("e1"), api_key="-", max_retries=0)
        messages = [{"role": "user", "content": "2+2="}]
        replies = []
        for turn in range(3):
            r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, seed=11 + turn)
            replies.append(r)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "tool" if turn == 0 else "user", "content": f"<{turn}>"}]
        await client.close()
        calls = [list(c.reply.token_ids) for c in endpoint.episodes["e1"].branches[0]]
        return messages[:-1], replies, calls, list(endpoint.episodes["e1"].branches[0])

    endpoint, (conversation, replies, calls, endpoint_calls) = drive(engine, encoder, agent)
    ((prompt_ids, sample),) = endpoint.take_episode("e1", PROBLEM)
    assert [r.usage.completion_tokens for r in replies] == [len(c) for c in calls]
    # every reply holds OpenAI's schema to the letter (clients that validate it, verifiers', need that)
    # and its log-probs are the engine's, token by token
    from openai.types.chat import ChatCompletion

    for r, c in zip(replies, endpoint_calls):
        strict = ChatCompletion.model_validate(r.model_dump(exclude_unset=True), strict=True)
        assert [t.logprob for t in strict.choices[0].logprobs.content] == c.reply.logprobs
    assert sample.turns == 3 and len(sample.env_spans) == 2 and sample.prompt_id == "p"
    # the model's tokens are the engine's replies, in order, with the agent's messages between
    mask = sample.env_mask()
    assert [t for t, keep in zip(sample.token_ids, mask) if keep] == [t for c in calls for t in c]
    # the whole stream is the chat template's rendering of the conversation (up to the last reply)
    tok = encoder.tokenizer
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert rendered == tok.decode(prompt_ids + sample.token_ids, skip_special_tokens=True) + "<|im_end|>\n"
    # transformers' log-probs of the sample as one sequence equal the engine's at every model token
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + sample.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    ref = logp[len(prompt_ids) - 1:].gather(1, ids[0, len(prompt_ids):, None])[:, 0]
    diffs = [abs(float(ref[t]) - sample.logprobs[t]) for t, keep in enumerate(mask) if keep]
    assert len(diffs) == sum(map(len, calls)) and max(diffs) < 1e-4, max(diffs)
    assert all(lp == 0.0 for lp, keep in zip(sample.logprobs, mask) if not keep)
    assert {s["version"] for s in sample.weight_versions} == {"3"}


def test_a_rewritten_history_begins_a_branch_and_text_completions_continue_theirs(served):
    _, engine, encoder = served

    async def agent(endpoint):
        client = openai.AsyncOpenAI(base_url=endpoint.base_url("e2"), api_key="-", max_retries=0)
        first = await client.completions.create(model="policy", prompt="Q: 1+1=", max_tokens=5, seed=1)
        again = await client.completions.create(model="policy", prompt="Q: 1+1=" + first.choices[0].text + " ok?",
                                                max_tokens=5, seed=2)
        other = await client.completions.create(model="policy", prompt="Q: 2+2=", max_tokens=5, seed=3)
        models = await client.models.list()
        with pytest.raises(openai.BadRequestError, match="one choice per call"):
            await client.completions.create(model="policy", prompt="x", max_tokens=2, n=2)
        await client.close()
        return first, again, other, [m.id for m in models.data]

    endpoint, (first, again, other, models) = drive(engine, encoder, agent)
    assert models == ["policy"]
    (p1, s1), (p2, s2) = endpoint.take_episode("e2", PROBLEM)
    assert encoder.tokenizer.decode(p1) == "Q: 1+1=" and encoder.tokenizer.decode(p2) == "Q: 2+2="
    n = again.usage.completion_tokens
    assert s1.turns == 2 and s1.env_spans == [[len(s1.token_ids) - n - len(" ok?"), len(s1.token_ids) - n]]
    assert s1.response_text == first.choices[0].text + " ok?" + again.choices[0].text
    assert s2.turns == 1 and s2.response_text == other.choices[0].text
    assert endpoint.take_episode("e2", PROBLEM) == []  # taken once


@pytest.mark.parametrize("overrides, named", [
    (["rollout.agent=nope.mod:X"], "rollout.agent: 'nope.mod:X' cannot be imported"),
    (["rollout.agent=json:loads"], "rollout.agent: 'json:loads' is not an agent class"),
    ([f"rollout.agent={__file__.replace('test_openai_endpoint.py', 'openai_agent.py')}:Continue",
      "+rollout.agent_kwargs.turns=2"], "rollout.agent_kwargs: {'turns': 2} do not fit"),
    (["rollout.agent=a.b:C", "rollout.environment=python"], "rollout.agent: is 'a.b:C' with rollout.environment"),
    (["+rollout.agent_kwargs.calls=2"], "rollout.agent_kwargs: ['calls'] given, but rollout.agent is empty"),
])
def test_a_bad_agent_setting_is_refused_naming_it(overrides, named):
    from dapo_mega.config import ConfigError, load_config, validate_config
    from dapo_mega.plan.preflight import check_environment

    with pytest.raises(ConfigError) as info:
        cfg = load_config(overrides)
        validate_config(cfg)
        check_environment(cfg)
    assert named in str(info.value), str(info.value)


class Counted:
    """An agent of text completions: problem t0's episodes make 2 calls, the others up to 200;
    every call made is counted, and what ended each episode."""

    calls: dict = {}
    ended: list = []

    async def run(self, problem, base_url):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
        text = problem.prompt
        try:
            for _ in range(2 if problem.id == "t0" else 200):
                reply = await client.completions.create(model="policy", prompt=text, max_tokens=4)
                Counted.calls[problem.id] = Counted.calls.get(problem.id, 0) + 1
                text += reply.choices[0].text + "\n"
            Counted.ended.append("done")
        except openai.APIStatusError as exc:
            Counted.ended.append(exc.status_code)
            raise
        except asyncio.CancelledError:
            Counted.ended.append("cancelled")
            raise
        finally:
            await client.close()


def test_a_stop_refuses_the_agents_next_calls_and_their_prompts_go_back_unsent(served):
    """The round stops once the first chunk is read: the agents of the chunk in flight get 503
    on their next call (a call running then is aborted), the chunk is set aside and its prompts
    are unsent with the one never sent; the round does not wait for the 200 calls. The first
    agent refused ends the chunk: its sibling is refused too or cancelled where it waits."""
    from dapo_mega.rollout.manager import RolloutManager, RoundSettings

    _, engine, encoder = served
    Counted.calls.clear()
    Counted.ended.clear()
    settings = RoundSettings(n_samples=2, sampling_params={"max_new_tokens": 64, "temperature": 1.0},
                             agent=Counted(), prompts_per_request=1, requests_per_engine=2)
    manager = RolloutManager([engine], settings, encoder)
    prompts = [Problem(id=f"t{i}", prompt=f"{i}+{i}=", ground_truth=str(2 * i), data_source="t") for i in range(3)]

    async def run():
        async with manager.round(prompts, 0) as rnd:
            async for groups in rnd:
                assert [g.prompt_id for g in groups] == ["t0"]
                rnd.stop()
        return rnd.outcome

    out = run_coroutine(run())
    assert out.stopped and list(out.groups) == [0] and sorted(p.id for p in out.unsent) == ["t1", "t2"]
    assert Counted.calls["t0"] == 4 and 0 < Counted.calls.get("t1", 0) < 100, Counted.calls
    assert Counted.ended[:2] == ["done", "done"] and "t2" not in Counted.calls, Counted.ended
    assert Counted.ended[2] == 503 and set(Counted.ended[3:]) <= {503, "cancelled"}, Counted.ended
    assert out.partials == {}


def test_an_engine_lost_under_an_agent_is_the_engines_loss_not_the_agents_error(served):
    """The chunk's engine refuses connections: its agents' calls are answered 502, and the round
    takes it as the engine's failure (marked dead, the chunk requeued: one engine, so it is left
    unfinished), not as a bug in the agent. The first agent answered 502 ends the chunk: its
    sibling got 502 too or is cancelled where it waits."""
    from dapo_mega.distributed import free_port
    from dapo_mega.rollout.manager import RolloutManager, RoundSettings

    _, _, encoder = served
    dead = f"http://127.0.0.1:{free_port()}"
    Counted.ended.clear()
    settings = RoundSettings(n_samples=2, sampling_params={"max_new_tokens": 16}, agent=Counted(),
                             prompts_per_request=1, requests_per_engine=1, max_retries=0)
    manager = RolloutManager([dead], settings, encoder)

    async def run():
        async with manager.round([PROBLEM], 0) as rnd:
            async for _ in rnd:
                pass
        return rnd.outcome

    out = run_coroutine(run())
    assert out.groups == {} and manager.book.is_dead(dead), (out.failures, manager.book.dead())
    assert Counted.ended[0] == 502 and set(Counted.ended[1:]) <= {502, "cancelled"}, Counted.ended
    assert not any("AgentFailed" in f for f in out.failures), out.failures


GAME = __file__.replace("test_openai_endpoint.py", "verifiers_game.py") + ":load_environment"


def test_a_verifiers_environment_runs_unchanged_on_the_engines_tokens(served):
    """VerifiersAgent (issue #47 item 3): a `verifiers` MultiTurnEnv with its rubric, loaded by
    path, runs its own rollout loop through the endpoint with verifiers' own OpenAI client; the
    episode is its 3 turns, the model's tokens are the engine's replies with the environment's
    messages between them, the stream is the chat template's rendering of the conversation, and
    the rubric's weighted reward (3/10 + 0.5 x 1, by hand) is what the agent returns; in a round
    it becomes the sample's environment reward."""
    pytest.importorskip("verifiers")  # the dev extra installs it
    from dapo_mega.environments.verifiers_env import VerifiersAgent
    from dapo_mega.rollout.manager import RolloutManager, RoundSettings

    _, engine, encoder = served
    # min_tokens: verifiers aborts an episode on an empty reply, which a random tiny model gives
    agent = VerifiersAgent(GAME, {"max_turns": 3}, {"max_tokens": 6, "temperature": 1.0, "extra_body": {"min_tokens": 6}})
    endpoint, reward = drive(engine, encoder, lambda ep: agent.run(PROBLEM, ep.base_url("v1")))
    calls = [list(c.reply.token_ids) for c in endpoint.episodes["v1"].branches[0]]
    ((prompt_ids, sample),) = endpoint.take_episode("v1", PROBLEM)
    assert reward == pytest.approx(0.3 + 0.5) and sample.turns == 3 == len(calls)
    mask = sample.env_mask()
    assert [t for t, keep in zip(sample.token_ids, mask) if keep] == [t for c in calls for t in c]
    text = encoder.tokenizer.decode(prompt_ids + sample.token_ids, skip_special_tokens=True)
    assert text.startswith("<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>user\nturn 1: go on<|im_end|>\n" in text and "turn 2: go on" in text

    # a budget the 3 turns fit in (a call past it would get an empty reply, which verifiers aborts on)
    settings = RoundSettings(n_samples=2, sampling_params={"max_new_tokens": 160, "temperature": 1.0}, agent=agent,
                             prompts_per_request=1)

    async def run():
        async with RolloutManager([engine], settings, encoder).round([PROBLEM], 0) as rnd:
            return [g async for groups in rnd for g in groups]

    (group,) = run_coroutine(run())
    assert [s.turn_rewards for s in group.samples] == [[pytest.approx(0.8)]] * 2
