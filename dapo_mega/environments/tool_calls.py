"""Tools with JSON schemas, called as the model was trained to call them (issue #47 item 2).

An environment of tools (`rollout.environment=tools`):

    rollout.environment=tools
    +rollout.environment_kwargs.tools=[pkg.mod:Add,my_tools.py:Search]   # Tool classes, loaded by path
    +rollout.environment_kwargs.format=hermes                            # or code
    +rollout.environment_kwargs.max_parallel_calls=8

* The prompt shows the tools: their OpenAI function schemas go to the tokenizer's chat template
  (`apply_chat_template(tools=...)`: Qwen2.5 and Qwen3 list them in the system turn between
  `<tools>` tags), `data.apply_chat_template=true`.
* `format=hermes` (Qwen2.5, Qwen3, Hermes): the model writes one or more
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks and ends its message
  (EOS). The turn is answered when it holds a call (`Environment.answers`); a message without
  one is the model's answer and ends the episode. The blocks are read as SGLang 0.5.23's
  `Qwen25Detector` and `HermesDetector` read them (`sglang/srt/function_call/`): the JSON
  between the tags, `arguments` or `parameters`, an object or a JSON string of one; unlike
  them, a block that cannot be read is not skipped but answered with an error the model reads
  (verl's ToolAgentLoop does the same) and counted (`invalid_call`).
* `format=code`: ReTool's `<code>...</code>` text form, a call of the tool named `python` with
  `{"code": ...}`; the turn ends at `</code>`.
* The calls of a turn run at once (at most `max_parallel_calls`); each answer, cut to
  `max_output_chars` and to `max_output_tokens` of the rollout's tokenizer (null: no token
  bound), goes back in the tool-response form of the format (hermes:
  `<tool_response>` blocks, or with rollout.tool_message=chat one tool message per call as
  the chat template renders them).
* Arguments are checked against the tool's schema (`jsonschema`) before the tool runs: a
  wrong call is answered with what is wrong (`invalid_arguments`), as an unknown tool name
  is (`unknown_tool`); a tool that raises is answered with its error (`tool_error`).
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from dapo_mega.config import ConfigError
from dapo_mega.environments.base import Environment, StepResult, load_class

__all__ = ["FORMATS", "Tool", "ToolCall", "ToolEnvironment", "VerlTool", "cut_to_tokens", "parse_calls"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CODE_OPEN, CODE_CLOSE = "<code>", "</code>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
FORMATS = ("hermes", "code")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # HermesDetector's
_CODE = re.compile(r"<code>(.*?)(?:</code>|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and its arguments, or why it cannot be made."""

    name: str
    arguments: Dict[str, Any] = field(default_factory=dict)
    error: str = ""
    """Why the block is not a call (the model reads it); "" for a call."""


def _hermes_call(block: str) -> ToolCall:
    try:
        obj = json.loads(block.strip())
    except json.JSONDecodeError as exc:
        return ToolCall("", error=f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error='a tool call is a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error="the arguments are a string that is not a JSON object")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error="the arguments are not a JSON object")
    return ToolCall(obj["name"], args)


def parse_calls(text: str, fmt: str) -> List[ToolCall]:
    """The calls of one model turn `text` in format `fmt` (`FORMATS`), in the order written."""
    if fmt == "hermes":
        return [_hermes_call(m.group(1) if m.group(1) is not None else m.group(2)) for m in _HERMES.finditer(text)]
    if fmt == "code":
        return [ToolCall("python", {"code": m.group(1).strip("\n")}) for m in _CODE.finditer(text)]
    raise ValueError(f"unknown tool-call format {fmt!r}; one of {FORMATS}")


def cut_to_tokens(text: str, max_tokens: int, encode: Callable[[str], List[int]]) -> str:
    """`text` whole when `encode` makes it at most `max_tokens` ids; else its longest prefix
    that does, and a line naming how many tokens were cut (the line itself is not counted)."""
    total = len(encode(text))
    if total <= max_tokens:
        return text
    lo, hi = 0, len(text)  # bisection: lo always fits; nearly the longest (BPE counts almost never fall with length)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(text[:mid])) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + f"\n... [{total - len(encode(text[:lo]))} tokens cut]"


class Tool:
    """A tool the model calls: a name, a description, a JSON schema of its arguments, `call`.

        class Add(Tool):
            name, description = "add", "Add two integers."
            parameters = {"type": "object", "properties": {"a": {"type": "integer"},
                          "b": {"type": "integer"}}, "required": ["a", "b"]}
            def call(self, a, b):
                return str(a + b)

    `call` gets the checked arguments as keywords and returns the text the model reads (or
    text and a reward); an exception is answered as the tool's error. One instance serves every
    episode (threads)."""

    name: str = ""
    description: str = ""
    parameters: Dict[str, Any] = {"type": "object", "properties": {}}

    def call(self, **arguments: Any) -> Any:
        """The text the model reads, or (text, reward): the call's reward, summed into the
        sample's `reward_parts["tools"]`."""
        raise NotImplementedError

    def schema(self) -> Dict[str, Any]:
        """The OpenAI function schema the chat template renders."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def _load_tool(spec: Any) -> Tool:
    """A Tool from `spec`: a class path (`pkg.mod:Class`, `file.py:Class`), or
    {"path": ..., "kwargs": {...}}."""
    path, kwargs = (spec.get("path"), dict(spec.get("kwargs") or {})) if isinstance(spec, dict) else (spec, {})
    cls = load_class(str(path), "rollout.environment_kwargs.tools")
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ConfigError(f"rollout.environment_kwargs.tools: {path!r} is not a Tool. Fix: subclass "
                          "dapo_mega.environments.tool_calls.Tool (name, description, parameters, call)")
    tool = cls(**kwargs)
    if not tool.name:
        raise ConfigError(f"rollout.environment_kwargs.tools: {path!r} has no name. Fix: set `name` on the class")
    return tool


class ToolEnvironment(Environment):
    """The tools of `tools` (Tool instances or what `_load_tool` reads), called in `format`
    (module docstring). Stateless between turns: a resumed episode needs nothing carried."""

    def __init__(self, tools: Sequence[Any] = (), format: str = "hermes", max_parallel_calls: int = 8,
                 max_output_chars: int = 4096, max_output_tokens: Optional[int] = None):
        if format not in FORMATS:
            raise ConfigError(f"rollout.environment_kwargs.format: {format!r} is not one of {list(FORMATS)}")
        self.tools = {t.name: t for t in (x if isinstance(x, Tool) else _load_tool(x) for x in tools)}
        if not self.tools:
            raise ConfigError("rollout.environment_kwargs.tools: no tool given. Fix: "
                              "+rollout.environment_kwargs.tools=[pkg.mod:MyTool]")
        if format == "code" and "python" not in self.tools:
            raise ConfigError("rollout.environment_kwargs.format: code calls the tool named 'python', and none is "
                              f"given ({sorted(self.tools)})")
        self.format, self.max_parallel_calls = format, max(1, int(max_parallel_calls))
        self.max_output_chars = max(1, int(max_output_chars))
        if max_output_tokens is not None and int(max_output_tokens) < 1:
            raise ConfigError(f"rollout.environment_kwargs.max_output_tokens: {max_output_tokens} must be >= 1, or "
                              "null for no token bound")
        self.max_output_tokens = None if max_output_tokens is None else int(max_output_tokens)
        self._encode: Optional[Callable[[str], List[int]]] = None
        self.stop = [CODE_CLOSE] if format == "code" else []
        self.calls = ThreadPoolExecutor(self.max_parallel_calls, thread_name_prefix="dapo-mega-tool-call")

    def tool_schemas(self) -> List[Dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def answers(self, model_text: str) -> bool:
        """A hermes turn ends with the model's message: it is answered when it holds a call."""
        return self.format == "hermes" and CALL_OPEN in model_text

    def _run(self, call: ToolCall) -> Tuple[str, str, float]:
        """(text the model reads, error kind or "", reward) of one call."""
        if call.error:
            return f"Error: {call.error}", "invalid_call", 0.0
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Error: there is no tool {call.name!r}; the tools are {sorted(self.tools)}", "unknown_tool", 0.0
        import jsonschema

        try:
            jsonschema.validate(call.arguments, tool.parameters)
        except jsonschema.ValidationError as exc:
            return f"Error: wrong arguments for {call.name}: {exc.message}", "invalid_arguments", 0.0
        try:
            out = tool.call(**call.arguments)
        except Exception as exc:  # noqa: BLE001 -- the model reads what went wrong
            return f"Error: {call.name} raised {type(exc).__name__}: {exc}", "tool_error", 0.0
        text, reward = out if isinstance(out, tuple) else (out, 0.0)
        return str(text), "", float(reward or 0.0)

    def use_tokens(self, encode_text: Callable[[str], List[int]]) -> None:
        self._encode = encode_text

    def _cut(self, text: str) -> str:
        if len(text) > self.max_output_chars:
            text = text[:self.max_output_chars] + f"\n... [{len(text) - self.max_output_chars} characters cut]"
        if self.max_output_tokens is None:
            return text
        if self._encode is None:
            raise RuntimeError("ToolEnvironment: max_output_tokens is set but no tokenizer was given (use_tokens); "
                               "the rollout manager gives it before the first episode")
        return cut_to_tokens(text, self.max_output_tokens, self._encode)

    def step(self, model_text: str) -> StepResult:
        calls = parse_calls(model_text, self.format)
        if not calls:
            return StepResult(observation="", done=True)
        t0 = time.monotonic()
        outcomes = list(self.calls.map(self._run, calls))
        outputs = [self._cut(text) for text, _, _ in outcomes]
        rewards = [reward for _, _, reward in outcomes]
        errors = dict(Counter(kind for _, kind, _ in outcomes if kind))
        if self.format == "code":
            observation = "".join(f"\n<interpreter>\n{out}\n</interpreter>\n" for out in outputs)
        else:
            observation = "\n" + "\n".join(f"{RESPONSE_OPEN}\n{out}\n{RESPONSE_CLOSE}" for out in outputs) + "\n"
        log = [{"name": c.name, "arguments": None if c.error else c.arguments, "output": out, "error": kind}
               for c, out, (_, kind, _) in zip(calls, outputs, outcomes)]
        return StepResult(observation=observation, done=False, tool_calls=len(calls), tool_errors=errors,
                          tool_time_s=time.monotonic() - t0, tool_outputs=outputs, calls=log,
                          reward_parts={"tools": sum(rewards)} if any(rewards) else {})


class _Fields(dict):
    """A schema dict read as attributes too (`schema.function.name`), with pydantic's
    `model_dump`: what verl's tools read of their `OpenAIFunctionToolSchema`."""

    def __getattr__(self, key: str) -> Any:
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return _Fields(value) if isinstance(value, dict) else value

    def model_dump(self, **_: Any) -> Dict[str, Any]:
        return json.loads(json.dumps(self))


class VerlTool(Tool):
    """A tool written for verl (`verl.tools.base_tool.BaseTool`: `__init__(config, tool_schema)`,
    async `create`, `execute(instance_id, parameters)`, `release`), run unchanged: each call is
    create, execute, release, as verl's ToolAgentLoop makes it; execute's text (a str or
    verl's ToolResponse) is the answer and its reward the call's.

        +rollout.environment_kwargs.tools=[{path: dapo_mega.environments.tool_calls:VerlTool,
            kwargs: {tool: my_verl_tools.py:Calculator, config: {...}, tool_schema: {...}}}]"""

    def __init__(self, tool: str, tool_schema: Dict[str, Any], config: Dict[str, Any] | None = None):
        cls = load_class(tool, "rollout.environment_kwargs.tools")
        if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("create", "execute")):
            raise ConfigError(f"rollout.environment_kwargs.tools: {tool!r} is not in verl's BaseTool shape (async "
                              "create and execute)")
        function = dict(tool_schema.get("function", tool_schema))
        self.name, self.description = str(function.get("name", "")), str(function.get("description", ""))
        self.parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
        self.tool = cls(dict(config or {}), _Fields({"type": "function", "function": function}))

    async def _call(self, arguments: Dict[str, Any]) -> Tuple[str, float]:
        created = await self.tool.create()
        instance_id = created[0] if isinstance(created, tuple) else created
        try:
            response, reward, _metrics = await self.tool.execute(instance_id, arguments)
        finally:
            release = getattr(self.tool, "release", None)
            if callable(release):
                await release(instance_id)
        text = response if isinstance(response, str) else getattr(response, "text", None)
        return ("" if text is None else str(text)), float(reward or 0.0)

    def call(self, **arguments: Any) -> Tuple[str, float]:
        import asyncio

        return asyncio.run(self._call(arguments))  # in a worker thread of the environment's calls
