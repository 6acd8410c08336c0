"""The embedded rollout engine: SGLang's HTTP API subset over a HF transformers model.

    python -m dapo_mega.rollout.server --model-path DIR --host 127.0.0.1 --port 30000 \
        [--api-key KEY] [--weight-version v0] [--tp-size 1] [--dtype float32] ...

It serves the paths, JSON fields and replies of `sglang.launch_server` (0.5.23; the pinned
tables are in `dapo_mega.backends.sglang.api`) for what an RL trainer uses: /generate,
/health, /model_info, /server_info, /pause_generation, /continue_generation, /flush_cache,
/release_memory_occupation, /resume_memory_occupation, /init_weights_update_group,
/destroy_weights_update_group, /begin_weight_update, /end_weight_update,
/update_weights_from_distributed, /update_weights_from_tensor, /update_weight_version,
/abort_request and /get_weights_by_name. The launcher starts it exactly as it starts
SGLang. `tests/rollout/test_conformance.py` runs the same tests against both servers.

What it enforces as SGLang 0.5.23 does: weight updates only inside a
`/begin_weight_update` ... `/end_weight_update` session (else 400); a prompt of at least
the context length, or prompt + `max_new_tokens` beyond it, is a 400 naming the numbers
(SGLang's messages), as are `max_new_tokens < 0` and `top_p` outside (0, 1]; /generate
errors reply `{"error": {"message": ...}}`; sequences beyond --max-running-requests wait
in a queue (--max-queued-requests bounds it: 503 "The request queue is full."); SIGTERM
aborts every sequence and exits within seconds.

Generation runs in `engine.GenerationEngine`'s thread; weight receives run in worker
threads, so the event loop keeps answering /health during a sync.

Where it departs from SGLang, deliberately:
* Unknown JSON fields are a 400 (SGLang ignores some); SGLang fields the engine does not
  implement (regex, LoRA, images, ...) are accepted only at their neutral value.
* `/update_weights_from_tensor` never unpickles: SGLang's pickled CUDA-IPC format
  (load_format null) is refused; the CPU colocated format `load_format="shared_memory_json"`
  carries, per entry of `serialized_named_tensors`, base64 of a JSON handle to a /dev/shm
  file (`weights.transport.write_shm_bucket`).
* Names, dtypes and shapes of an update are checked against the model before anything is
  received; a bad one is a 400 naming the tensor and the weights are unchanged. (SGLang
  0.5.23 joins the broadcast first, ignores an unknown name with a log line, answers a
  wrong shape with a 400 after a partial load, and dies on a wrong shape sent with
  /update_weights_from_tensor.)
* A release while sequences run (or wait, unpaused) is a 400; SGLang 0.5.23 asserts the
  server is idle and its scheduler dies (`scheduler_components/weight_updater.py`), so
  clients must wait for idle first (`EngineClient.wait_idle`).
* On a CPU, releasing `weights` frees the parameter storage (contents lost unless
  --enable-weights-cpu-backup, as in SGLang); `kv_cache` has nothing persistent to free
  (KV lives only as long as a batch). --mem-fraction-static is accepted and ignored.
* Only --tp-size 1 and --dp-size 1 (start several engines instead).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import math
import os
import signal
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch
from aiohttp import web

from dapo_mega.backends.sglang.api import (
    FLATTENED_BUCKET,
    GENERATE_FIELDS,
    GENERATE_FIELDS_OTHER,
    PAUSE_MODES,
    REQUEST_DEFAULTS,
    REQUEST_FIELDS,
    REQUEST_REQUIRED,
    SAMPLING_DEFAULTS,
    SAMPLING_FIELDS,
    SAMPLING_NEUTRAL,
)
from dapo_mega.heap import freeze_startup_objects
from dapo_mega.rollout.engine import GenerationEngine, SamplingSpec, Sequence_
from dapo_mega.weights import transport

logger = logging.getLogger("dapo_mega.rollout.server")

SHM_LOAD_FORMAT = "shared_memory_json"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
HEALTH_STALL_S = 20.0
"""/health answers 503 when sequences wait and no forward step ended this long ago (SGLang's
HEALTH_CHECK_TIMEOUT is 20 s too)."""
TEST_CLOCK_ENV = "DAPO_MEGA_TEST_CLOCK"
"""Set to 1 by tests and benchmarks that slow decoding (`--test-decode-delay-ms`) on purpose."""


class BadRequest(Exception):
    """Turned into a 400 reply; the engine state is unchanged."""


class BadGenerateRequest(BadRequest):
    """A refused /generate: SGLang's reply shape `{"error": {"message": ...}}`."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _fail(message: str, status: int = 400) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=status)


def check_lengths(prompt_len: int, max_new_tokens: int, context_len: int) -> None:
    """SGLang 0.5.23's length rules (`TokenizerManager._validate_one_request`), its messages."""
    if prompt_len >= context_len:
        raise BadGenerateRequest(f"The input ({prompt_len} tokens) is longer than the model's context length "
                                 f"({context_len} tokens).")
    if prompt_len + max_new_tokens > context_len:
        raise BadGenerateRequest(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. You "
            f"requested a total of {prompt_len + max_new_tokens} tokens: {prompt_len} tokens from the input "
            f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
            "the input messages or the completion to fit within the limit.")
    max_input = context_len - 6  # the scheduler's max_req_input_len: context - 1 - 5 (tp_worker.py)
    if prompt_len >= max_input:
        raise BadGenerateRequest(f"Input length ({prompt_len} tokens) exceeds the maximum allowed length ({max_input} "
                                 "tokens). Use a shorter input or enable --allow-auto-truncate.")


def parse_control_body(path: str, body: Any) -> Dict[str, Any]:
    """Validate a control request against SGLang's struct and fill its defaults."""
    if not isinstance(body, dict):
        raise BadRequest(f"{path}: the JSON body must be an object")
    unknown = set(body) - REQUEST_FIELDS[path]
    if unknown:
        raise BadRequest(f"{path}: unknown field(s) {sorted(unknown)}; accepted: {sorted(REQUEST_FIELDS[path])}")
    missing = REQUEST_REQUIRED[path] - set(body)
    if missing:
        raise BadRequest(f"{path}: missing field(s) {sorted(missing)}")
    out = dict(REQUEST_DEFAULTS[path])
    out.update(body)
    return out


def parse_sampling(params: Any) -> Tuple[SamplingSpec, int]:
    """SGLang sampling_params dict -> (SamplingSpec, n)."""
    params = params or {}
    if not isinstance(params, dict):
        raise BadGenerateRequest("sampling_params must be an object or a list of objects")
    unknown = set(params) - SAMPLING_FIELDS
    if unknown:
        raise BadGenerateRequest(f"unknown sampling_params field(s) {sorted(unknown)}")
    for key, neutral in SAMPLING_NEUTRAL.items():
        if key in params and params[key] not in (neutral, None):
            raise BadGenerateRequest(f"sampling_params.{key}={params[key]!r} is not supported by the embedded engine")
    p = {**SAMPLING_DEFAULTS, **{k: v for k, v in params.items() if k in SAMPLING_DEFAULTS and v is not None}}
    stop = p["stop"] or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        spec = SamplingSpec(
            max_new_tokens=int(p["max_new_tokens"]), temperature=float(p["temperature"]),
            top_p=float(p["top_p"]), top_k=int(p["top_k"]), min_p=float(p["min_p"]),
            min_new_tokens=int(p["min_new_tokens"]), stop=tuple(str(s) for s in stop),
            stop_token_ids=tuple(int(t) for t in (p["stop_token_ids"] or ())),
            ignore_eos=bool(p["ignore_eos"]), skip_special_tokens=bool(p["skip_special_tokens"]),
            no_stop_trim=bool(p["no_stop_trim"]),
            sampling_seed=None if p["sampling_seed"] is None else int(p["sampling_seed"]))
        n = int(p["n"])
    except (TypeError, ValueError) as exc:
        raise BadGenerateRequest(f"bad sampling_params: {exc}") from exc
    # SGLang's SamplingParams.verify messages
    if not math.isfinite(spec.temperature) or spec.temperature < 0:
        raise BadGenerateRequest(f"temperature must be a non-negative finite number, got {p['temperature']}.")
    if not 0 < spec.top_p <= 1:
        raise BadGenerateRequest(f"top_p must be in (0, 1], got {p['top_p']}.")
    if spec.max_new_tokens < 0:
        raise BadGenerateRequest(f"max_new_tokens must be at least 0, got {spec.max_new_tokens}.")
    if n < 1:
        raise BadGenerateRequest(f"n must be at least 1, got {n}.")
    return spec, n


class EngineServer:
    """aiohttp application around one GenerationEngine."""

    def __init__(self, engine: GenerationEngine, api_key: str = "", served_args: Optional[dict] = None):
        self.engine = engine
        self.api_key = api_key or ""
        self.served_args = served_args or {}
        self.groups: Dict[str, Any] = {}
        self.update_session: Optional[str] = None
        """The open weight-update session's selector (None: no session; updates are refused)."""
        self._update_lock = asyncio.Lock()
        self._debug_buffer: Optional[torch.Tensor] = None
        self.app = web.Application(middlewares=[self._auth_middleware], client_max_size=1 << 30)
        r = self.app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/release_memory_occupation", self.release_memory)
        r.add_route("*", "/resume_memory_occupation", self.resume_memory)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/get_weights_by_name", self.get_weights_by_name)
        # Not SGLang: receive-and-discard one flat broadcast, the raw-transport baseline of
        # bench/bench_weight_sync.py.
        r.add_post("/debug/receive_flat", self.debug_receive_flat)

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler):
        # SGLang exempts /health*, /ready*, /metrics* from the key (utils/auth.py).
        if self.api_key and not request.path.startswith(("/health", "/ready", "/metrics")):
            if request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
        try:
            return await handler(request)
        except BadGenerateRequest as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=exc.status)
        except BadRequest as exc:
            return _fail(str(exc))

    async def _json(self, request: web.Request, allow_empty: bool = False) -> Any:
        raw = await request.read()
        if not raw.strip():
            if allow_empty:
                return {}
            raise BadRequest("empty body; expected a JSON object")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"malformed JSON: {exc}") from exc

    # ------------------------------------------------------------------ info
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.is_progressing(HEALTH_STALL_S) else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.model.config
        return web.json_response({
            "model_path": self.engine.model_path, "tokenizer_path": self.engine.model_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version, "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None)})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self.served_args, "weight_version": self.engine.weight_version,
                                  "paused": self.engine.paused, "weights_released": self.engine.weights_released,
                                  "num_generated_tokens": self.engine.num_generated_tokens,
                                  "num_forward_steps": self.engine.num_forward_steps,
                                  "max_running_seen": self.engine.max_batch_seen,
                                  "engine": "dapo_mega.rollout.server"})

    # ------------------------------------------------------------------ generate
    async def generate(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if not isinstance(body, dict):
            raise BadGenerateRequest("the JSON body must be an object")
        unknown = set(body) - GENERATE_FIELDS
        if unknown:
            raise BadGenerateRequest(f"unknown /generate field(s) {sorted(unknown)}")
        for key in GENERATE_FIELDS_OTHER & set(body):
            if body[key] not in (None, False, 0, [], {}, "") and key not in ("http_worker_ipc",):
                raise BadGenerateRequest(f"/generate field {key!r} is not supported by the embedded engine")
        if body.get("stream"):
            raise BadGenerateRequest("stream=true is not supported by the embedded engine")
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise BadGenerateRequest("give exactly one of text or input_ids")
        if text is not None:
            is_single = isinstance(text, str)
            texts = [text] if is_single else text
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise BadGenerateRequest("text must be a string or a list of strings")
            prompts = [self.engine.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        else:
            is_single = isinstance(input_ids, list) and all(isinstance(t, int) for t in input_ids)
            prompts = [input_ids] if is_single else input_ids
            if not isinstance(prompts, list) or not all(
                    isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts):
                raise BadGenerateRequest("input_ids must be a list of ints or a list of lists of ints")
        vocab = self.engine.model.config.vocab_size
        for p in prompts:
            if not p:
                raise BadGenerateRequest("empty prompt")
            if min(p) < 0 or max(p) >= vocab:
                raise BadGenerateRequest(f"token id out of range [0, {vocab})")
        sp = body.get("sampling_params")
        sp_list = sp if isinstance(sp, list) else [sp] * len(prompts)
        if len(sp_list) != len(prompts):
            raise BadGenerateRequest("sampling_params list length differs from the batch size")
        parsed = [parse_sampling(s) for s in sp_list]
        for prompt, (spec, _) in zip(prompts, parsed):
            check_lengths(len(prompt), spec.max_new_tokens, self.engine.max_context)
            # SGLang's scheduler clamps max_new_tokens to max_req_len - input_len - 1, with
            # max_req_len = context - 1: a sequence ends (length) 2 tokens short of the context
            spec.max_new_tokens = min(spec.max_new_tokens, self.engine.max_context - 2 - len(prompt))
        n = parsed[0][1]
        if any(k != n for _, k in parsed):
            raise BadGenerateRequest("The parallel_sample_num should be the same for all samples in sample params.")
        rl = body.get("return_logprob") or False
        rl_list = rl if isinstance(rl, list) else [rl] * len(prompts)
        rid = body.get("rid") or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        # One wake-up of this loop per request, when its last sequence finishes (sequences
        # finish on the generation thread, or on an HTTP thread when aborted).
        remaining, lock = [len(prompts) * n], threading.Lock()

        def on_done(_seq: Sequence_) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                loop.call_soon_threadsafe(_set_result, done, None)

        seqs = []
        # SGLang's order: for each prompt i, its n samples j -> reply index i*n + j.
        for i, (prompt, (spec, _)) in enumerate(zip(prompts, parsed)):
            for j in range(n):
                seed = None if spec.sampling_seed is None else spec.sampling_seed + j
                seq = Sequence_(prompt_ids=list(prompt), spec=spec, generator=self.engine.new_generator(seed),
                                on_done=on_done, rid=f"{rid}_{len(seqs)}" if len(prompts) * n > 1 else rid)
                seqs.append((i, seq))
        if not self.engine.submit([s for _, s in seqs]):
            raise BadGenerateRequest("The request queue is full.", status=503)
        await done
        replies = [self._reply(seq, seq.rid, bool(rl_list[i])) for i, seq in seqs]
        if is_single and n == 1:
            return web.json_response(replies[0])
        return web.json_response(replies)

    def _reply(self, seq: Sequence_, rid: str, return_logprob: bool) -> dict:
        reason = seq.finish_reason or {"type": "abort", "message": "unfinished"}
        out_ids = list(seq.output_ids)
        matched = reason.get("matched")
        text_ids = out_ids
        if isinstance(matched, int) and not seq.spec.no_stop_trim and out_ids:
            text_ids = out_ids[:-1]  # SGLang trims a matched stop token from the text, not from output_ids
        text = self.engine.tokenizer.decode(text_ids, skip_special_tokens=seq.spec.skip_special_tokens)
        if isinstance(matched, str):
            pos = text.find(matched)
            if pos >= 0:
                text = text[: pos + len(matched)] if seq.spec.no_stop_trim else text[:pos]
        n_out = len(seq.output_ids)
        meta = {"id": rid, "finish_reason": reason, "prompt_tokens": len(seq.prompt_ids),
                "weight_version": self.engine.weight_version, "completion_tokens": n_out,
                "cached_tokens": 0,
                # Not in SGLang's default meta_info: timing the ledger records.
                "queue_time": (seq.start_time or seq.enqueue_time) - seq.enqueue_time,
                "e2e_latency": (seq.end_time or time.monotonic()) - seq.enqueue_time}
        if seq.spans:
            meta["weight_versions"] = [dict(s) for s in seq.spans]
            meta["weight_version"] = seq.spans[-1]["version"]
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids)]
            meta["input_token_logprobs"] = []
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    # ------------------------------------------------------------------ pause / cache / memory
    async def pause_generation(self, request: web.Request) -> web.Response:
        body = parse_control_body("/pause_generation", await self._json(request, allow_empty=True))
        if body["mode"] not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {PAUSE_MODES}")
        await asyncio.to_thread(self.engine.pause, body["mode"])
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        parse_control_body("/continue_generation", await self._json(request, allow_empty=True))
        self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(text="Cache flushed.\n", status=200)
        return web.Response(text="Flush cache failed: requests hold the KV cache (paused in_place).\n", status=400)

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang's GET /v1/loads, its core per-DP-rank fields (one rank here)."""
        running, waiting = self.engine.load()
        used, total = self.engine.kv_tokens()
        load = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "max_running_requests": self.engine.max_running_requests, "num_used_tokens": used,
                "max_total_num_tokens": total, "token_usage": used / max(total, 1)}
        return web.json_response({"timestamp": time.time(), "loads": [load]})

    async def release_memory(self, request: web.Request) -> web.Response:
        body = parse_control_body("/release_memory_occupation", await self._json(request, allow_empty=True))
        tags = body["tags"] or ["weights", "kv_cache"]
        if set(tags) - {"weights", "kv_cache", "cuda_graph"}:
            raise BadRequest(f"unknown tags {tags}")
        if not self.engine.is_idle():  # SGLang asserts this, and its scheduler dies of it
            running, waiting = self.engine.load()
            raise BadRequest(f"release_memory_occupation should be called only when server is idle "
                             f"({running} running, {waiting} waiting)")
        if "weights" in tags:
            await asyncio.to_thread(self.engine.release_weights)
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        body = parse_control_body("/resume_memory_occupation", await self._json(request, allow_empty=True))
        tags = body["tags"] or ["weights", "kv_cache"]
        if "weights" in tags:
            await asyncio.to_thread(self.engine.resume_weights)
        return web.json_response(None)

    # ------------------------------------------------------------------ weight updates
    async def init_group(self, request: web.Request) -> web.Response:
        b = parse_control_body("/init_weights_update_group", await self._json(request))
        if b["backend"] != "gloo" and not torch.cuda.is_available():
            raise BadRequest(f"backend {b['backend']!r} needs a GPU; the CPU engine joins with backend gloo")
        if b["group_name"] in self.groups:
            raise BadRequest(f"group {b['group_name']!r} already exists")
        try:
            pg = await asyncio.to_thread(
                transport.init_custom_process_group, backend=b["backend"],
                init_method=f"tcp://{b['master_address']}:{int(b['master_port'])}",
                world_size=int(b["world_size"]), rank=int(b["rank_offset"]), group_name=b["group_name"])
        except Exception as exc:
            return _fail(f"Failed to initialize custom process group: {exc}.")
        self.groups[b["group_name"]] = pg
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_group(self, request: web.Request) -> web.Response:
        b = parse_control_body("/destroy_weights_update_group", await self._json(request, allow_empty=True))
        if b["group_name"] not in self.groups:
            return _fail("The group to be destroyed does not exist.")
        pg = self.groups.pop(b["group_name"])
        await asyncio.to_thread(transport.destroy_custom_process_group, pg)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        b = parse_control_body("/begin_weight_update", await self._json(request, allow_empty=True))
        if b["selector"] not in ("target", "draft", "all"):
            raise BadRequest(f"selector must be one of target, draft, all; got {b['selector']!r}")
        if self.update_session is not None:
            return _fail("a weight-update session is already open; call end_weight_update() first")
        self.update_session = b["selector"]
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        parse_control_body("/end_weight_update", await self._json(request, allow_empty=True))
        if self.update_session is None:
            return _fail("no weight-update session is open; call begin_weight_update() first")
        async with self._update_lock:  # loads still running finish inside the session
            self.update_session = None
        return web.json_response({"success": True, "message": "Success"})

    def _require_session(self, path: str) -> None:
        if self.update_session is None:
            raise BadRequest(f"{path.lstrip('/')} must run between begin_weight_update() and end_weight_update()")

    async def abort_request(self, request: web.Request) -> web.Response:
        b = parse_control_body("/abort_request", await self._json(request, allow_empty=True))
        if b["abort_all"] or b.get("rid"):
            await asyncio.to_thread(self.engine.abort, b.get("rid"), bool(b["abort_all"]))
        return web.Response(status=200)

    async def _maybe_abort(self, abort_all: bool) -> None:
        if abort_all:
            was_paused = self.engine.paused
            await asyncio.to_thread(self.engine.pause, "abort")
            if not was_paused:
                self.engine.resume()

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        b = parse_control_body("/update_weights_from_distributed", await self._json(request))
        self._require_session("/update_weights_from_distributed")
        names, dtypes, shapes = b["names"], b["dtypes"], b["shapes"]
        if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
            raise BadRequest("names, dtypes and shapes must be lists")
        error = self.engine.check_named_meta(names, dtypes, shapes)
        if error:
            raise BadRequest(error)
        if b["load_format"] not in (None, FLATTENED_BUCKET):
            raise BadRequest(f"load_format {b['load_format']!r} not supported (null or {FLATTENED_BUCKET})")
        if b["group_name"] not in self.groups:
            raise BadRequest(f"Group {b['group_name']} not in {sorted(self.groups)}. "
                             "Please call `init_weights_update_group` first.")
        if self.engine.weights_released:
            raise BadRequest("weights are released; call /resume_memory_occupation first")
        try:
            # Receives are serialised (they must match the sender's broadcast order); the
            # load runs outside the lock so bucket k loads while bucket k+1 is received.
            async with self._update_lock:
                await self._maybe_abort(b["abort_all_requests"])
                named = await asyncio.to_thread(
                    receive_broadcast, self.groups[b["group_name"]], names,
                    [transport.parse_dtype(d) for d in dtypes], shapes, b["load_format"], self.engine.device)
            await asyncio.to_thread(self.engine.load_named_tensors, named, b["weight_version"])
        except Exception as exc:
            return _fail(f"Failed to update parameter online: {exc}. The weights may be partially updated.")
        return web.json_response({"success": True, "message": _updated("Succeeded to update parameter online.", b["weight_version"])})

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        b = parse_control_body("/update_weights_from_tensor", await self._json(request))
        self._require_session("/update_weights_from_tensor")
        if b["load_format"] != SHM_LOAD_FORMAT:
            raise BadRequest(f"load_format {b['load_format']!r}: the embedded engine never unpickles "
                             f"(SGLang's default format); send load_format={SHM_LOAD_FORMAT!r}")
        entries = b["serialized_named_tensors"]
        if not isinstance(entries, list) or len(entries) != 1:
            raise BadRequest("serialized_named_tensors must hold one entry (tp_size is 1)")
        try:
            handle = json.loads(base64.b64decode(entries[0], validate=True))
            path, metas = transport.parse_shm_handle(handle)
        except (ValueError, TypeError, KeyError) as exc:
            raise BadRequest(f"bad shared-memory handle: {exc}") from exc
        error = self.engine.check_named_meta([m.name for m in metas], [transport.dtype_name(m.dtype) for m in metas],
                                             [list(m.shape) for m in metas])
        if error:
            raise BadRequest(error)
        if self.engine.weights_released:
            raise BadRequest("weights are released; call /resume_memory_occupation first")
        async with self._update_lock:
            await self._maybe_abort(b["abort_all_requests"])
            try:
                named = await asyncio.to_thread(transport.read_shm_bucket, path, metas)
                await asyncio.to_thread(self.engine.load_named_tensors, named, b["weight_version"])
            except (OSError, ValueError) as exc:
                return _fail(f"Failed to read shared-memory tensors: {exc}")
        return web.json_response({"success": True, "message": _updated("Success", b["weight_version"])})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        b = parse_control_body("/update_weight_version", await self._json(request))
        await self._maybe_abort(b["abort_all_requests"])
        with self.engine.model_lock:
            self.engine.weight_version = str(b["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {b['new_version']}",
                                  "new_version": b["new_version"]})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await self._json(request, allow_empty=True)
        if not body and request.query:
            body = {k: (int(v) if k == "truncate_size" else v) for k, v in request.query.items()}
        b = parse_control_body("/get_weights_by_name", body)
        try:
            w = self.engine.get_weight(b["name"])
        except KeyError as exc:
            return web.json_response({"error": {"message": f"Get parameter by name failed: {exc}"}}, status=400)
        rows = w.to(torch.float32).cpu().numpy().tolist()
        return web.json_response(rows[: int(b["truncate_size"])] if isinstance(rows, list) else rows)


    async def debug_receive_flat(self, request: web.Request) -> web.Response:
        """The benchmark's raw baseline: receive `nbytes` from group rank 0 in broadcasts of
        `bucket_bytes` (default: one) into a buffer kept and touched across calls (the
        transport alone, no first-touch page faults), and discard them."""
        body = await self._json(request)
        if (not isinstance(body, dict) or not {"group_name", "nbytes"} <= set(body) <= {"group_name", "nbytes",
                                                                                      "bucket_bytes"}
                or body["group_name"] not in self.groups):
            raise BadRequest("body must be {group_name (an initialised group), nbytes, optional bucket_bytes}")
        pg, nbytes = self.groups[body["group_name"]], int(body["nbytes"])
        bucket = int(body.get("bucket_bytes") or nbytes)
        if self._debug_buffer is None or self._debug_buffer.numel() < nbytes:
            self._debug_buffer = torch.zeros(nbytes, dtype=torch.uint8)

        def _recv():
            for start in range(0, nbytes, bucket):
                torch.distributed.broadcast(self._debug_buffer[start:min(start + bucket, nbytes)], src=0, group=pg)
        await asyncio.to_thread(_recv)
        return web.json_response({"success": True, "message": "received"})


def _updated(message: str, weight_version: Optional[str]) -> str:
    """SGLang's reply to an update that set a version (tokenizer_control_mixin.py)."""
    return message if weight_version is None else f"{message} Weight version updated to {weight_version}."


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def receive_broadcast(pg, names: List[str], dtypes: List[torch.dtype], shapes: List[List[int]],
                      load_format: Optional[str], device) -> List[Tuple[str, torch.Tensor]]:
    """Receive one bucket from group rank 0, exactly as SGLang's receiver does.

    Per-tensor format: one broadcast per tensor, in list order. flattened_bucket: one
    uint8 broadcast of the bytes of all tensors back to back.
    """
    if load_format == FLATTENED_BUCKET:
        metas, nbytes = transport.bucket_layout(names, dtypes, shapes)
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        torch.distributed.broadcast(flat, src=0, group=pg)
        return transport.unflatten_bucket(flat, metas)
    out, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes):
        t = torch.empty([int(s) for s in shape], dtype=dtype, device=device)
        handles.append(torch.distributed.broadcast(t, src=0, group=pg, async_op=True))
        out.append((name, t))
    for h in handles:
        h.wait()
    return out


def build_arg_parser() -> argparse.ArgumentParser:
    """sglang.launch_server's flags where they apply to the embedded engine."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default="")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="accepted, ignored on CPU")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="refuse /generate with 503 beyond this many waiting sequences (default: no bound)")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--enable-memory-saver", action="store_true", help="accepted; release/resume always work")
    p.add_argument("--enable-weights-cpu-backup", action="store_true")
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="embedded only: batching window")
    p.add_argument("--num-threads", type=int, default=0, help="embedded only: torch threads (0 = default)")
    p.add_argument("--test-decode-delay-ms", type=float, default=0.0,
                   help=f"tests and benchmarks only ({TEST_CLOCK_ENV}=1): sleep this long after every forward "
                        "step, so a tiny model decodes at a large model's pace")
    return p


def main(argv: Optional[List[str]] = None) -> None:
    args = build_arg_parser().parse_args(argv)
    if args.test_decode_delay_ms and os.environ.get(TEST_CLOCK_ENV) != "1":
        raise SystemExit(f"--test-decode-delay-ms slows decoding on purpose, for tests and benchmarks of the "
                         f"run's clock only; set {TEST_CLOCK_ENV}=1 where that is what you want")
    if args.tp_size != 1 or args.dp_size != 1:
        raise SystemExit(f"the embedded engine supports --tp-size 1 and --dp-size 1 only (got "
                         f"{args.tp_size}/{args.dp_size}); start more engines instead")
    if args.host not in LOOPBACK and not args.api_key:
        raise SystemExit(f"refusing to bind {args.host} without --api-key: anyone on the network could "
                         "replace the weights. Pass --api-key or bind 127.0.0.1.")
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING))
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    engine = GenerationEngine(args.model_path, dtype=args.dtype, max_running_requests=args.max_running_requests,
                              weight_version=args.weight_version, batch_wait_s=args.batch_wait_ms / 1000,
                              seed=args.random_seed, enable_weights_cpu_backup=args.enable_weights_cpu_backup,
                              max_queued_requests=args.max_queued_requests,
                              decode_delay_s=args.test_decode_delay_ms / 1000)
    served = {k: v for k, v in vars(args).items() if k != "api_key"}
    server = EngineServer(engine, api_key=args.api_key, served_args=served)
    freeze_startup_objects()  # full GC passes stalled generation 100-200 ms (heap.py)
    serve(server, args.host, args.port)


def serve(server: EngineServer, host: str, port: int) -> None:
    """Run the app until SIGTERM / SIGINT; then abort every sequence and exit within seconds.

    aiohttp's own shutdown waits up to a minute for handlers in flight; here the engine
    first finishes every sequence with finish_reason abort, so each handler replies at once.
    """
    async def _main() -> None:
        runner = web.AppRunner(server.app, access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await asyncio.to_thread(server.engine.shutdown, 5.0)
        await asyncio.sleep(0.05)  # let the aborted handlers send their replies
        await runner.cleanup()

    asyncio.run(_main())


if __name__ == "__main__":
    main()
