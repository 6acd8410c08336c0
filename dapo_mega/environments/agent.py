"""An agent that runs its own loop (issue #47 item 4): `rollout.agent`, loaded by path as
environments are, made with `rollout.agent_kwargs`.

    class MyAgent(Agent):
        async def run(self, problem, base_url):
            client = openai.AsyncOpenAI(base_url=base_url, api_key="-")
            messages = [{"role": "user", "content": problem.prompt}]
            reply = await client.chat.completions.create(model="policy", messages=messages)
            ...                                   # tools, more calls: the agent's own loop

Each sample of a prompt is one `run` against the OpenAI-compatible endpoint at `base_url`
(rollout/openai_endpoint.py); the sample is its episode's calls as the engine gave them. One
instance serves every episode at once (asyncio): per-episode state lives in `run`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from dapo_mega.config import ConfigError
from dapo_mega.environments.base import load_class


class Agent:
    """The interface: `async run(problem, base_url)` runs one episode. It may return the
    episode's reward (a number: a verifiers rubric's, verifiers_env.py), added to the sample's
    as its environment part; None adds nothing."""

    async def run(self, problem: Any, base_url: str) -> Optional[float]:
        raise NotImplementedError


def build_agent(path: str, kwargs: Dict[str, Any]) -> Optional[Agent]:
    """The agent `rollout.agent` names, made with `rollout.agent_kwargs`; None when empty."""
    if not path:
        return None
    import inspect

    cls = load_class(path, "rollout.agent")
    if not (isinstance(cls, type) and inspect.iscoroutinefunction(getattr(cls, "run", None))):
        raise ConfigError(f"rollout.agent: {path!r} is not an agent class (it needs `async def run(self, problem, "
                          "base_url)`). Fix: subclass dapo_mega.environments.agent.Agent")
    try:
        return cls(**dict(kwargs))
    except TypeError as exc:
        raise ConfigError(f"rollout.agent_kwargs: {dict(kwargs)} do not fit {path!r} ({exc}). Fix: give the keyword "
                          "arguments its constructor takes") from None
