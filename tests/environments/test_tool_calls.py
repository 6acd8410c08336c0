"""Tools with schemas, called in the formats models are trained on (issue #47 item 2).

References no one here wrote: SGLang 0.5.23's own tool-call parsers (`FunctionCallParser`,
qwen25 and hermes, run in the SGLang venv), Qwen2.5's chat template (tests/data/chat_tokenizer.py
holds it verbatim) rendering a whole conversation with tools, calls and tool messages.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dapo_mega.aio import run_coroutine
from dapo_mega.config import ConfigError, DataConfig
from dapo_mega.environments.base import build_environment
from dapo_mega.environments.tool_calls import Tool, ToolEnvironment, parse_calls

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from chat_tokenizer import build_chat_tokenizer  # noqa: E402


class Add(Tool):
    name, description = "add", "Add two integers."
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["a", "b"]}

    def call(self, a, b):
        return str(a + b)


class Meet(Tool):
    """Answers only when `parties` calls are inside it at once (a barrier): two calls of one turn
    that ran one after the other would time out."""

    name, description = "meet", "Wait for the others."
    parameters = {"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}

    def __init__(self, parties: int = 2):
        self.barrier = threading.Barrier(parties, timeout=10)

    def call(self, who):
        self.barrier.wait()
        return f"met {who}"


class Broken(Tool):
    name = "broken"

    def call(self):
        raise KeyError("inside")


def call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


TEXTS = [
    "Let me add.\n" + call("add", a=1, b=2),
    call("add", a=5, b=-7) + "\n" + call("meet", who="x"),
    '<tool_call>\n{"name": "add", "parameters": {"a": 3, "b": 4}}\n</tool_call>',
    "no call here, the answer is 4",
]


def test_the_calls_read_as_sglangs_own_parsers_read_them():
    """Every text above, as SGLang 0.5.23's qwen25 and hermes parsers read it (the engine's
    own `--tool-call-parser`), gives the same names and arguments as ours."""
    from sglang_venv import sglang_python_or_skip

    script = """
import json, sys
from sglang.srt.entrypoints.openai.protocol import Function, Tool
from sglang.srt.function_call.function_call_parser import FunctionCallParser
tools = [Tool(type="function", function=Function(name=n, parameters={"type": "object"})) for n in ("add", "meet")]
out = {}
for fmt in ("qwen25", "hermes"):
    out[fmt] = [[[c.name, json.loads(c.parameters)] for c in FunctionCallParser(tools, fmt).parse_non_stream(t)[1]]
                for t in json.loads(sys.stdin.read() if fmt == "qwen25" else texts)]
    texts = json.dumps(TEXTS)
print(json.dumps(out))
""".replace("TEXTS", json.dumps(TEXTS))
    done = subprocess.run([str(sglang_python_or_skip()), "-c", script], input=json.dumps(TEXTS), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [[[c.name, c.arguments] for c in parse_calls(t, "hermes")] for t in TEXTS]
    assert ours == theirs["qwen25"] == theirs["hermes"]
    assert ours[1] == [["add", {"a": 5, "b": -7}], ["meet", {"who": "x"}]] and ours[3] == []


def test_the_calls_of_a_turn_run_at_once_and_each_is_answered():
    env = ToolEnvironment([Add(), Meet(parties=2)], max_parallel_calls=4)
    result = env.step(call("meet", who="a") + "\n" + call("meet", who="b") + "\n" + call("add", a=2, b=3))
    assert result.tool_outputs == ["met a", "met b", "5"] and result.tool_errors == {} and result.tool_calls == 3
    assert result.observation == ("\n<tool_response>\nmet a\n</tool_response>\n<tool_response>\nmet b\n"
                                  "</tool_response>\n<tool_response>\n5\n</tool_response>\n")
    assert not result.done
    assert env.answers("x " + call("add", a=1, b=1)) and not env.answers("the answer is 2")
    assert env.step("the answer is 2").done


def test_a_wrong_call_is_answered_with_what_is_wrong_and_counted():
    env = ToolEnvironment([Add(), Broken()], max_output_chars=80)
    text = "\n".join(['<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',  # not JSON
                      call("nope"), call("add", a=1), call("add", a="1", b=2), call("broken"),
                      call("add", a=10 ** 100, b=1)])
    result = env.step(text)
    out = result.tool_outputs
    assert result.tool_calls == 6
    assert result.tool_errors == {"invalid_call": 1, "unknown_tool": 1, "invalid_arguments": 2, "tool_error": 1}
    assert out[0].startswith("Error: the tool call is not valid JSON")
    assert "there is no tool 'nope'" in out[1] and "'b' is a required property" in out[2]
    assert "'1' is not of type 'integer'" in out[3] and out[4] == "Error: broken raised KeyError: 'inside'"
    assert out[5].startswith("1" + "0" * 79) and out[5].endswith("[21 characters cut]")


def test_the_sandbox_is_a_tool_in_either_form():
    from dapo_mega.environments.python_tool import PythonCode

    for fmt, text in (("code", "<code>\nprint(6 * 7)\n</code>"), ("hermes", call("python", code="print(6 * 7)"))):
        result = ToolEnvironment([PythonCode(wall_s=10)], format=fmt).step(text)
        assert result.tool_outputs == ["42"], (fmt, result)


def test_the_environment_is_built_by_name_with_tools_by_path(tmp_path):
    module = tmp_path / "my_tools.py"
    module.write_text("from dapo_mega.environments.tool_calls import Tool\n"
                      "class Echo(Tool):\n    name = 'echo'\n    def call(self, **kw):\n        return repr(kw)\n")
    env = build_environment("tools", {"tools": [f"{module}:Echo", {"path": f"{__name__}:Add"}]})
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["echo", "add"] and env.stop == []
    for kwargs, named in (({"tools": []}, "no tool given"), ({"tools": ["json:loads"]}, "is not a Tool"),
                          ({"tools": [f"{__name__}:Add"], "format": "xml"}, "format: 'xml'"),
                          ({"tools": [f"{__name__}:Add"], "format": "code"}, "calls the tool named 'python'")):
        with pytest.raises(ConfigError, match=named):
            build_environment("tools", kwargs)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from dapo_mega.data import PromptEncoder

    return PromptEncoder.from_pretrained(build_chat_tokenizer(tmp_path_factory.mktemp("chat_tok")),
                                         DataConfig(prompt_template="raw", apply_chat_template=True))


def test_the_token_stream_of_an_episode_is_the_chat_templates_conversation(encoder):
    """The prompt with the tools shown, the model's message with two calls ending at its EOS,
    the framing of the two answers: together, Qwen2.5's template's rendering of the whole
    conversation (tools, an assistant message with tool_calls, two tool messages)."""
    from dapo_mega.data import Problem

    env = ToolEnvironment([Add(), Meet(parties=2)])
    problem = Problem(id="p", prompt="What is 1+2?", ground_truth="3", data_source="t")
    before = encoder.fingerprint()
    encoder.show_tools(env.tool_schemas())
    assert encoder.fingerprint() != before  # the ledger says the model saw tools
    prompt = encoder.render(problem)
    model = call("add", a=1, b=2) + "\n" + call("meet", who="x")
    eos = encoder.tokenizer.eos_token_id
    framed = encoder.tool_message(["3", "met x"], after=eos)
    conversation = [{"role": "user", "content": "What is 1+2?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
                        {"type": "function", "function": {"name": "meet", "arguments": {"who": "x"}}}]},
                    {"role": "tool", "content": "3"}, {"role": "tool", "content": "met x"}]
    reference = encoder.tokenizer.apply_chat_template(conversation, tools=env.tool_schemas(), tokenize=False,
                                                      add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in prompt
    assert reference == prompt + model + "<|im_end|>" + framed, (reference, prompt + model + "<|im_end|>" + framed)
    encoder.show_tools([])


def test_a_turn_that_ended_its_message_with_a_call_is_answered_and_goes_on():
    """Episodes: a hermes turn ends at EOS (no stop string); with a call in it the tools run and
    the sample goes on, without one it ended."""
    from dapo_mega.engines.sglang.client import SampleResult
    from dapo_mega.rollout.partial import PartialGroup
    from dapo_mega.rollout.samples import Group, ScoredSample
    from dapo_mega.rollout.turns import Episodes

    def reply(text):
        ids = [ord(c) for c in text] + [0]
        return SampleResult(prompt_index=0, sample_index=0, text=text, output_ids=ids, token_ids=ids,
                            finish_reason={"type": "stop", "matched": 0}, logprobs=[-0.5] * len(ids),
                            weight_versions=[{"version": "1", "start": 0, "end": len(ids)}], prompt_tokens=2,
                            completion_tokens=len(ids))

    texts = [call("add", a=1, b=2), "it is 3"]
    samples = [ScoredSample(prompt_id="p", sample_index=j, token_ids=reply(t).token_ids, logprobs=None,
                            weight_versions=[], response_text=t, truncated=False, seed=None, engine_id="e",
                            queue_delay_s=0.0, generation_latency_s=0.0) for j, t in enumerate(texts)]
    from dapo_mega.data import Problem

    group = Group(prompt=Problem(id="p", prompt="q", ground_truth="3", data_source="t"), prompt_input=[1],
                  samples=samples, engine_id="e", queue_delay_s=0.0, latency_s=0.0)

    class Chars:
        encode_text = staticmethod(lambda text: [ord(c) for c in text])

    episodes = Episodes(ToolEnvironment([Add()]), Chars(), 4, [PartialGroup(group, [], 500)],
                        {(0, 0): reply(texts[0]), (0, 1): reply(texts[1])}, [{"n": 2}], 500)
    (st,) = episodes.pending()
    assert st.key == (0, 0) and run_coroutine(episodes.answer(st))
    assert episodes.sample(st).response_text.endswith("<tool_response>\n3\n</tool_response>\n")
    assert episodes.sample(st).tool_calls == 1


VERL_SHAPED = '''
"""A tool as verl's docs write one (verl/tools/base_tool.py's BaseTool, gsm8k_tool.py's shape),
without verl installed: the adapter must need nothing else."""
from uuid import uuid4

RELEASED = []


class ToolResponse:  # verl.tools.schemas.ToolResponse's text field
    def __init__(self, text=None):
        self.text = text


class AnswerCheck:
    def __init__(self, config, tool_schema):
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema.function.name
        self._instances = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = {"expected": self.config["expected"]}
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        right = str(parameters.get("answer")) == self._instances[instance_id]["expected"]
        return ToolResponse(text=f"{self.name}: {'correct' if right else 'wrong'}"), (1.0 if right else 0.0), {}

    async def release(self, instance_id, **kwargs):
        RELEASED.append(self._instances.pop(instance_id))
'''


def test_a_tool_in_verls_shape_runs_unchanged(tmp_path):
    module = tmp_path / "verl_shaped.py"
    module.write_text(VERL_SHAPED)
    schema = {"type": "function", "function": {"name": "check", "description": "Check an answer.", "parameters": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
    env = build_environment("tools", {"tools": [{"path": "dapo_mega.environments.tool_calls:VerlTool", "kwargs": {
        "tool": f"{module}:AnswerCheck", "tool_schema": schema, "config": {"expected": "42"}}}]})
    assert env.tool_schemas() == [schema]
    result = env.step(call("check", answer="42") + "\n" + call("check", answer="41") + "\n" + call("check"))
    assert result.tool_outputs[:2] == ["check: correct", "check: wrong"] and result.reward_parts == {"tools": 1.0}
    assert result.tool_errors == {"invalid_arguments": 1}
    released = sys.modules[[m for m in sys.modules if m.startswith("_dapo_mega_plugin_")][-1]].RELEASED
    assert len(released) == 2  # each call made is created, executed and released, as verl's loop does


class AsyncEnv:
    """An async environment: its steps await; each episode's release is counted."""

    stop = ["a"]
    released: list = []

    def reset(self, problem):
        self.turn = 0

    async def step(self, model_text):
        import asyncio

        from dapo_mega.environments.base import StepResult

        await asyncio.sleep(0.01)
        self.turn += 1
        return StepResult(observation=f"<{self.turn}>", done=self.turn >= 2, tool_calls=1)

    async def release(self):
        AsyncEnv.released.append(self.turn)


def test_an_async_step_is_awaited_and_each_episode_released():
    from dapo_mega.data import Problem
    from dapo_mega.engines.sglang.client import SampleResult
    from dapo_mega.rollout.partial import PartialGroup
    from dapo_mega.rollout.samples import Group, ScoredSample
    from dapo_mega.rollout.turns import Episodes

    stopped = SampleResult(prompt_index=0, sample_index=0, text="xa", output_ids=[1, 97], token_ids=[1, 97],
                           finish_reason={"type": "stop", "matched": "a"}, logprobs=[-0.5, -0.5],
                           weight_versions=[{"version": "1", "start": 0, "end": 2}], prompt_tokens=1,
                           completion_tokens=2)
    samples = [ScoredSample(prompt_id="p", sample_index=j, token_ids=[1, 97], logprobs=None, weight_versions=[],
                            response_text="xa", truncated=False, seed=None, engine_id="e", queue_delay_s=0.0,
                            generation_latency_s=0.0) for j in range(2)]
    group = Group(prompt=Problem(id="p", prompt="q", ground_truth="3", data_source="t"), prompt_input=[1],
                  samples=samples, engine_id="e", queue_delay_s=0.0, latency_s=0.0)

    class Chars:
        encode_text = staticmethod(lambda text: [ord(c) for c in text])

    AsyncEnv.released.clear()
    episodes = Episodes(AsyncEnv(), Chars(), 4, [PartialGroup(group, [], 50)], {(0, 0): stopped, (0, 1): stopped},
                        [{"n": 2}], 50)

    async def run():
        for st in episodes.pending():
            assert await episodes.answer(st)
            await episodes.release(st)
            await episodes.release(st)  # once per episode

    run_coroutine(run())
    assert [s.response_text for s in episodes.partial_groups()[0].group.samples] == ["xa<1>", "xa<1>"]
    assert AsyncEnv.released == [1, 1]


def test_an_environment_that_cannot_resume_refuses_partial_rollouts(tmp_path):
    from dapo_mega.config import load_config
    from dapo_mega.plan.preflight import check_environment

    module = tmp_path / "stateful.py"
    module.write_text("from dapo_mega.environments.base import Environment\n"
                      "class Stateful(Environment):\n    stop = ['a']\n    resumable = False\n"
                      "    def step(self, text):\n        raise NotImplementedError\n")
    env = f"rollout.environment={module}:Stateful"
    with pytest.raises(ConfigError, match=r"^rollout.partial_rollout: on, but .*resumable = False.*partial_rollout=false"):
        check_environment(load_config([env, "rollout.partial_rollout=true", "cluster.max_sample_age=1"]))
    check_environment(load_config([env, "rollout.partial_rollout=false"]))


class Echo(Tool):
    name = "echo"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    def call(self, text):
        return text


def test_a_long_answer_is_cut_to_the_token_budget_by_the_rollouts_tokenizer(encoder):
    """max_output_tokens counts the answer in the rollout's tokenizer (Qwen2.5's BPE here), which
    the rollout manager gives the environment: the answer kept fits, a few characters more would
    not, and the line after it names the tokens cut."""
    from dapo_mega.rollout.manager import RolloutManager, RoundSettings

    env = ToolEnvironment([Echo()], max_output_tokens=20)
    long = "The quick brown fox jumps over the lazy dog; " * 10
    with pytest.raises(RuntimeError, match="no tokenizer was given"):
        env.step(call("echo", text=long))
    RolloutManager(["http://127.0.0.1:9"], RoundSettings(n_samples=1, sampling_params={}, environment=env), encoder)
    (out,) = env.step(call("echo", text=long)).tool_outputs
    kept, marker = out.split("\n... [")
    tokens = encoder.encode_text
    assert long.startswith(kept) and len(tokens(kept)) <= 20 < len(tokens(long[:len(kept) + 4])), kept
    assert marker == f"{len(tokens(long)) - len(tokens(kept))} tokens cut]"
    assert env.step(call("echo", text="short")).tool_outputs == ["short"]
