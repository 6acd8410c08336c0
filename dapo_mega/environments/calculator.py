"""Two integer tools, `mul` and `add`: the tools of the synthetic `calc_tools` task
(data/synthetic.py), whose warm start calls them in the hermes format, two at once and then one.

    rollout.environment=tools
    +rollout.environment_kwargs.tools=[dapo_mega.environments.calculator:Mul,dapo_mega.environments.calculator:Add]
"""

from __future__ import annotations

from dapo_mega.environments.tool_calls import Tool

__all__ = ["Add", "Mul", "TOOL_PATHS"]

_TWO_INTEGERS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                 "required": ["a", "b"], "additionalProperties": False}


class Mul(Tool):
    name, description, parameters = "mul", "Multiply two integers.", _TWO_INTEGERS

    def call(self, a: int, b: int) -> str:
        return str(a * b)


class Add(Tool):
    name, description, parameters = "add", "Add two integers.", _TWO_INTEGERS

    def call(self, a: int, b: int) -> str:
        return str(a + b)


TOOL_PATHS = (f"{__name__}:Mul", f"{__name__}:Add")
"""The tools as rollout.environment_kwargs.tools names them."""
