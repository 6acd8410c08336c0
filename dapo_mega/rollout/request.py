"""One chunk's request on one engine, as a round sends it (rollout/round.py): its prompts'
inputs (fresh, or the open samples of resumed partial rollouts), the /generate request, the
groups of its reply and, with an environment (rollout/turns.py), the further turns of its
samples on the same engine, each sample's episode on its own, until every episode ended, a reply
was aborted or the round stopped.

    reply = await ChunkRequest(rnd, url, client, c).run()     # a ChunkReply: groups, replies, cut

The round keeps what is the round's: which chunk goes where, the retries, the aborts and the
order chunks come out in. The request reads the round's settings, prompts and partials, and
writes into it what every request counts: the /generate requests running on each engine (what
the round's aborts wait for), the watchdog's progress and the engine book's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from dapo_mega.engines.sglang.client import EngineClient, PromptInput, RequestSamplingParams, SampleResult
from dapo_mega.rollout.partial import (
    DEFAULT_MAX_NEW_TOKENS,
    GroupOrigin,
    PartialGroup,
    ResumeRequest,
    per_prompt,
    reply_groups,
    resume_request,
)
from dapo_mega.rollout.samples import Group, ScoredSample
from dapo_mega.rollout.turns import Episodes, TurnState

if TYPE_CHECKING:
    from dapo_mega.rollout.settings import RoundSettings


class ChunkRequest:
    """Chunk `c` of round `rnd` (a `dispatch.Round`) sent to the engine at `url` through `client`."""

    def __init__(self, rnd, url: str, client: EngineClient, c: int):
        self.rnd, self.url, self.client, self.c = rnd, url, client, c
        self.s: "RoundSettings" = rnd.s
        self.idx: List[int] = rnd.chunks[c]

    async def run(self) -> "ChunkReply":
        """The chunk's groups, each with its samples still open, and the last request's replies."""
        return ChunkReply(*(await (self._agents() if self.s.agent is not None else self._request())))

    async def _request(self) -> Tuple[List[PartialGroup], List[SampleResult]]:
        rnd, idx = self.rnd, self.idx
        inputs, params, resume, bases = self._inputs()
        t0 = time.monotonic()
        # a resumed chunk with no sample to generate (finished, or its tool pending) needs no request
        replies = await self._generate(inputs, params) if inputs else []
        latency, delay = time.monotonic() - t0, t0 - rnd.start
        groups = reply_groups([rnd.prompts[i] for i in idx], inputs, params, resume, replies,
                              [rnd.partials.get(i) for i in idx], self.s.n_samples,
                              GroupOrigin(self.url, delay, latency, rnd.gen_round, self.s.dataset_revision))
        if self.s.environment is not None:
            groups, replies = await self._turns(groups, replies, resume, bases)
        return groups, replies

    def _inputs(self):
        """(inputs, sampling params, ResumeRequest or None, each prompt's sampling params) of the
        chunk's prompts."""
        rnd = self.rnd
        params = self.s.params_for([rnd.prompts[i] for i in self.idx], rnd.step, rnd.gen_round)
        bases = per_prompt(params, len(self.idx))
        if self.idx[0] not in rnd.partials:
            return [rnd.encoding.encode(rnd.prompts[i]) for i in self.idx], params, None, bases
        resume = resume_request([rnd.partials[i] for i in self.idx], bases)
        return resume.inputs, resume.params, resume, bases

    async def _generate(self, inputs: List[PromptInput], params: RequestSamplingParams) -> List[SampleResult]:
        """One /generate request, counted in the round's `generating` while it runs."""
        rnd, url = self.rnd, self.url
        rnd.generating[url] += 1
        try:
            return await rnd.dog.until_hung(url, self.client.generate(
                inputs, params, return_logprob=self.s.return_logprob, return_routed_experts=self.s.reports_experts(self.c)))
        finally:
            rnd.generating[url] -= 1
            rnd.pulse.notify()

    def _progressed(self) -> None:
        """A turn's request answered or a tool call ended: progress for the watchdog and the driver."""
        self.rnd.book.count_finished()
        self.rnd.dog.progressed(self.url)

    async def _turns(self, groups: List[PartialGroup], replies: List[SampleResult], resume: Optional[ResumeRequest],
                     bases: List) -> Tuple[List[PartialGroup], List[SampleResult]]:
        """The further turns of the chunk's samples with the environment (`bases`: each prompt's
        sampling params): each sample's episode on its own, its tool then its next turn, one
        request each on the same engine, until it ended, a reply of the chunk was aborted or the
        round stopped (no new turn then: the samples not ended stay open). Returns the groups
        and each sample's latest reply."""
        rnd, n = self.rnd, self.s.n_samples
        owners = resume.owners if resume is not None else [(q // n, q % n) for q in range(len(replies))]
        latest = dict(zip(owners, replies))
        episodes = Episodes(self.s.environment, rnd.encoding, self.s.max_turns, groups, latest,
                            bases, groups[0].budget if groups else 0, chat=self.s.tool_message == "chat",
                            tools=rnd.tools, gate=rnd.tool_gate)
        self.cut = any(r.aborted for r in replies)
        if not self._halted():
            await all_or_none([asyncio.ensure_future(self._episode(episodes, st, latest)) for st in episodes.pending()])
        return episodes.partial_groups(), list(latest.values())

    async def _agents(self) -> Tuple[List[PartialGroup], List[SampleResult]]:
        """The chunk's samples as agent episodes (rollout.agent): `n_samples` runs of the agent
        per prompt at once against the endpoint on this engine; each sample is its episode's last
        branch (rollout/openai_endpoint.py), cut to the response budget. Every episode of a prompt
        must begin with the same prompt ids (they are the group's)."""
        rnd, n = self.rnd, self.s.n_samples
        endpoint = rnd.agent_endpoints[self.url]
        problems = [rnd.prompts[i] for i in self.idx]
        names = {(k, j): f"{self.s.run_id}-{rnd.step}-{rnd.gen_round}-{self.c}-{k}-{j}-{rnd.attempts[self.c]}"
                 for k in range(len(problems)) for j in range(n)}
        seeds = [p.get("sampling_seed") for p in per_prompt(self.s.params_for(problems, rnd.step, rnd.gen_round),
                                                           len(problems))]
        t0 = time.monotonic()
        failed: Optional[Exception] = None
        rewards: Dict[Tuple[int, int], Any] = {}
        try:  # episode j of a prompt seeded as the engine seeds sample j of a request: seed + j
            rewards = dict(zip(names, await all_or_none([asyncio.ensure_future(self.s.agent.run(
                problems[k], endpoint.open_episode(name, None if seeds[k] is None else int(seeds[k]) + j)))
                for (k, j), name in names.items()])))
        except Exception as exc:
            failed = exc
        lost = endpoint.engine_error(names.values())  # the engine failed under a call (the agent may have gone on)
        if failed is not None or lost is not None:
            endpoint.forget(names.values())
            if failed is not None and rnd.stopping.is_set():  # its calls were refused, or cut, by the round's stop
                raise AgentStopped(f"chunk {self.c}: the round stopped under its agents") from failed
            if lost is not None:  # the round's to handle, as any engine failure (retried elsewhere)
                raise lost from failed
            raise AgentFailed(f"rollout.agent {type(self.s.agent).__name__}.run raised {type(failed).__name__}: "
                              f"{failed} (chunk {self.c} on {self.url})") from failed
        budget = int(self.s.sampling_params.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)
        groups = []
        for k, problem in enumerate(problems):
            branches = [endpoint.take_episode(names[k, j], problem, j) for j in range(n)]
            if not all(branches):
                raise AgentFailed(f"rollout.agent: an episode of prompt {problem.id} made no call")
            prompts = {tuple(b[-1][0]) for b in branches}
            if len(prompts) > 1:
                raise AgentFailed(f"rollout.agent: the {n} episodes of prompt {problem.id} began with {len(prompts)} "
                                  "different prompts; a group's samples share one (render the same first messages)")
            samples = [replace(cut_to_budget(b[-1][1], budget), gen_round=rnd.gen_round, queue_delay_s=t0 - rnd.start,
                               dataset_revision=b[-1][1].dataset_revision or self.s.dataset_revision,
                               turn_rewards=agent_reward(rewards[k, j], problem.id)) for j, b in enumerate(branches)]
            self._progressed()
            groups.append(PartialGroup(Group(prompt=problem, prompt_input=list(branches[0][-1][0]), samples=samples,
                                             engine_id=self.url, queue_delay_s=t0 - rnd.start,
                                             latency_s=time.monotonic() - t0, gen_round=rnd.gen_round), [], budget))
        return groups, []

    def _halted(self) -> bool:
        """No new turn: the round stopped, or a reply of this chunk was aborted (the engine's own
        abort: the chunk goes again, what its other episodes would add is lost anyway)."""
        return self.rnd.stopping.is_set() or self.cut

    async def _episode(self, episodes: Episodes, st: TurnState, latest: Dict) -> None:
        """One sample's episode from its pending tool call: answer, next turn, until it ends
        (then its environment is released, whatever ended it)."""
        try:
            await self._turns_of(episodes, st, latest)
        finally:
            await episodes.release(st)

    async def _turns_of(self, episodes: Episodes, st: TurnState, latest: Dict) -> None:
        while not self._halted():
            goes_on = await episodes.answer(st)
            self._progressed()
            if not goes_on:
                return
            turn = episodes.next_turn(st)  # counted now: a stop before it is sent resumes this turn
            if self._halted():
                return
            t1 = time.monotonic()
            (reply,) = await self._generate([turn.input], [turn.params])
            latest[st.key] = reply
            self.cut = self.cut or reply.aborted
            self._progressed()
            if not episodes.take(st, reply, self.url, time.monotonic() - t1):
                return


async def all_or_none(tasks: List["asyncio.Future[Any]"]) -> List[Any]:
    """Wait for `tasks`, their results in order; the first that raises cancels the others
    (after they end, it is raised as it was: the round tells an engine's failure by its type)."""
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@dataclass
class ChunkReply:
    """What one chunk's request gave the round."""

    groups: List[PartialGroup]
    """Its groups in prompt order, each with the samples still open (a turn or the request cut)."""
    replies: List[SampleResult]
    """The replies of its last request ([] for agents: their calls are the endpoint's)."""

    @property
    def cut(self) -> bool:
        """The chunk did not finish: an engine aborted a reply, or a sample is still open."""
        return any(r.aborted for r in self.replies) or any(pg.open for pg in self.groups)


def agent_reward(value: Any, prompt_id: str) -> List[float]:
    """The sample's turn rewards from what its agent's `run` returned: [] for None, [reward]
    for a number; AgentFailed otherwise."""
    if value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise AgentFailed(f"rollout.agent: an episode of prompt {prompt_id} returned {value!r}; run returns None or "
                          "the episode's reward (a number)")
    return [float(value)]


class AgentFailed(RuntimeError):
    """An agent's `run` raised, or its episodes cannot be a group (a bug in the agent)."""


class AgentStopped(Exception):
    """A chunk's agents ended early because the round stopped (their calls refused or cut):
    the chunk is set aside, its prompts unsent (agent episodes are not carried as partials)."""


def cut_to_budget(sample: ScoredSample, budget: int) -> ScoredSample:
    """An agent's sample cut to the response budget (then truncated), its spans with it."""
    if len(sample.token_ids) <= budget:
        return sample
    spans = [[a, min(b, budget)] for a, b in sample.env_spans if a < budget]
    versions = [{**v, "end": min(int(v["end"]), budget)} for v in sample.weight_versions if int(v["start"]) < budget]
    return replace(sample, token_ids=sample.token_ids[:budget], truncated=True, env_spans=spans,
                   weight_versions=versions,
                   logprobs=None if sample.logprobs is None else sample.logprobs[:budget])
