"""An OpenAI-compatible endpoint over an engine, for agent code that runs its own loop (issue #47
item 4), as miles, prime-rl and SkyRL serve one: the agent talks to it as to any OpenAI server,
and every call's exact token ids and log-probs are recorded against its episode, so the trained
sample is the engine's own tokens, never re-tokenized text.

    endpoint = AgentEndpoint(engine, encoder, {"temperature": 1.0})   # an engine's address
    await endpoint.start()                                              # 127.0.0.1, a free port
    client = openai.AsyncOpenAI(base_url=endpoint.base_url("ep-1"), api_key="-")
    ...                                   # the agent's own loop: chat.completions.create(...)
    samples = endpoint.take_episode("ep-1", problem)   # ScoredSamples, from the engine's ids
    await endpoint.close()

Routes under `/v1/episodes/<episode>`: `POST /chat/completions` (messages, tools, max_tokens
or max_completion_tokens, temperature, top_p, stop, seed, min_tokens as SGLang takes it; n = 1),
`POST /completions` (a text
prompt), `GET /models`. Each call is one /generate on the engine with the log-probs asked for.

How a call's prompt becomes token ids (`Episode.prompt_ids`). The messages are rendered by the
tokenizer's chat template (`tools=` included, the generation prompt added). When that text
begins with what an earlier call of the episode already holds as tokens (its prompt's text and
its reply's text, and the reply's end-of-message token when the template writes it as text), the
prompt is that call's prompt ids + its reply's ids (the engine's, untouched) + the ids of the
rest of the text: the tool results and user turns the agent added, which the sample holds as
environment tokens (log-prob 0.0, masked from the loss). Otherwise (the agent rewrote history, or
the template renders earlier turns differently, as Qwen3's drops old `<think>` blocks) the call
begins a new branch: an episode gives one sample per branch.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import aiohttp
from aiohttp import web

from dapo_mega.engines.sglang.client import DEFAULT_CONNECTIONS, EngineClient, EngineError, SampleResult
from dapo_mega.environments.base import StepResult
from dapo_mega.rollout.partial import extend_sample
from dapo_mega.rollout.samples import ScoredSample, scored_sample
from dapo_mega.rollout.turns import SEED_STRIDE, add_observation

if TYPE_CHECKING:
    from dapo_mega.data import PromptEncoder
    from dapo_mega.engines.sglang.endpoint import EngineAddress

__all__ = ["AgentEndpoint", "AgentEndpoints", "Call", "Episode", "agent_sampling"]

DEFAULT_MAX_TOKENS = 1024
"""A call's max_tokens when the agent gives none."""


@dataclass
class Call:
    """One call of an episode: the prompt ids sent, the engine's reply, the text both stand for."""

    prompt_ids: List[int]
    reply: SampleResult
    added: int
    """How many of prompt_ids the agent's new messages added (environment tokens); -1: the call
    began a branch (its prompt ids are the sample's prompt)."""
    added_text: str
    """The text of those tokens, as the rendering gave it."""
    through: Tuple[str, ...]
    """The texts a later call's rendering must begin with to continue this call's tokens."""
    latency_s: float


@dataclass
class Episode:
    """An agent's calls, as branches of one token stream each."""

    branches: List[List[Call]] = field(default_factory=list)
    engine_error: Optional[BaseException] = None
    """The engine's failure under one of its calls (answered 502): the round treats the chunk as
    the engine's loss (retried elsewhere), not the agent's error."""
    seed: Optional[int] = None
    """Seeds the calls that bring none of their own: call k samples with seed + k x SEED_STRIDE
    (the sample's `seed` in the ledger)."""

    @property
    def calls(self) -> int:
        return sum(len(b) for b in self.branches)

    def prompt_ids(self, text: str, encoder: "PromptEncoder") -> Tuple[List[int], int, str, Optional[List[Call]]]:
        """(prompt ids of a call whose prompt renders as `text`, how many of them are new
        environment tokens (-1: a new branch) and their text, the branch it continues or None)
        (module docstring)."""
        for branch in reversed(self.branches):
            last = branch[-1]
            for through in last.through:
                if text.startswith(through):
                    added = encoder.encode_text(text[len(through):])
                    return (last.prompt_ids + list(last.reply.token_ids) + added, len(added), text[len(through):],
                            branch)
        return encoder.encode_text(text), -1, "", None


class AgentEndpoint:
    """The endpoint (module docstring) over the engine at `engine`; `encoder` renders and
    tokenizes (the run's `data.PromptEncoder`); `sampling`: defaults of every call's sampling
    params (an agent's own temperature, top_p, max_tokens and stop win)."""

    def __init__(self, engine: "EngineAddress", encoder: "PromptEncoder", sampling: Optional[Dict[str, Any]] = None,
                 model_name: str = "policy", host: str = "127.0.0.1", port: int = 0,
                 max_connections: int = DEFAULT_CONNECTIONS):
        self.engine, self.encoder, self.sampling = engine, encoder, dict(sampling or {})
        self.model_name, self.host, self.port = model_name, host, port
        self.max_connections = max_connections
        self.in_flight = 0
        """Calls waiting for the engine now (what a round's aborts wait for)."""
        self.stopped = False
        self.episodes: Dict[str, Episode] = {}
        self.client: Optional[EngineClient] = None
        self.runner: Optional[web.AppRunner] = None

    # ---------------------------------------------------------------- the server
    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/episodes/{episode}/chat/completions", self.chat_completions)
        app.router.add_post("/v1/episodes/{episode}/completions", self.completions)
        app.router.add_get("/v1/episodes/{episode}/models", self.models)
        self.client = EngineClient(self.engine, self.max_connections)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.client is not None:
            await self.client.close()

    def stop(self) -> None:
        """The round stopped: every new call is refused (503), those running end as the
        round's aborts cut them (their finish_reason "length")."""
        self.stopped = True

    def open_episode(self, episode: str, seed: Optional[int] = None) -> str:
        """Name `episode` (its calls seeded from `seed`); its base URL."""
        self.episodes[episode] = Episode(seed=seed)
        return self.base_url(episode)

    def base_url(self, episode: str) -> str:
        """What an OpenAI client takes as `base_url` for `episode`."""
        return f"http://{self.host}:{self.port}/v1/episodes/{episode}"

    # ---------------------------------------------------------------- routes
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "owned_by": "dapo-mega"}]})

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error("messages: a non-empty list of chat messages is required")
        tools = body.get("tools") or None
        text = self.encoder.render_messages(messages, tools)
        call = await self._call(request.match_info["episode"], text, body)
        if isinstance(call, web.Response):
            return call
        message = {"role": "assistant", "content": call.reply.text}
        return web.json_response(self._envelope(call, "chat.completion", {"message": message}))

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return _error("prompt: one text prompt is required")
        call = await self._call(request.match_info["episode"], prompt, body)
        if isinstance(call, web.Response):
            return call
        return web.json_response(self._envelope(call, "text_completion", {"text": call.reply.text}))

    # ---------------------------------------------------------------- a call
    def _params(self, body: Dict[str, Any]) -> Dict[str, Any]:
        params = {**self.sampling, "n": 1}
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        params["max_new_tokens"] = int(limit or params.get("max_new_tokens") or DEFAULT_MAX_TOKENS)
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("sampling_seed", "seed"),
                             ("min_new_tokens", "min_tokens")):  # min_tokens: SGLang's and vLLM's extra field
            if body.get(theirs) is not None:
                params[ours] = body[theirs]
        if body.get("stop") is not None:
            params["stop"] = [body["stop"]] if isinstance(body["stop"], str) else list(body["stop"])
        return params

    async def _call(self, episode_id: str, text: str, body: Dict[str, Any]):
        if int(body.get("n", 1) or 1) != 1:
            return _error("n: one choice per call (each call is a step of its episode)")
        if self.stopped:
            return _error("the round stopped: no new call of this episode is taken", 503)
        episode = self.episodes.setdefault(episode_id, Episode())
        prompt_ids, added, added_text, branch = episode.prompt_ids(text, self.encoder)
        params = self._params(body)
        if "sampling_seed" not in params and episode.seed is not None:
            params["sampling_seed"] = (episode.seed + episode.calls * SEED_STRIDE) % (1 << 62)
        t0 = time.monotonic()
        assert self.client is not None, "start() first"
        self.in_flight += 1
        try:
            (reply,) = await self.client.generate([prompt_ids], params, return_logprob=True)
        except EngineError as exc:
            if exc.status < 500:  # the call itself was refused (its length, a bad parameter): the agent's to read
                return _error(f"the engine refused the call: {exc}")
            episode.engine_error = exc
            return _error(f"the engine failed: {exc}", 502)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            episode.engine_error = exc
            return _error(f"the engine failed: {type(exc).__name__}: {exc}", 502)
        finally:
            self.in_flight -= 1
        through = text + reply.text
        ends = [through]
        last = reply.token_ids[-1] if reply.token_ids else None
        if last is not None and last in self.encoder.tokenizer.all_special_ids:
            ends.insert(0, through + self.encoder.tokenizer.convert_ids_to_tokens(last))  # written by the template
        call = Call(prompt_ids, reply, added, added_text, tuple(ends), time.monotonic() - t0)
        if branch is None:
            episode.branches.append([call])
        else:
            branch.append(call)
        return call

    def _envelope(self, call: Call, kind: str, choice: Dict[str, Any]) -> Dict[str, Any]:
        reason = call.reply.finish_reason.get("type")
        finish = {"length": "length", "abort": "length"}.get(str(reason), "stop")
        # each token as OpenAI's schemas have it (clients that validate them, verifiers', need every
        # field): a chat reply's ChatCompletionTokenLogprob list, a text completion's parallel lists
        pieces = [self.encoder.tokenizer.decode([t]) for t in call.reply.token_ids]
        lps = list(call.reply.logprobs or [])
        logprobs = ({"content": [{"token": p, "bytes": list(p.encode()), "logprob": lp, "top_logprobs": []}
                                 for p, lp in zip(pieces, lps)]} if kind == "chat.completion" else
                    {"tokens": pieces[:len(lps)], "token_logprobs": lps})
        return {"id": f"dapo-{uuid.uuid4().hex[:12]}", "object": kind, "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, **choice, "finish_reason": finish, "logprobs": logprobs}],
                "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.reply.token_ids),
                          "total_tokens": len(call.prompt_ids) + len(call.reply.token_ids)}}

    # ---------------------------------------------------------------- the trained samples
    def engine_error(self, episode_ids) -> Optional[BaseException]:
        """The first engine failure under a call of these episodes, or None."""
        errors = [self.episodes[e].engine_error for e in episode_ids if e in self.episodes]
        return next((e for e in errors if e is not None), None)

    def forget(self, episode_ids) -> None:
        """Drop these episodes unread (a chunk that failed or stopped)."""
        for e in episode_ids:
            self.episodes.pop(e, None)

    def take_episode(self, episode_id: str, problem: Any, sample_index: int = 0) -> List[Tuple[List[int], ScoredSample]]:
        """The episode's samples, one per branch: (its prompt ids, the sample: every reply's
        tokens and log-probs as the engine gave them, the agent's messages between them as
        environment tokens). The episode is forgotten."""
        episode = self.episodes.pop(episode_id, Episode())
        url = getattr(self.engine, "url", str(self.engine))
        out = []
        for branch in episode.branches:
            first = branch[0]
            sample = scored_sample(replace(first.reply, sample_index=sample_index), problem, episode.seed, url, 0.0,
                                   first.latency_s, 0)
            for call in branch[1:]:
                new = call.prompt_ids[len(call.prompt_ids) - call.added:]
                sample = add_observation(sample, StepResult(observation=call.added_text, done=False), new,
                                         len(sample.token_ids) + len(new))
                sample = replace(extend_sample(sample, call.reply, url, call.latency_s), turns=sample.turns + 1)
            out.append((list(first.prompt_ids), sample))
        return out


class AgentEndpoints(Dict[str, AgentEndpoint]):
    """A round's endpoints, one per engine url (rollout.agent): opened when the round starts,
    stopped with it, closed when it ends."""

    async def open(self, engines: Dict[str, "EngineAddress"], encoder: "PromptEncoder", settings: Any) -> None:
        """An endpoint on each of `engines` with the round's `settings` (`RoundSettings`)."""
        for url, engine in engines.items():
            endpoint = AgentEndpoint(engine, encoder, agent_sampling(settings.sampling_params),
                                     max_connections=settings.requests_at_once())
            await endpoint.start()
            self[url] = endpoint

    def stop(self) -> None:
        for endpoint in self.values():
            endpoint.stop()

    async def close(self) -> None:
        for endpoint in self.values():
            await endpoint.close()

    def in_flight(self, url: str) -> int:
        """The agents' calls running on `url`'s engine."""
        endpoint = self.get(url)
        return endpoint.in_flight if endpoint is not None else 0


def agent_sampling(params: Dict[str, Any]) -> Dict[str, Any]:
    """A round's sampling params as an agent call's defaults: the temperature, top_p, top_k and
    the response budget (a call's own max_tokens within it); n and stop are the call's."""
    return {k: v for k, v in params.items() if k in ("temperature", "top_p", "top_k", "max_new_tokens")}


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)
