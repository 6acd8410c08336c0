"""An environment of the `verifiers` package (prime-rl's environments) run unchanged as an agent
(issue #47 item 3): its own rollout loop calls the round's OpenAI-compatible endpoint
(rollout/openai_endpoint.py), so the trained sample is the engine's tokens, and its rubric's
reward is the episode's environment reward.

    rollout.agent=dapo_mega.environments.verifiers_env:VerifiersAgent
    +rollout.agent_kwargs.environment=my_env.py:load_environment     # a vf.Environment, its class,
    +rollout.agent_kwargs.env_args={max_turns: 4}                     #   or a function making one
    +rollout.agent_kwargs.sampling_args={max_tokens: 256}

The classic API (`vf.MultiTurnEnv`, `vf.ToolEnv`, `vf.Rubric`, `env.run_rollout`), which
verifiers 0.3 keeps as `verifiers.legacy` and answers at its old names (`import verifiers as
vf`). Each sample is one `run_rollout` of the problem: its prompt as the user message (or the
problem's own messages), its ground truth as `answer`, its extra info as `info`; the client is
verifiers' own `OpenAIChatCompletionsClient` over `openai.AsyncOpenAI` at the endpoint. The
reward the rubric gives is added to the verifier's (`reward_components.environment`); set
algo.verifier to a reward that gives 0 where the rubric judges correctness itself.
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, Optional

from dapo_mega.config import ConfigError
from dapo_mega.environments.agent import Agent
from dapo_mega.environments.base import load_class

__all__ = ["VerifiersAgent"]


def _environment(obj: Any, env_args: Dict[str, Any], path: str) -> Any:
    """A verifiers environment from what `path` names: an instance, or a class or function
    made with `env_args` (verifiers' `load_environment(**env_args)` convention)."""
    env = obj if callable(getattr(obj, "run_rollout", None)) else obj(**env_args) if callable(obj) else obj
    if not callable(getattr(env, "run_rollout", None)):
        raise ConfigError(f"rollout.agent_kwargs.environment: {path!r} is not a verifiers environment (no "
                          "run_rollout). Fix: name a vf.Environment, its class, or a load_environment function")
    return env


class VerifiersAgent(Agent):
    """Each episode is the verifiers environment's `run_rollout` against the endpoint; its
    return is the rubric's reward."""

    def __init__(self, environment: str, env_args: Optional[Dict[str, Any]] = None,
                 sampling_args: Optional[Dict[str, Any]] = None):
        try:
            import verifiers  # noqa: F401 -- the classic API's names (`verifiers.clients`) answer once it is imported
        except ImportError as exc:
            raise ConfigError(f"rollout.agent: VerifiersAgent needs the verifiers package ({exc}). Fix: pip install "
                              "'verifiers>=0.3,<0.4'") from None
        self.env = _environment(load_class(environment, "rollout.agent_kwargs.environment"), dict(env_args or {}),
                                environment)
        self.sampling_args = dict(sampling_args or {})

    async def run(self, problem: Any, base_url: str) -> float:
        import openai
        from verifiers.clients import OpenAIChatCompletionsClient

        messages = [dict(m) for m in (problem.messages or ({"role": "user", "content": problem.prompt},))]
        episode = {"prompt": messages, "example_id": zlib.crc32(str(problem.id).encode()),
                   "answer": str(problem.ground_truth), "info": dict(getattr(problem, "extra_info", None) or {})}
        client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
        try:
            out = await self.env.run_rollout(episode, OpenAIChatCompletionsClient(client), "policy",
                                             dict(self.sampling_args))
        finally:
            await client.close()
        error = out.get("error")
        if error:
            raise RuntimeError(f"the verifiers environment's rollout failed: {error}")
        return float(out.get("reward") or 0.0)
