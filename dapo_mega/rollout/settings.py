"""What every request of a rollout manager is sent with, fixed when the manager is made.

`RoundSettings` is read by a round (rollout/round.py) and its watchdog (rollout/watchdog.py)
as one frozen value: they never reach back into the manager. `for_purpose` builds it from the
run's config for training, evaluation (`dapo-mega eval`, the held-out sets) or the audit, the
one place those three read `rollout.*`, `algo.*` and `eval.*`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence

from dapo_mega.engines.sglang.client import DEFAULT_CONNECTIONS
from dapo_mega.environments.sandbox import DEFAULT_MAX_CONCURRENT

if TYPE_CHECKING:
    from dapo_mega.config import DapoConfig
    from dapo_mega.engines.sglang.client import RequestSamplingParams, SamplingParams
    from dapo_mega.environments.agent import Agent
    from dapo_mega.environments.base import Environment
    from dapo_mega.rollout.samples import PromptItem

__all__ = ["DEFAULT_TOOL_SLOTS", "PURPOSES", "RoundSettings", "request_seed", "tool_slots"]

PURPOSES = ("train", "eval", "audit")

DEFAULT_TOOL_SLOTS = DEFAULT_MAX_CONCURRENT
"""The environment's steps at once when rollout.environment_kwargs gives no max_concurrent
(the python tool's default, dapo_mega/environments/sandbox.py)."""


def tool_slots(environment_kwargs: Mapping[str, Any]) -> int:
    """Steps of the environment at once: its `max_concurrent` (rollout.environment_kwargs), or
    DEFAULT_TOOL_SLOTS. The round's tool executor has this many threads and the plan's clock
    (plan/clock.py) counts this many slots, so what the plan prints is what runs."""
    return max(1, int(environment_kwargs.get("max_concurrent", DEFAULT_TOOL_SLOTS)))


@dataclass(frozen=True)
class RoundSettings:
    """A rollout manager's request settings (rollout/manager.py's module docstring says what each does)."""

    n_samples: int
    """Samples per prompt (one request's `sampling_params.n`)."""
    sampling_params: Dict[str, object] = field(default_factory=dict)
    """Every request's sampling params, `n` included."""
    max_retries: int = 3
    prompts_per_request: int = 4
    requests_per_engine: int = 8
    """Requests in flight per engine: an engine batches concurrent requests together."""
    return_logprob: bool = True
    routed_experts_every: int = 0
    """Ask one request in this many for each token's experts (0: none; a mixture whose engines
    report them: `EngineFleet.returns_routed_experts`)."""
    seed: Optional[int] = None
    """Seeds each prompt's request from (seed, step, round, prompt id) (`params_for`)."""
    liveness_timeout_s: float = 300.0
    """An engine with requests in flight that answers no probe (and finishes nothing) this long is hung."""
    probe_interval_s: float = 10.0
    """Seconds between /health probes of a busy engine; each probe waits at most this long."""
    dataset_revision: str = ""
    """Revision of the data the prompts come from (each sample's ledger row carries it)."""
    partial_rollout: bool = False
    """Keep the samples of requests aborted once a streamed batch is full, and resume them later."""
    run_id: str = "run"
    environment: Optional["Environment"] = None
    """Multi-turn samples (rollout/turns.py): what each sample's turns talk to; None: one turn."""
    max_turns: int = 1
    """With an environment: the model's turns per sample at most."""
    tool_message: str = "text"
    """With an environment: its answer as written (text) or as the chat template renders a tool
    message (chat: `PromptEncoder.tool_message`)."""
    agent: Optional["Agent"] = None
    """Agent rollouts (environments/agent.py): each sample is one `agent.run` against the
    round's OpenAI-compatible endpoint on the chunk's engine (rollout/openai_endpoint.py)."""
    tool_slots: int = DEFAULT_TOOL_SLOTS
    """With an environment: threads of the round's executor its steps run in (`tool_slots`:
    the environment's max_concurrent)."""

    def __post_init__(self) -> None:
        params = {**self.sampling_params, "n": self.n_samples}
        if self.environment is not None:  # every turn stops at the environment's strings, kept in the text
            stops = params.get("stop") or []
            stops = [stops] if isinstance(stops, str) else list(stops)
            params.update(stop=stops + [x for x in self.environment.stop if x not in stops], no_stop_trim=True)
        object.__setattr__(self, "sampling_params", params)
        object.__setattr__(self, "prompts_per_request", max(1, self.prompts_per_request))
        object.__setattr__(self, "requests_per_engine", max(1, self.requests_per_engine))
        object.__setattr__(self, "tool_slots", max(1, self.tool_slots))

    def params_for(self, prompts: Sequence["PromptItem"], step: int, gen_round: int) -> "RequestSamplingParams":
        """sampling_params of one request: shared, or (with `seed`) one dict per prompt whose
        `sampling_seed` depends only on (seed, step, round, prompt id) — so a step redone after a
        resume, or a request retried on another engine, samples the same tokens where the engine
        honours the seed (the embedded engine; SGLang with --enable-deterministic-inference)."""
        if self.seed is None:
            return self.sampling_params
        return [{**self.sampling_params, "sampling_seed": request_seed(self.seed, step, gen_round,
                                                                       str(getattr(p, "id", "")))} for p in prompts]

    def requests_at_once(self) -> int:
        """/generate requests a round may have on one engine at once: one per chunk in flight, or
        with an environment one per sample of those chunks (each episode sends its own turns);
        an engine client holds this many connections (aiohttp's 100 at least)."""
        per_chunk = self.prompts_per_request * self.n_samples if self.environment or self.agent else 1
        return max(DEFAULT_CONNECTIONS, self.requests_per_engine * per_chunk)

    def reports_experts(self, chunk: int) -> bool:
        """Whether the request of chunk `chunk` asks for its tokens' routed experts."""
        return bool(self.routed_experts_every) and chunk % self.routed_experts_every == 0

    @classmethod
    def for_purpose(cls, cfg: "DapoConfig", purpose: str, *, run_id: str = "", dataset_revision: str = "",
                    n_samples: Optional[int] = None, max_response_length: Optional[int] = None,
                    seed: Optional[int] = None, routed_experts_every: int = 0) -> "RoundSettings":
        """The settings of a manager for `purpose` (PURPOSES): training samples G per prompt with
        the training sampling, log-probs and the run's seed (partial rollouts when the mode has
        them); evaluation k per problem (`n_samples`: a set's own k) with eval.* sampling and
        `max_response_length` (a set's own limit, else eval's, else training's); the audit one
        per problem with the training sampling and `seed`. The three share rollout.* (retries,
        chunking, liveness, the environment of multi-turn samples); `routed_experts_every`: training on a mixture whose engines report experts."""
        from dapo_mega.config import partial_rollout_enabled
        from dapo_mega.engines.sglang.client import build_sampling_params
        from dapo_mega.environments.agent import build_agent
        from dapo_mega.environments.base import build_environment

        if purpose not in PURPOSES:
            raise ValueError(f"purpose={purpose!r}: one of {PURPOSES}")
        a, e, r = cfg.algo, cfg.eval, cfg.rollout
        shared = dict(max_retries=r.max_retries, prompts_per_request=r.prompts_per_request,
                      requests_per_engine=r.requests_per_engine, liveness_timeout_s=r.liveness_timeout_s,
                      probe_interval_s=r.liveness_probe_interval_s, dataset_revision=dataset_revision,
                      environment=build_environment(r.environment, r.environment_kwargs), max_turns=r.max_turns,
                      tool_message=r.tool_message, tool_slots=tool_slots(r.environment_kwargs),
                      agent=build_agent(r.agent, r.agent_kwargs))
        if purpose == "eval":
            params = build_sampling_params(temperature=e.temperature, top_p=e.top_p, max_new_tokens=(
                max_response_length or e.max_response_length or a.max_response_length))
            return cls(n_samples or e.n_samples, params, return_logprob=False, seed=e.seed,
                       run_id=run_id or cfg.trainer.run_name, **shared)
        params: "SamplingParams" = build_sampling_params(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                                                         max_new_tokens=a.max_response_length)
        if purpose == "audit":
            return cls(1, params, return_logprob=False, seed=seed, run_id=run_id or "audit", **shared)
        return cls(n_samples or a.n_samples_per_prompt, params, seed=cfg.trainer.seed, run_id=run_id or "run",
                   partial_rollout=partial_rollout_enabled(cfg), routed_experts_every=routed_experts_every, **shared)


def request_seed(seed: int, step: int, gen_round: int, prompt_id: str) -> int:
    """A 56-bit sampling seed of one prompt's request (the engine adds the sample index)."""
    digest = hashlib.sha256(f"{seed}:{step}:{gen_round}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:7], "big")
