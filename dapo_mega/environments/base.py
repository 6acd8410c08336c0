"""What a multi-turn rollout talks to (issue #39 item 3): an environment, loaded by path as
reward plugins are (`package.module:Class` or `path/file.py:Class`).

    env = load_environment("dapo_mega.environments.python_tool:PythonTool")()
    env.reset(problem)
    turn = env.step(model_text)   # the model's turn, up to one of env.stop
    turn.observation              # text that goes back into the context (as a tool message)
    turn.done                     # the model answered, or the environment ends the episode

An environment's `stop` strings end a model turn (the engine stops there: SGLang's `stop`);
`max_turns` and the response-length budget bound the episode from outside. Each step says
what it cost (tool calls, errors by kind, seconds), which the rollout counts per sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Type

from dapo_mega.config import ConfigError
from dapo_mega.plugins import load_plugin_object


@dataclass
class StepResult:
    """One environment turn."""

    observation: str
    """Text appended to the context after the model's turn ("" when done)."""
    done: bool
    reward_parts: Dict[str, float] = field(default_factory=dict)
    """Parts of the reward the environment adds (summed with the verifier's)."""
    tool_calls: int = 0
    tool_errors: Dict[str, int] = field(default_factory=dict)
    """Errors by kind (the sandbox's statuses: timeout, memory, ...)."""
    tool_time_s: float = 0.0
    tool_outputs: List[str] = field(default_factory=list)
    """Each call's answer, when the turn made calls (tool_calls.py): with rollout.tool_message=chat
    each is one tool message as the chat template renders them; [] renders `observation` as one."""
    calls: List[Dict[str, Any]] = field(default_factory=list)
    """What the ledger keeps of each call of the turn (its `tool_log`): {"name", "arguments",
    "output" (as the model reads it), "error" (its kind, "" when it ran)}."""


class Environment:
    """The interface: `reset` once per sample, `step` after each model turn (sync, run in the
    round's threads, or `async def`, run on its loop), `release` when the episode is over."""

    stop: List[str] = []
    """Strings that end a model turn and hand the text to `step`."""

    resumable: bool = True
    """A partial rollout resumes a sample with a fresh copy `reset` with the problem: an
    environment whose episode state cannot be rebuilt that way says False, and partial rollouts
    are refused with it (plan/preflight.py)."""

    def reset(self, problem: Any) -> None:
        """A new episode for `problem` (a `data.Problem`)."""

    def step(self, model_text: str) -> StepResult:
        """The environment's answer to the model's latest turn `model_text`."""
        raise NotImplementedError

    def release(self) -> None:
        """The episode is over (ended, or cut by a stop: a resumed sample gets a fresh copy);
        once per episode that was reset. `step`, `reset` and `release` may be async."""

    def answers(self, model_text: str) -> bool:
        """Whether a turn that ended with the model's message (EOS), not at one of `stop`, is
        answered: a tool-call format whose message holds its calls (tool_calls.py). Default:
        no, such a turn is the model's answer."""
        return False

    def tool_schemas(self) -> List[Dict[str, Any]]:
        """The OpenAI function schemas of the tools the prompt shows (the chat template's
        `tools=`); [] for none."""
        return []

    def use_tokens(self, encode_text: Callable[[str], List[int]]) -> None:
        """The rollout's tokenizer (`encode_text(text)` -> the ids the sample will hold), given
        once before the first episode: an environment that bounds its answers in tokens keeps
        it (tool_calls.py's max_output_tokens). Default: not needed."""

    def report(self) -> Dict[str, Any]:
        """What the environment got on this host (the python tool: its sandbox's isolation and
        limits), kept in run.json's `environment`; {} when there is nothing to say."""
        return {}

    def take_metrics(self) -> Dict[str, float]:
        """The environment's own metrics since the last call (the step's), slash-named; the
        python tool: its runs by isolation level."""
        return {}


def load_class(path: str, field_name: str) -> Any:
    """What `path` names (`package.module:Name` or `path/to/file.py:Name`), loaded by the one
    loader of the user's plugins (`dapo_mega.plugins`); ConfigError naming `field_name` when it
    cannot be loaded."""
    return load_plugin_object(path, f"{field_name}:")


def load_environment(path: str, field_name: str = "rollout.environment") -> Type[Environment]:
    """The class `path` names; ConfigError naming `field_name` when it cannot be loaded or is
    not an Environment (it needs `reset` and `step`)."""
    cls = load_class(path, field_name)
    if not (isinstance(cls, type) and callable(getattr(cls, "step", None)) and callable(getattr(cls, "reset", None))):
        raise ConfigError(f"{field_name}: {path!r} is not an environment class (it needs reset(problem) and "
                          "step(model_text)). Fix: subclass dapo_mega.environments.base.Environment")
    return cls


BUILT_IN = {"python": "dapo_mega.environments.python_tool:PythonTool",
            "tools": "dapo_mega.environments.tool_calls:ToolEnvironment"}
"""Names rollout.environment takes for the built-in environments."""


def build_environment(path: str, kwargs: Dict[str, Any]) -> Optional[Environment]:
    """The environment `rollout.environment` names (a built-in name or a class path), made with
    `rollout.environment_kwargs`; None when it is empty (one turn per sample)."""
    if not path:
        return None
    cls = load_environment(BUILT_IN.get(path, path))
    try:
        env = cls(**dict(kwargs))
    except TypeError as exc:
        raise ConfigError(f"rollout.environment_kwargs: {dict(kwargs)} do not fit {path!r} ({exc}). Fix: give the "
                          "keyword arguments its constructor takes") from None
    stops = getattr(env, "stop", None)
    answers_messages = type(env).answers is not Environment.answers if isinstance(env, Environment) else False
    if not isinstance(stops, (list, tuple)) or not (stops or answers_messages) or \
            not all(isinstance(x, str) and x for x in stops):
        raise ConfigError(f"rollout.environment: {path!r} has stop={stops!r}; a model turn must end somewhere. Fix: "
                          "give the class a list of non-empty stop strings (`stop = ['</code>']`)")
    return env


def environment_tools(env: Optional[Environment]) -> List[Dict[str, Any]]:
    """`env.tool_schemas()` for the prompt; [] as for `environment_report`."""
    schemas = getattr(env, "tool_schemas", None)
    return list(schemas()) if callable(schemas) else []


def environment_report(env: Optional[Environment]) -> Dict[str, Any]:
    """`env.report()` for run.json; {} without an environment or for a class that has no report
    (load_environment asks only for reset and step)."""
    report = getattr(env, "report", None)
    return dict(report()) if callable(report) else {}


def take_environment_metrics(env: Optional[Environment]) -> Dict[str, float]:
    """`env.take_metrics()` for the step's metrics; {} as for `environment_report`."""
    take = getattr(env, "take_metrics", None)
    return dict(take()) if callable(take) else {}
