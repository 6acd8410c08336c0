"""The built-in `python` tool: tool-integrated reasoning as ReTool writes it (arXiv 2504.11536).

The model writes code between `<code>` and `</code>` (a ```python fence inside is allowed),
generation stops at `</code>`, the code runs in the sandbox (`sandbox.py`), and what it printed
comes back between `<interpreter>` and `</interpreter>`: errors, timeouts and the other limits
as text the model reads, never a trainer failure. A turn without a code block is the model's
answer: the episode ends.

`isolation` (rollout.environment_kwargs.isolation: none, limits or full, `sandbox_boot.LEVELS`)
is the level the sandbox must hold: a host that gives less is refused when the tool is built
(the preflight builds it), naming the fix, and a run that gets less does not run its code.
"""

from __future__ import annotations

import re
from dataclasses import fields, replace
from typing import Any, Dict, Optional

from dapo_mega.environments.base import Environment, StepResult
from dapo_mega.environments.sandbox import (
    DEFAULT_MAX_CONCURRENT,
    Sandbox,
    SandboxLimits,
    check_isolation,
    check_limits,
    probe_isolation,
)
from dapo_mega.environments.tool_calls import Tool
from dapo_mega.node import node_cpus

CODE_OPEN, CODE_CLOSE = "<code>", "</code>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<interpreter>", "</interpreter>"
FENCE = re.compile(r"^\s*```(?:python|py)?\s*\n(?P<body>.*?)\n?\s*```\s*$", re.DOTALL)


def last_code_block(model_text: str) -> Optional[str]:
    """The code of the turn's last `<code>` block (its ```python fence removed), or None when
    the turn has none (the turn may end at `</code>`, the stop string, without writing it)."""
    start = model_text.rfind(CODE_OPEN)
    if start < 0:
        return None
    body = model_text[start + len(CODE_OPEN):]
    end = body.find(CODE_CLOSE)
    body = body if end < 0 else body[:end]
    fenced = FENCE.match(body)
    return (fenced["body"] if fenced else body).strip("\n")


class PythonTool(Environment):
    """Runs each turn's code block; shared sandbox slots bound the runs at once."""

    stop = [CODE_CLOSE]

    def __init__(self, limits: Optional[SandboxLimits] = None, max_concurrent: int = DEFAULT_MAX_CONCURRENT,
                 sandbox: Optional[Sandbox] = None, isolation: str = "none", url: str = "", **limit_fields: Any):
        """`limit_fields`: SandboxLimits' fields by name (what rollout.environment_kwargs gives:
        wall_s, cpu_s, memory_mb, output_bytes, processes, file_bytes, open_files, threads).
        `isolation`: the level required (ConfigError when this host gives less: `check_isolation`).
        `url`: run the code on the sandbox service there (`dapo-mega sandbox serve`), not here."""
        unknown = sorted(set(limit_fields) - {f.name for f in fields(SandboxLimits)})
        if unknown:
            raise TypeError(f"unknown keyword(s) {unknown}; the python tool takes max_concurrent, isolation and "
                            f"{[f.name for f in fields(SandboxLimits)]}")
        limits = replace(limits or SandboxLimits(), **limit_fields)
        if url:  # the sandbox service on another node (sandbox_service.py): its isolation and limits hold there
            from dapo_mega.environments.sandbox_service import RemoteSandbox

            self.sandbox = RemoteSandbox(url, limits)
            return
        self.sandbox = sandbox or Sandbox(limits, max_concurrent, isolation=isolation)
        check_limits(self.sandbox.limits, node_cpus())
        if self.sandbox.isolation != "none":  # asks the host once (probe_isolation is cached)
            check_isolation(self.sandbox.isolation, probe_isolation(self.sandbox.python, self.sandbox.limits))

    def reset(self, problem: Any) -> None:
        """Nothing carries over between episodes (each run is a fresh directory)."""

    def step(self, model_text: str) -> StepResult:
        code = last_code_block(model_text)
        if code is None or not code.strip():
            return StepResult(observation="", done=True)
        result = self.sandbox.run(code)
        text = result.model_text(self.sandbox.limits.output_bytes)
        observation = f"{CODE_CLOSE}\n{OUTPUT_OPEN}\n{text}\n{OUTPUT_CLOSE}\n" if not model_text.rstrip().endswith(
            CODE_CLOSE) else f"\n{OUTPUT_OPEN}\n{text}\n{OUTPUT_CLOSE}\n"
        errors = {} if result.status == "ok" else {result.status: 1}
        return StepResult(observation=observation, done=False, tool_calls=1, tool_errors=errors,
                          tool_time_s=result.wall_s, calls=[{"name": "python", "arguments": {"code": code}, "output": text,
                                                             "error": "" if result.status == "ok" else result.status}])

    def report(self) -> Dict[str, Any]:
        return {"sandbox": self.sandbox.report()}

    def take_metrics(self) -> Dict[str, float]:
        return self.sandbox.take_metrics()


class PythonCode(Tool):
    """The sandbox as a tool with a schema (environments/tool_calls.py): `python(code)` in the
    hermes format, or the `<code>` text form with `format=code`. Takes the python tool's
    keyword arguments (limits, max_concurrent, isolation)."""

    name = "python"
    description = "Run a Python program in a sandbox and read what it printed (stdout, then stderr)."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                  "required": ["code"]}

    def __init__(self, **python_tool: Any):
        self.sandbox = PythonTool(**python_tool).sandbox

    def call(self, code: str) -> str:
        return self.sandbox.run(code).model_text(self.sandbox.limits.output_bytes)
