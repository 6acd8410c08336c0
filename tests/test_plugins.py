"""One loader for every plugin the config names (issue #49 item 6): reward functions,
environments, tools and agents read the same path forms, load a file once per process under one
name, and fail the same one-line way, naming their own field."""

from __future__ import annotations

import pytest

from dapo_mega.config import ConfigError
from dapo_mega.environments.agent import build_agent
from dapo_mega.environments.base import build_environment, load_class
from dapo_mega.reward import build_verifier

PLUGIN = '''
from dapo_mega.environments.agent import Agent
from dapo_mega.environments.base import Environment, StepResult

def score(response, ground_truth, metadata):
    return float(response.strip() == ground_truth)

class Env(Environment):
    stop = ["</x>"]
    def step(self, model_text):
        return StepResult(observation="", done=True)

class Helper(Agent):
    async def run(self, problem, base_url):
        return None
'''


def test_one_file_serves_as_reward_environment_and_agent_loaded_once(tmp_path):
    path = tmp_path / "plugin.py"
    path.write_text(PLUGIN)
    env = build_environment(f"{path}:Env", {})
    agent = build_agent(f"{path}:Helper", {})
    verifier = build_verifier(f"{path}:score")
    assert verifier.score("7", "7").reward == 1.0 and env.stop == ["</x>"]
    # one module for the file, not one per load: the class loaded again is the same object
    assert load_class(f"{path}:Env", "rollout.environment") is type(env) and type(agent).__module__ == type(env).__module__


@pytest.mark.parametrize("build, field", [(lambda p: build_environment(p, {}), "rollout.environment:"),
                                          (lambda p: build_agent(p, {}), "rollout.agent:"),
                                          (build_verifier, "algo.verifier: reward plugin")])
def test_each_field_fails_the_same_way_naming_itself(tmp_path, build, field):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('needs a GPU')\n")
    fine = tmp_path / "fine.py"
    fine.write_text("X = 1\n")
    cases = [(f"{tmp_path}/missing.py:X", "which does not exist. Fix: give the file's path"),
             (f"{broken}:X", "raised RuntimeError on import: needs a GPU. Fix: make the file importable"),
             ("no_such_module_anywhere:X", "cannot be imported (No module named 'no_such_module_anywhere'). Fix:"),
             (f"{fine}:Missing", "has no attribute 'Missing'. Fix: name a")]
    if build is not build_verifier:  # the verifier takes a name or a URL there (its own message)
        cases.append(("not a path", "is not an import path. Fix: write it as package.module:"))
    for path, message in cases:
        with pytest.raises(ConfigError) as info:
            build(path)
        text = str(info.value)
        assert text.startswith(f"{field} {path!r} ") and message in text and "\n" not in text, text
