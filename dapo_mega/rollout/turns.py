"""Multi-turn samples: the model writes, the environment answers, the model goes on.

With an environment (`rollout.environment`, dapo_mega/environments/), a sample is a sequence
of turns in one response: the model's tokens (trained: log-probs and weight versions from the
engine) and the environment's (in the context, masked from the loss, no log-probs). Every
request stops at the environment's stop strings (SGLang's `stop`, with `no_stop_trim` so the
text keeps them as the tokens do). After a round's request answers, `Episodes` runs the turns
of its samples on the same engine:

* a sample whose latest turn ended at a stop string is handed to its own episode (a shallow
  copy of the configured environment, reset with the problem: what `__init__` built, the
  sandbox and its slots, is shared; what `reset` sets is the episode's), in a worker thread;
* the observation (as written, or with rollout.tool_message=chat as the chat template renders
  a tool message: `TextEncoding.tool_message`) is tokenized (`encode_text`) and appended:
  its positions go to the sample's `env_spans` (loss mask 0, log-prob 0.0);
* the samples that go on are one request (prompt ids + their tokens so far, n = 1, the budget
  left: the same request a partial rollout resumes with, rollout/partial.py);
* a sample ends when its environment says done, its turn ends without a stop string (the
  model answered or hit EOS), it has `max_turns` model turns, or the response-length budget
  (`algo.max_response_length`, the one the overlong shaping reads) is spent: environment
  tokens count against it, an observation that does not fit is cut and the sample truncated.

What the tool cost travels with the sample (`tool_calls`, `tool_errors` by kind, `tool_time_s`)
into the ledger and the step's metrics; the environment's reward parts (`env_reward`) are added
to the verifier's reward when the sample is scored.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Dict, List, Optional, Protocol, Sequence, Tuple

from dapo_mega.environments.base import Environment, StepResult
from dapo_mega.rollout.partial import PartialGroup, extend_sample
from dapo_mega.rollout.samples import ScoredSample

if TYPE_CHECKING:
    from dapo_mega.engines.sglang.client import SampleResult, SamplingParams

__all__ = ["Continuation", "EnvironmentFailed", "Episodes", "TextEncoding", "TurnState", "add_observation", "ended_at_stop",
           "turn_params"]

SEED_STRIDE = 1_000_003
"""A continuation's sampling seed: the sample's seed + turn x this (so turns draw apart)."""


class EnvironmentFailed(RuntimeError):
    """The environment's `reset` or `step` raised (a bug in it, not the model's doing)."""


class TextEncoding(Protocol):
    """What tokenizes an observation, and frames it as the chat template's tool message
    (`data.PromptEncoder`)."""

    def encode_text(self, text: str) -> List[int]: ...

    def tool_message(self, text: str) -> str: ...


def ended_at_stop(reply: "SampleResult", stops: Sequence[str]) -> bool:
    """The engine stopped this turn at one of the environment's stop strings."""
    reason = reply.finish_reason
    return reason.get("type") == "stop" and reason.get("matched") in stops


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
    return replace(sample, token_ids=list(sample.token_ids) + kept, logprobs=logprobs,
                   env_spans=[*sample.env_spans, [start, start + len(kept)]] if kept else list(sample.env_spans),
                   response_text=sample.response_text + result.observation,
                   turn_text_at=len(sample.response_text) + len(result.observation),
                   truncated=len(kept) < len(ids) or sample.truncated,
                   tool_calls=sample.tool_calls + result.tool_calls, tool_errors=errors,
                   tool_time_s=sample.tool_time_s + result.tool_time_s,
                   env_reward=sample.env_reward + float(sum(result.reward_parts.values())))


def turn_params(base: "SamplingParams", sample: ScoredSample, budget: int) -> "SamplingParams":
    """The sampling params of a sample's next turn: n = 1, the budget left, its own seed."""
    params = {**base, "n": 1, "max_new_tokens": budget - len(sample.token_ids)}
    if base.get("sampling_seed") is not None:
        params["sampling_seed"] = (int(base["sampling_seed"]) + sample.sample_index + sample.turns * SEED_STRIDE) \
            % (1 << 62)
    return params


@dataclass
class TurnState:
    """Where one sample's episode stands: its group and place, its last reply, its environment."""

    group: int
    position: int
    last: "SampleResult"
    env: Optional[Environment] = None


@dataclass
class Continuation:
    """One request of the samples that go on: their inputs and params, and who they are."""

    inputs: List[List[int]]
    params: List["SamplingParams"]
    states: List[TurnState]


class Episodes:
    """The turns of one request's samples (module docstring).

    `groups`: the request's PartialGroups (its samples complete or cut by an abort); `replies`:
    per (group, position) its last reply; `bases`: per group, the sampling params of its
    prompt; `budget`: the response budget."""

    def __init__(self, environment: Environment, encoding: TextEncoding, max_turns: int,
                 groups: List[PartialGroup], replies: Dict[Tuple[int, int], "SampleResult"],
                 bases: Sequence["SamplingParams"], budget: int, chat: bool = False):
        self.environment, self.encoding, self.max_turns, self.chat = environment, encoding, max_turns, chat
        self.groups, self.bases, self.budget = groups, list(bases), budget
        self.states = [TurnState(k, j, r) for (k, j), r in sorted(replies.items())]

    def sample(self, st: TurnState) -> ScoredSample:
        return self.groups[st.group].group.samples[st.position]

    def _set(self, st: TurnState, sample: ScoredSample) -> None:
        samples = list(self.groups[st.group].group.samples)
        samples[st.position] = sample
        pg = self.groups[st.group]
        self.groups[st.group] = replace(pg, group=replace(pg.group, samples=samples))

    def _wants_turn(self, st: TurnState) -> bool:
        s = self.sample(st)
        return ended_at_stop(st.last, self.environment.stop) and s.turns < self.max_turns \
            and len(s.token_ids) < self.budget

    def _episode(self, st: TurnState) -> Environment:
        if st.env is None:
            st.env = copy.copy(self.environment)
            st.env.reset(self.groups[st.group].prompt)
        return st.env

    def _step(self, st: TurnState) -> StepResult:
        """The episode's answer to the sample's latest turn (in a worker thread)."""
        env = self._episode(st)
        sample = self.sample(st)
        try:
            result = env.step(sample.response_text[sample.turn_text_at:])
        except Exception as exc:  # the environment's own bug: the round fails, naming it
            raise EnvironmentFailed(f"rollout.environment {type(env).__name__}.step raised {type(exc).__name__}: "
                                    f"{exc} (prompt {sample.prompt_id}, sample {sample.sample_index}, turn "
                                    f"{sample.turns}); errors the model should read are observations") from exc
        if not isinstance(result, StepResult):
            raise EnvironmentFailed(f"rollout.environment {type(env).__name__}.step returned "
                                    f"{type(result).__name__}, not a StepResult")
        return result

    async def next_request(self) -> Optional[Continuation]:
        """Run the environment on every sample whose turn ended at a stop string (in worker
        threads, at once) and append its answer; the request of those that go on, or None
        when every episode has ended."""
        todo = [st for st in self.states if self._wants_turn(st)]
        if not todo:
            return None
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(loop.run_in_executor(None, self._step, st) for st in todo))
        going = []
        for st, result in zip(todo, results):
            if self.chat and not result.done and result.observation:  # the template's tool turn around it
                result = replace(result, observation=self.encoding.tool_message(result.observation))
            ids = self.encoding.encode_text(result.observation) if result.observation else []
            sample = add_observation(self.sample(st), result, ids, self.budget)
            self._set(st, sample)
            if not result.done and not sample.truncated and len(sample.token_ids) < self.budget:
                going.append(st)
        if not going:
            return None
        return Continuation([list(self.groups[st.group].group.prompt_input) + list(self.sample(st).token_ids)
                             for st in going],
                            [turn_params(self.bases[st.group], self.sample(st), self.budget) for st in going], going)

    def take(self, request: Continuation, replies: Sequence["SampleResult"], engine_id: str, latency_s: float) -> None:
        """The replies of a continuation, one per sample in it, appended as the model's next turn."""
        for st, reply in zip(request.states, replies):
            sample = extend_sample(self.sample(st), reply, engine_id, latency_s)
            self._set(st, replace(sample, turns=sample.turns + 1))
            st.last = reply

    def cut(self, request: Continuation) -> List[PartialGroup]:
        """The groups after an abort answered the continuation `request` (already `take`n): its
        samples with budget left are open, to be resumed like any partial rollout."""
        out = []
        for k, pg in enumerate(self.groups):
            cut = [st.position for st in request.states if st.group == k and st.last.aborted
                   and len(self.sample(st).token_ids) < self.budget]
            out.append(replace(pg, open=sorted(set(pg.open) | set(cut))))
        return out
