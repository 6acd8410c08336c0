"""Multi-turn samples: the model writes, the environment answers, the model goes on.

With an environment (`rollout.environment`, dapo_mega/environments/), a sample is a sequence
of turns in one response: the model's tokens (trained: log-probs and weight versions from the
engine) and the environment's (in the context, masked from the loss, no log-probs). Every
request stops at the environment's stop strings (SGLang's `stop`, with `no_stop_trim` so the
text keeps them as the tokens do). After a round's request answers, `Episodes` runs the turns
of its samples on the same engine, each sample's episode on its own (an asyncio task per
sample, rollout/request.py, as verl's agent loop and AReaL run them: a turn waits for its own
generation and its own tool, not for the chunk's slowest):

* a sample whose latest turn ended at a stop string has its tool pending
  (`ScoredSample.tool_pending`); its episode (a shallow copy of the configured environment,
  reset with the problem: what `__init__` built, the sandbox and its slots, is shared; what
  `reset` sets is the episode's) answers it in a thread of the round's executor
  (`RoundSettings.tool_slots` threads: the environment's max_concurrent, what the plan's clock
  counts; asyncio's default pool would hold min(32, cores + 4));
* the observation (as written, or with rollout.tool_message=chat as the chat template renders
  a tool message: `TextEncoding.tool_message`) is tokenized (`encode_text`) and appended:
  its positions go to the sample's `env_spans` (loss mask 0, log-prob 0.0);
* a sample that goes on is one request of its own (prompt ids + its tokens so far, n = 1, the
  budget left: the same request a partial rollout resumes with, rollout/partial.py), sent as
  soon as its answer is in; the engine batches the episodes' requests as they come;
* a sample ends when its environment says done, its turn ends without a stop string (the
  model answered or hit EOS), it has `max_turns` model turns, or the response-length budget
  (`algo.max_response_length`, the one the overlong shaping reads) is spent: environment
  tokens count against it, an observation that does not fit is cut and the sample truncated.

A round that stops (rollout/round.py) sends no new turn (each episode looks between its
turns): the samples not ended stay open
(`Episodes.partial_groups`), those cut by the abort, those whose tool is pending (it runs
when the partial rollout resumes, before the model's next turn) and those whose answer came
but whose next turn was not sent. None is closed with its tool call unmade.

What the tool cost travels with the sample (`tool_calls`, `tool_errors` by kind, `tool_time_s`)
into the ledger and the step's metrics. Each answer's reward parts, summed, are the turn's
reward (`turn_rewards`); `fold_turn_rewards` folds them by rollout.turn_reward (sum, mean,
last, max, min) into the environment's reward, added to the verifier's when the sample is scored.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Dict, List, Optional, Protocol, Sequence, Tuple

from dapo_mega.environments.base import Environment, StepResult
from dapo_mega.rollout.partial import PartialGroup, extend_sample, is_open
from dapo_mega.rollout.samples import ScoredSample
from dapo_mega.rollout.settings import DEFAULT_TOOL_SLOTS

if TYPE_CHECKING:
    from dapo_mega.engines.sglang.client import SampleResult, SamplingParams

__all__ = ["EnvironmentFailed", "Episodes", "TextEncoding", "Turn", "TurnState", "add_observation", "ended_at_stop",
           "ended_message", "turn_params"]

SEED_STRIDE = 1_000_003
"""A continuation's sampling seed: the sample's seed + turn x this (so turns draw apart)."""


class EnvironmentFailed(RuntimeError):
    """The environment's `reset` or `step` raised (a bug in it, not the model's doing)."""


class TextEncoding(Protocol):
    """What tokenizes an observation, and frames it as the chat template's tool message
    (`data.PromptEncoder`)."""

    def encode_text(self, text: str) -> List[int]: ...

    def tool_message(self, texts: Sequence[str], after: Optional[int] = None) -> str: ...


def ended_at_stop(reply: "SampleResult", stops: Sequence[str]) -> bool:
    """The engine stopped this turn at one of the environment's stop strings."""
    reason = reply.finish_reason
    return reason.get("type") == "stop" and reason.get("matched") in stops


def ended_message(reply: "SampleResult") -> bool:
    """The engine stopped this turn at the end of the model's message (EOS or a stop token),
    not at a stop string."""
    reason = reply.finish_reason
    return reason.get("type") == "stop" and not isinstance(reason.get("matched"), str)


def add_observation(sample: ScoredSample, result: StepResult, ids: List[int], budget: int) -> ScoredSample:
    """`sample` after its environment's answer `result` (tokens `ids`): the tokens appended as
    environment tokens, cut to the budget left (then the sample is truncated), the tool's cost
    added."""
    room = max(0, budget - len(sample.token_ids))
    kept = ids[:room]
    start = len(sample.token_ids)
    errors = dict(sample.tool_errors)
    for kind, k in result.tool_errors.items():
        errors[kind] = errors.get(kind, 0) + int(k)
    logprobs = None if sample.logprobs is None else list(sample.logprobs) + [0.0] * len(kept)
    closing = result.done and not result.reward_parts and not result.tool_calls  # the answer that only ends it
    return replace(sample, token_ids=list(sample.token_ids) + kept, logprobs=logprobs,
                   env_spans=[*sample.env_spans, [start, start + len(kept)]] if kept else list(sample.env_spans),
                   response_text=sample.response_text + result.observation,
                   turn_text_at=len(sample.response_text) + len(result.observation),
                   truncated=len(kept) < len(ids) or sample.truncated,
                   tool_calls=sample.tool_calls + result.tool_calls, tool_errors=errors,
                   tool_time_s=sample.tool_time_s + result.tool_time_s,
                   tool_log=[*sample.tool_log, *({"turn": sample.turns, **c} for c in result.calls)],
                   turn_rewards=sample.turn_rewards if closing else [*sample.turn_rewards,
                                                                     float(sum(result.reward_parts.values()))],
                   tool_pending=False)


TURN_REWARD_RULES = ("sum", "mean", "last", "max", "min")


def fold_turn_rewards(rewards: Sequence[float], rule: str) -> float:
    """The environment's reward of an episode from its turns' rewards (`ScoredSample.turn_rewards`)
    by `rule` (rollout.turn_reward): their sum, mean, the last one, the largest or the smallest;
    0.0 for an episode the environment never answered."""
    if not rewards:
        return 0.0
    if rule == "sum":
        return float(sum(rewards))
    if rule == "mean":
        return float(sum(rewards)) / len(rewards)
    if rule == "last":
        return float(rewards[-1])
    if rule in ("max", "min"):
        return float(max(rewards) if rule == "max" else min(rewards))
    raise ValueError(f"rollout.turn_reward: {rule!r} is not one of {TURN_REWARD_RULES}")


def turn_params(base: "SamplingParams", sample: ScoredSample, budget: int) -> "SamplingParams":
    """The sampling params of a sample's next turn: n = 1, the budget left, its own seed."""
    params = {**base, "n": 1, "max_new_tokens": budget - len(sample.token_ids)}
    if base.get("sampling_seed") is not None:
        params["sampling_seed"] = (int(base["sampling_seed"]) + sample.sample_index + sample.turns * SEED_STRIDE) \
            % (1 << 62)
    return params


@dataclass
class TurnState:
    """One sample's episode in this chunk: its group and place, its environment once it has one."""

    group: int
    position: int
    env: Optional[Environment] = None

    @property
    def key(self) -> Tuple[int, int]:
        return self.group, self.position


@dataclass
class Turn:
    """A sample's next model turn: its input (prompt ids + its tokens so far) and sampling params."""

    input: List[int]
    params: "SamplingParams"


class Episodes:
    """The episodes of one chunk's samples (module docstring), each driven on its own.

    `groups`: the chunk's PartialGroups (their samples complete, cut by an abort, or waiting for
    their tool); `replies`: per (group, position) the reply just appended to it; `bases`: per
    group, the sampling params of its prompt; `budget`: the response budget; `tools`: the
    executor a synchronous `step` runs in (the round's, sized to the environment's
    max_concurrent; None: asyncio's default); `gate`: the same bound for an async `step`.

        for st in episodes.pending():              # each sample whose tool is due, on its own:
            while await episodes.answer(st):       #   its tool ran; it goes on
                turn = episodes.next_turn(st)      #   its next turn (counted from here)
                ...                                #   one request: turn.input, turn.params
                if not episodes.take(st, reply, engine_id, latency_s):
                    break                          #   it ended, or was cut
        groups = episodes.partial_groups()
    """

    def __init__(self, environment: Environment, encoding: TextEncoding, max_turns: int,
                 groups: List[PartialGroup], replies: Dict[Tuple[int, int], "SampleResult"],
                 bases: Sequence["SamplingParams"], budget: int, chat: bool = False,
                 tools: Optional[Executor] = None, gate: Optional[asyncio.Semaphore] = None):
        self.environment, self.encoding, self.max_turns, self.chat = environment, encoding, max_turns, chat
        self.groups, self.bases, self.budget = groups, list(bases), budget
        self.tools = tools
        self.gate = gate or asyncio.Semaphore(DEFAULT_TOOL_SLOTS)
        """Bounds an async `step`'s calls at once (the round's: the environment's max_concurrent)."""
        self.samples = [list(pg.group.samples) for pg in groups]
        """Per group, its samples as their turns left them (changed in place: one write per turn)."""
        self.open = [set(pg.open) for pg in groups]
        """Per group, its samples not ended: cut by an abort, their tool pending, or their
        next turn not sent yet."""
        self.states: Dict[Tuple[int, int], TurnState] = {}
        for (k, j), reply in sorted(replies.items()):
            self._turn_ended(self._state(k, j), reply)

    def sample(self, st: TurnState) -> ScoredSample:
        return self.samples[st.group][st.position]

    def pending(self) -> List[TurnState]:
        """The episodes whose tool is due (their sample stopped at a call), in group order."""
        return [self._state(k, j) for k, samples in enumerate(self.samples) for j, s in enumerate(samples)
                if s.tool_pending]

    def partial_groups(self) -> List[PartialGroup]:
        """The groups as the turns left them, each with its samples not ended open: what a round
        that stops keeps as partial rollouts."""
        return [replace(pg, group=replace(pg.group, samples=list(self.samples[k])), open=sorted(self.open[k]))
                for k, pg in enumerate(self.groups)]

    def _state(self, k: int, j: int) -> TurnState:
        return self.states.setdefault((k, j), TurnState(k, j))

    def _set(self, st: TurnState, sample: ScoredSample) -> None:
        self.samples[st.group][st.position] = sample

    def _turn_ended(self, st: TurnState, reply: "SampleResult") -> bool:
        """The model's turn ended with `reply` (already appended): at a stop string with turns
        and budget left its tool is pending, and it stays open until the environment answers.
        True when it is."""
        s = self.sample(st)
        answers = getattr(self.environment, "answers", None)  # an environment needs only reset and step
        called = ended_at_stop(reply, self.environment.stop) or \
            (ended_message(reply) and callable(answers) and answers(s.response_text[s.turn_text_at:]))
        pending = called and s.turns < self.max_turns and len(s.token_ids) < self.budget
        self._set(st, replace(s, tool_pending=pending))
        if pending:
            self.open[st.group].add(st.position)
        return pending

    def _episode(self, st: TurnState) -> Environment:
        if st.env is None:
            st.env = copy.copy(self.environment)
            st.env.reset(self.groups[st.group].prompt)
        return st.env

    @staticmethod
    def _failed(env: Environment, sample: ScoredSample, exc: Exception) -> EnvironmentFailed:
        """The environment's own bug (the round fails, naming it and the sample)."""
        return EnvironmentFailed(f"rollout.environment {type(env).__name__}.step raised {type(exc).__name__}: {exc} "
                                 f"(prompt {sample.prompt_id}, sample {sample.sample_index}, turn {sample.turns}); "
                                 "errors the model should read are observations")

    @staticmethod
    def _checked(env: Environment, result: object) -> StepResult:
        if not isinstance(result, StepResult):
            raise EnvironmentFailed(f"rollout.environment {type(env).__name__}.step returned "
                                    f"{type(result).__name__}, not a StepResult")
        return result

    def _step(self, st: TurnState) -> StepResult:
        """The episode's answer to the sample's latest turn (a synchronous step: in a worker thread)."""
        env, sample = self._episode(st), self.sample(st)
        try:
            result = env.step(sample.response_text[sample.turn_text_at:])
        except Exception as exc:
            raise self._failed(env, sample, exc) from exc
        return self._checked(env, result)

    async def _async_step(self, st: TurnState) -> StepResult:
        """The same with an async `step` (on the round's loop, at most `gate` at once)."""
        sample = self.sample(st)
        async with self.gate:
            env = self._episode(st)
            try:
                result = await env.step(sample.response_text[sample.turn_text_at:])
            except Exception as exc:
                raise self._failed(env, sample, exc) from exc
        return self._checked(env, result)

    async def answer(self, st: TurnState) -> bool:
        """Run the environment on the sample's pending call (a synchronous `step` in the
        executor's threads, an async one on the loop) and append its answer. True when the
        sample goes on (open until its next turn is taken), False when the episode is done or
        the budget spent."""
        if inspect.iscoroutinefunction(self.environment.step):
            result = await self._async_step(st)
        else:
            result = await asyncio.get_running_loop().run_in_executor(self.tools, self._step, st)
        if self.chat and not result.done and result.observation:  # the template's tool turn around it
            sample = self.sample(st)
            result = replace(result, observation=self.encoding.tool_message(
                result.tool_outputs or [result.observation], after=sample.token_ids[-1] if sample.token_ids else None))
        ids = self.encoding.encode_text(result.observation) if result.observation else []
        sample = add_observation(self.sample(st), result, ids, self.budget)
        self._set(st, sample)
        if not result.done and not sample.truncated and len(sample.token_ids) < self.budget:
            return True
        self.open[st.group].discard(st.position)
        return False

    async def release(self, st: TurnState) -> None:
        """The episode's environment is done with (ended, or cut: a resumed sample gets a fresh
        one): its `release` hook, when it has one, runs once."""
        env, st.env = st.env, None
        release = getattr(env, "release", None)
        if env is None or not callable(release):
            return
        if inspect.iscoroutinefunction(release):
            await release()
        else:
            await asyncio.get_running_loop().run_in_executor(self.tools, release)

    def next_turn(self, st: TurnState) -> Turn:
        """The request of the sample's next model turn (after `answer` said it goes on); the turn
        is counted from here, so a partial rollout cut before it is answered resumes this turn."""
        sample = self.sample(st)
        turn = Turn(list(self.groups[st.group].group.prompt_input) + list(sample.token_ids),
                    turn_params(self.bases[st.group], sample, self.budget))
        self._set(st, replace(sample, turns=sample.turns + 1))
        return turn

    def take(self, st: TurnState, reply: "SampleResult", engine_id: str, latency_s: float) -> bool:
        """The reply of the sample's turn, appended; a sample cut by an abort with budget left
        stays open, one cut at its budget is truncated. True when its tool is due (it goes on)."""
        sample = extend_sample(self.sample(st), reply, engine_id, latency_s)
        cut = is_open(reply, len(sample.token_ids), self.budget)
        self._set(st, replace(sample, truncated=sample.truncated or (reply.aborted and not cut)))
        if not cut:
            self.open[st.group].discard(st.position)
        return self._turn_ended(st, reply)
