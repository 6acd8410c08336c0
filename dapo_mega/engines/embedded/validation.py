"""What the embedded engine accepts: every request body checked against SGLang 0.5.23's
structs (the pinned tables in `dapo_mega.engines.sglang.api`) and its limits, with its
messages, before the engine sees it.

A refused request raises `BadRequest` (a control endpoint's 400, `{"success": false,
"message": ...}`) or `BadGenerateRequest` (a /generate error, `{"error": {"message": ...}}`);
the server's middleware turns either into the reply, and the engine state is unchanged.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Tuple

from aiohttp import web

from dapo_mega.engines.embedded.sampling import SamplingSpec
from dapo_mega.engines.sglang.api import (
    GENERATE_FIELDS,
    GENERATE_FIELDS_OTHER,
    REQUEST_DEFAULTS,
    REQUEST_FIELDS,
    REQUEST_REQUIRED,
    SAMPLING_DEFAULTS,
    SAMPLING_FIELDS,
    SAMPLING_NEUTRAL,
)


class BadRequest(Exception):
    """Turned into a 400 reply; the engine state is unchanged."""


class BadGenerateRequest(BadRequest):
    """A refused /generate: SGLang's reply shape `{"error": {"message": ...}}`."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def fail(message: str, status: int = 400) -> web.Response:
    """SGLang's reply to a control request that failed: `{"success": false, "message": ...}`."""
    return web.json_response({"success": False, "message": message}, status=status)


async def read_json(request: web.Request, allow_empty: bool = False) -> Any:
    """The request's JSON body (`{}` for an empty one where `allow_empty`)."""
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("empty body; expected a JSON object")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from exc


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


def parse_control_body(path: str, body: object) -> Dict[str, Any]:
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


def parse_prompts(body: object, tokenizer, vocab_size: int) -> Tuple[List[List[int]], bool]:
    """A /generate body's prompts as token ids, and whether it sent one prompt (not a list).

    Checks the body's fields first: unknown ones, SGLang fields the engine does not
    implement at a non-neutral value, and stream=true are refused.
    """
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
        prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    else:
        is_single = isinstance(input_ids, list) and all(isinstance(t, int) for t in input_ids)
        prompts = [input_ids] if is_single else input_ids
        if not isinstance(prompts, list) or not all(
                isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts):
            raise BadGenerateRequest("input_ids must be a list of ints or a list of lists of ints")
    for p in prompts:
        if not p:
            raise BadGenerateRequest("empty prompt")
        if min(p) < 0 or max(p) >= vocab_size:
            raise BadGenerateRequest(f"token id out of range [0, {vocab_size})")
    return prompts, is_single


def parse_sampling(params: object) -> Tuple[SamplingSpec, int]:
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
