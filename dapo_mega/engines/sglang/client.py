"""Async HTTP client of one rollout engine (SGLang or the embedded engine: same API).

Request bodies use exactly SGLang 0.5.23's JSON field names (`engines.sglang.api`);
`build_*_body` functions are pure so the tests check them against the pinned table.
`/generate` replies are parsed into one `SampleResult` per sample, in SGLang's order
(prompt-major: result `i * n + j` is sample `j` of prompt `i`).

Seeds: SGLang copies a request's `sampling_params` to each of its `n` samples, so one
`sampling_seed` would give all G samples of a prompt the same seed (identical samples
where the seed is honoured). A seeded request with n > 1 is therefore sent as n copies of
the prompt with n = 1 and seeds `seed + j` (`expand_seeded_samples`); the replies come back
in the same prompt-major order. SGLang 0.5.23 honours `sampling_seed` only when started with
`--enable-deterministic-inference` (which needs a GPU attention backend; elsewhere it ignores
the seed); the embedded engine always honours it.

Weight updates: `/update_weights_from_distributed` and `/update_weights_from_tensor` must run
between `begin_weight_update()` and `end_weight_update()` (SGLang 0.5.23 answers 400 otherwise).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, TypedDict, Union

import aiohttp

from dapo_mega.engines.sglang.api import DEFAULT_GROUP_NAME, PAUSE_MODES
from dapo_mega.engines.sglang.endpoint import EngineAddress, as_endpoint

NO_LIMIT_S = 10.0 * 365 * 24 * 3600
"""What "no time limit" is passed to aiohttp as (a total of None would fall back to a default)."""

IDLE_CONNECTION_S = 2.0
"""How long an idle connection is kept for the next request: less than the 5 s after which
SGLang 0.5.23's uvicorn closes one (SGLANG_TIMEOUT_KEEP_ALIVE). aiohttp's default, 15 s, sends
requests on connections the server is closing; they fail with a reset from a healthy engine."""

PromptInput = Union[str, Sequence[int]]
"""What an engine is given for one prompt: its text, or its token ids."""

SamplingParams = Dict[str, Any]
"""One SGLang `sampling_params` object (n, temperature, top_p, top_k, max_new_tokens, stop,
sampling_seed, ...: `build_sampling_params`); its values are JSON scalars and lists."""

RequestSamplingParams = Union[SamplingParams, List[SamplingParams]]
"""A request's `sampling_params`: one object for every prompt, or a list of one per prompt."""


class WeightVersionSpan(TypedDict):
    """One `meta_info.weight_versions` span: tokens [start, end) came from weight `version`."""

    version: str
    start: int
    end: int


class EngineError(RuntimeError):
    """An engine answered with an error status (the message carries its reply)."""

    def __init__(self, url: str, path: str, status: int, body: object):
        super().__init__(f"{url}{path} -> HTTP {status}: {body}")
        self.status, self.body = status, body


@dataclass
class SampleResult:
    """One generated sample, parsed from a /generate reply.

    output_ids: the reply's output_ids (SGLang 0.5.23 keeps a matched stop token in them).
    token_ids: every generated token including a matched stop token (from the log-prob
        list when asked for; else output_ids) — what the learner trains on.
    logprobs: [len(token_ids)] log p(token) under softmax(z/T) (SGLang's convention), or None.
    weight_versions: [{"version", "start", "end"}] spans over token_ids.
    """

    prompt_index: int
    sample_index: int
    text: str
    output_ids: List[int]
    token_ids: List[int]
    finish_reason: Dict[str, object]
    logprobs: Optional[List[float]]
    weight_versions: List[WeightVersionSpan]
    prompt_tokens: int
    completion_tokens: int
    meta_info: Dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.finish_reason.get("type") == "length"

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"

    @property
    def versions(self) -> List[str]:
        return [str(s["version"]) for s in self.weight_versions]


def build_sampling_params(n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                          max_new_tokens: int = 128, stop: Optional[Sequence[str]] = None,
                          sampling_seed: Optional[int] = None, **extra: Any) -> SamplingParams:
    """SGLang `sampling_params` dict."""
    params: SamplingParams = {"n": n, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                              "max_new_tokens": max_new_tokens}
    if stop:
        params["stop"] = list(stop)
    if sampling_seed is not None:
        params["sampling_seed"] = sampling_seed
    params.update(extra)
    return params


def build_generate_body(prompts: Sequence[PromptInput], sampling_params: RequestSamplingParams,
                        return_logprob: bool = False, rid: Optional[str] = None) -> Dict[str, object]:
    """Batched GenerateReqInput: `text` for strings, `input_ids` for token lists."""
    if not prompts:
        raise ValueError("no prompts")
    key = "text" if isinstance(prompts[0], str) else "input_ids"
    body: Dict[str, object] = {key: [p if isinstance(p, str) else list(p) for p in prompts],
                               "sampling_params": sampling_params, "return_logprob": bool(return_logprob)}
    if rid is not None:
        body["rid"] = rid
    return body


def expand_seeded_samples(prompts: Sequence[PromptInput], sampling_params: RequestSamplingParams
                          ) -> Tuple[List[PromptInput], RequestSamplingParams, int]:
    """(prompts, sampling_params, n) to send: a seeded request with n > 1 becomes n copies of
    each prompt with n = 1 and `sampling_seed` seed + j for copy j (see the module docstring);
    anything else is sent as given."""
    per_prompt = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
    n = int((per_prompt[0] or {}).get("n", 1)) if per_prompt else 1
    if n <= 1 or not any((sp or {}).get("sampling_seed") is not None for sp in per_prompt):
        return list(prompts), sampling_params, n
    out_prompts, out_params = [], []
    for prompt, sp in zip(prompts, per_prompt):
        seed = sp.get("sampling_seed")
        for j in range(n):
            out_prompts.append(prompt)
            out_params.append({**sp, "n": 1, **({"sampling_seed": int(seed) + j} if seed is not None else {})})
    return out_prompts, out_params, 1


def parse_generate_reply(reply: Any, num_prompts: int, n: int) -> List[SampleResult]:
    """Replies (a list of batch*n dicts, or one dict) -> SampleResults in SGLang's order."""
    items = reply if isinstance(reply, list) else [reply]
    if len(items) != num_prompts * n:
        raise ValueError(f"expected {num_prompts * n} replies ({num_prompts} prompts x n={n}), got {len(items)}")
    out = []
    for k, item in enumerate(items):
        meta = item["meta_info"]
        lps = meta.get("output_token_logprobs")
        token_ids = [int(t[1]) for t in lps] if lps is not None else list(item["output_ids"])
        spans = meta.get("weight_versions") or [
            {"version": meta.get("weight_version", "default"), "start": 0, "end": len(token_ids)}]
        out.append(SampleResult(
            prompt_index=k // n, sample_index=k % n, text=item.get("text", ""),
            output_ids=list(item.get("output_ids", [])), token_ids=token_ids,
            finish_reason=meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason"},
            logprobs=[float(t[0]) for t in lps] if lps is not None else None,
            weight_versions=spans, prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(token_ids))), meta_info=meta))
    return out


def control_body(path: str, **fields: object) -> Dict[str, object]:
    """A control request body; drops None values (SGLang fills its defaults)."""
    return {k: v for k, v in fields.items() if v is not None}


DEFAULT_CONNECTIONS = 100
"""aiohttp's own bound on a session's connections."""


class EngineClient:
    """One engine. Use as `async with EngineClient(endpoint) as c:` (a bare URL works too)."""

    def __init__(self, engine: EngineAddress, max_connections: int = DEFAULT_CONNECTIONS):
        """`max_connections`: requests at once through this client (more wait for a connection;
        a multi-turn round's episodes each send their own: rollout/request.py)."""
        self.endpoint = as_endpoint(engine)
        self.url = self.endpoint.url
        self.timeout_s = self.endpoint.timeout_s
        self.max_connections = max(1, int(max_connections))
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, path: str, body: Optional[Dict[str, object]] = None,
                       timeout_s: Optional[float] = None, expect_json: bool = True) -> Any:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self.endpoint.headers(), connector=aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=IDLE_CONNECTION_S))
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.endpoint.control_timeout_s)
        async with self._session.request(method, self.url + path, json=body, timeout=timeout) as resp:
            text = await resp.text()
            try:
                data = await resp.json(content_type=None) if expect_json and text else text
            except ValueError:
                data = text
            if resp.status >= 400:
                raise EngineError(self.url, path, resp.status, data)
            return data

    # ---------------------------------------------------------------- generation
    async def generate(self, prompts: Sequence[PromptInput], sampling_params: RequestSamplingParams,
                       return_logprob: bool = True, timeout_s: Optional[float] = None,
                       return_routed_experts: bool = False) -> List[SampleResult]:
        """Batched /generate; returns len(prompts) * n SampleResults, prompt-major.

        `sampling_params`: one dict for every prompt, or a list of one dict per prompt (same n).
        `return_routed_experts`: a mixture of experts' engine started with
        `--enable-return-routed-experts` reports each token's experts (`meta_info.routed_experts`).
        """
        first = sampling_params[0] if isinstance(sampling_params, list) else sampling_params
        n = int(first.get("n", 1))
        sent_prompts, sent_params, sent_n = expand_seeded_samples(prompts, sampling_params)
        body = build_generate_body(sent_prompts, sent_params, return_logprob)
        if return_routed_experts:
            body["return_routed_experts"] = True
        # no total limit unless one is set: a 20k-token answer decodes for minutes (liveness
        # is the rollout manager's probes, not this request's duration)
        limit = timeout_s or self.endpoint.timeout_s or NO_LIMIT_S
        reply = await self._request("POST", "/generate", body, timeout_s=limit)
        results = parse_generate_reply(reply, len(sent_prompts), sent_n)
        for k, r in enumerate(results):  # copies of a prompt are its samples
            r.prompt_index, r.sample_index = k // n, k % n
        return results

    async def score_prompt(self, input_ids: Sequence[int], timeout_s: Optional[float] = None
                           ) -> Tuple[List[float], str]:
        """(log p of input_ids[1:], each given the tokens before it; the weight version that
        scored them) from /generate with `logprob_start_len` 0 and one new token (greedy: nothing
        random). SGLang 0.5.23 scores prompt tokens with the raw log-softmax, no temperature;
        its `input_token_logprobs` start with None for the first token."""
        body = build_generate_body([list(input_ids)], build_sampling_params(temperature=0.0, max_new_tokens=1),
                                   return_logprob=True)
        body["logprob_start_len"] = 0
        reply = await self._request("POST", "/generate", body, timeout_s=timeout_s or self.endpoint.control_timeout_s)
        meta = (reply[0] if isinstance(reply, list) else reply)["meta_info"]
        entries = meta.get("input_token_logprobs") or []
        if len(entries) != len(input_ids) or any(e[0] is None for e in entries[1:]):
            raise EngineError(self.url, "/generate", 200, f"input_token_logprobs has {len(entries)} entries for "
                              f"{len(input_ids)} input ids (logprob_start_len=0 should give one per id)")
        return [float(e[0]) for e in entries[1:]], str(meta.get("weight_version", ""))

    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            await self._request("GET", "/health", timeout_s=timeout_s, expect_json=False)
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, EngineError, OSError):
            return False

    async def loads(self) -> List[Dict[str, Any]]:
        """GET /v1/loads (core fields): one dict per DP rank with num_running_reqs,
        num_waiting_reqs, token_usage, ..."""
        return (await self._request("GET", "/v1/loads?include=core"))["loads"]

    async def wait_idle(self, timeout_s: Optional[float] = None, poll_s: float = 0.05) -> None:
        """Until no request runs or waits (SGLang releases memory only then: it asserts the
        scheduler is idle, and dies otherwise). Aborted requests leave the running batch at
        the scheduler's next step, after their replies were sent."""
        limit = timeout_s or self.endpoint.control_timeout_s
        deadline = asyncio.get_running_loop().time() + limit
        while True:
            loads = await self.loads()
            busy = sum(int(d.get("num_running_reqs", 0)) + int(d.get("num_waiting_reqs", 0)) for d in loads)
            if busy == 0:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise EngineError(self.url, "/v1/loads", 503, f"still {busy} requests after {limit:.0f} s")
            await asyncio.sleep(poll_s)

    async def model_info(self) -> Dict[str, object]:
        return await self._request("GET", "/model_info")

    async def weight_version(self) -> str:
        return str((await self.model_info())["weight_version"])

    async def server_info(self) -> Dict[str, object]:
        """SGLang's GET /server_info: the server's arguments as resolved at start (its `dtype`
        among them), and live scheduler state."""
        return await self._request("GET", "/server_info")

    # ---------------------------------------------------------------- control
    async def pause_generation(self, mode: str = "abort") -> Dict[str, object]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}")
        return await self._request("POST", "/pause_generation", control_body("/pause_generation", mode=mode))

    async def abort_request(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        """Finish request `rid` (or every request) with finish_reason abort; 200, empty body."""
        await self._request("POST", "/abort_request", control_body("/abort_request", rid=rid, abort_all=abort_all),
                            expect_json=False)

    async def begin_weight_update(self, selector: str = "all") -> Dict[str, object]:
        """Open the weight-update session every update must run in (one at a time per engine)."""
        return await self._request("POST", "/begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> Dict[str, object]:
        """Close the session `begin_weight_update` opened."""
        return await self._request("POST", "/end_weight_update", {})

    async def continue_generation(self) -> Dict[str, object]:
        return await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> str:
        return await self._request("POST", "/flush_cache", expect_json=False)

    async def release_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        return await self._request("POST", "/release_memory_occupation", control_body("", tags=tags))

    async def release_memory_when_idle(self, tags: Optional[List[str]] = None,
                                       timeout_s: Optional[float] = None) -> None:
        """`wait_idle`, then `release_memory_occupation`: the only release SGLang survives."""
        await self.wait_idle(timeout_s)
        return await self.release_memory_occupation(tags)

    async def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        return await self._request("POST", "/resume_memory_occupation", control_body("", tags=tags))

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = DEFAULT_GROUP_NAME,
                                        backend: str = "nccl", timeout_s: Optional[float] = None) -> Dict[str, object]:
        body = control_body("/init_weights_update_group", master_address=master_address,
                            master_port=int(master_port), rank_offset=int(rank_offset),
                            world_size=int(world_size), group_name=group_name, backend=backend)
        return await self._request("POST", "/init_weights_update_group", body, timeout_s=timeout_s)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> Dict[str, object]:
        return await self._request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(self, names: List[str], dtypes: List[str], shapes: List[List[int]],
                                              group_name: str = DEFAULT_GROUP_NAME,
                                              weight_version: Optional[str] = None,
                                              load_format: Optional[str] = None, flush_cache: bool = True,
                                              timeout_s: Optional[float] = None) -> Dict[str, object]:
        body = control_body("/update_weights_from_distributed", names=names, dtypes=dtypes, shapes=shapes,
                            group_name=group_name, weight_version=weight_version, load_format=load_format,
                            flush_cache=flush_cache)
        return await self._request("POST", "/update_weights_from_distributed", body, timeout_s=timeout_s)

    async def update_weights_from_tensor(self, serialized_named_tensors: List[str], load_format: Optional[str],
                                         weight_version: Optional[str] = None,
                                         flush_cache: bool = True) -> Dict[str, object]:
        body = control_body("/update_weights_from_tensor", serialized_named_tensors=serialized_named_tensors,
                            load_format=load_format, weight_version=weight_version, flush_cache=flush_cache)
        return await self._request("POST", "/update_weights_from_tensor", body)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> Dict[str, object]:
        return await self._request("POST", "/update_weight_version",
                                   {"new_version": str(new_version), "abort_all_requests": abort_all_requests})

    async def check_weights(self, action: str = "checksum", timeout_s: Optional[float] = None) -> Dict[str, object]:
        """`/weights_checker`: with action checksum, a checksum of every tensor the engine holds
        (`wire.checksum.reported_checksums` reads them)."""
        return await self._request("POST", "/weights_checker", {"action": action}, timeout_s=timeout_s)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return await self._request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})
