"""The built-in python tool (ReTool's `<code>` / `<interpreter>` turns) and loading an
environment by path, as reward plugins are loaded (issue #39 item 3)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dapo_mega.config import ConfigError
from dapo_mega.environments.base import Environment, load_environment
from dapo_mega.environments.python_tool import PythonTool, last_code_block
from dapo_mega.environments.sandbox import SandboxLimits

LIMITS = SandboxLimits(wall_s=4.0, cpu_s=1.0, memory_mb=256, output_bytes=1024)


def test_the_turns_last_code_block_with_or_without_its_fence():
    assert last_code_block("I add them.\n<code>\n```python\nprint(12345 + 67890)\n```\n</code>") == \
        "print(12345 + 67890)"
    assert last_code_block("<code>x = 1</code> then <code>\nprint(x + 1)\n") == "print(x + 1)"  # stopped at </code>
    assert last_code_block("The answer is 80235.") is None


def test_a_code_turn_runs_and_its_output_comes_back_and_an_answer_ends_the_episode():
    tool = PythonTool(LIMITS)
    tool.reset(None)
    turn = tool.step("Let me compute.\n<code>\n```python\nprint(12345 + 67890)\n```\n")  # the engine trimmed </code>
    assert turn.observation == "</code>\n<interpreter>\n80235\n</interpreter>\n"
    assert (turn.done, turn.tool_calls, turn.tool_errors) == (False, 1, {}) and turn.tool_time_s > 0
    failed = tool.step("<code>\nprint(undefined_name)\n")
    assert "NameError: name 'undefined_name' is not defined" in failed.observation
    assert failed.tool_errors == {"error": 1} and not failed.done
    # the wall time far above the CPU time: on a busy 2-core machine a spin gets a fifth of a core
    looped = PythonTool(replace(LIMITS, wall_s=20.0)).step("<code>while True: pass</code>")
    assert looped.tool_errors == {"cpu_limit": 1} and "[stopped: CPU time limit]" in looped.observation
    answer = tool.step("So the sum is 80235. Answer: 80235")
    assert answer.done and answer.observation == "" and answer.tool_calls == 0
    assert PythonTool.stop == ["</code>"]


def test_environments_load_by_path_and_bad_paths_name_the_field(tmp_path):
    assert load_environment("dapo_mega.environments.python_tool:PythonTool") is PythonTool
    user = tmp_path / "my_env.py"
    user.write_text("from dapo_mega.environments.base import Environment, StepResult\n"
                    "class Echo(Environment):\n    def step(self, text):\n        return StepResult(text[::-1], True)\n"
                    "class NotOne:\n    pass\n")
    echo = load_environment(f"{user}:Echo")
    assert issubclass(echo, Environment) and echo().step("abc").observation == "cba"
    with pytest.raises(ConfigError, match=r"^rollout.environment: .*NotOne.* is not an environment class"):
        load_environment(f"{user}:NotOne")
    with pytest.raises(ConfigError, match=r"^rollout.environment: .* cannot be imported \(No module named"):
        load_environment("no_such_package.env:Env")
    with pytest.raises(ConfigError, match=r"^rollout.environment: 'python' is not an import path"):
        load_environment("python")
