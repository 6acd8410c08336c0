"""The embedded rollout engine: SGLang's HTTP API subset over a HF transformers model.

    python -m dapo_mega.engines.embedded.server --model-path DIR --host 127.0.0.1 --port 30000 \
        [--api-key KEY] [--weight-version v0] [--tp-size 1] [--dtype float32] ...

It serves the paths, JSON fields and replies of `sglang.launch_server` (0.5.23; the pinned
tables are in `dapo_mega.engines.sglang.api`) for what an RL trainer uses: /generate,
/health, /model_info, /server_info, /v1/loads and /abort_request here; /pause_generation,
/continue_generation, /flush_cache, /release_memory_occupation, /resume_memory_occupation,
/init_weights_update_group, /destroy_weights_update_group, /begin_weight_update,
/end_weight_update, /update_weights_from_distributed, /update_weights_from_tensor,
/update_weight_version and /get_weights_by_name in `control.py`. The launcher starts it
exactly as it starts SGLang. `tests/engines/test_conformance.py` runs the same tests against
both servers.

What it enforces as SGLang 0.5.23 does (`validation.py` holds the rules and messages): a
prompt of at least the context length, or prompt + `max_new_tokens` beyond it, is a 400
naming the numbers (SGLang's messages), as are `max_new_tokens < 0` and `top_p` outside
(0, 1]; /generate errors reply `{"error": {"message": ...}}`; sequences beyond
--max-running-requests wait in a queue (--max-queued-requests bounds it: 503 "The request
queue is full."); SIGTERM aborts every sequence and exits within seconds.

Generation runs in `engine.GenerationEngine`'s thread; weight receives run in worker
threads (`control.py`), so the event loop keeps answering /health during a sync.

Where it departs from SGLang, deliberately (the control endpoints' departures are listed
in `control.py`):
* Unknown JSON fields are a 400 (SGLang ignores some); SGLang fields the engine does not
  implement (regex, LoRA, images, ...) are accepted only at their neutral value.
* --mem-fraction-static is accepted and ignored.
* Only --tp-size 1 and --dp-size 1 (start several engines instead).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import os
import signal
import threading
import time
import uuid
from typing import List, Optional

import torch
from aiohttp import web

from dapo_mega.config import ConfigError, require_api_key
from dapo_mega.engines.embedded.control import EngineControl
from dapo_mega.engines.embedded.engine import GenerationEngine
from dapo_mega.engines.embedded.sampling import Sequence_
from dapo_mega.engines.embedded.validation import (
    BadGenerateRequest,
    BadRequest,
    check_lengths,
    fail,
    parse_control_body,
    parse_prompts,
    parse_sampling,
    read_json,
)
from dapo_mega.heap import freeze_startup_objects

logger = logging.getLogger("dapo_mega.engines.embedded.server")

HEALTH_STALL_S = 20.0
"""/health answers 503 when sequences wait and no forward step ended this long ago (SGLang's
HEALTH_CHECK_TIMEOUT is 20 s too)."""
TEST_CLOCK_ENV = "DAPO_MEGA_TEST_CLOCK"
"""Set to 1 by tests and benchmarks that slow decoding (`--test-decode-delay-ms`) on purpose."""


class EngineServer:
    """aiohttp application around one GenerationEngine."""

    def __init__(self, engine: GenerationEngine, api_key: str = "", served_args: Optional[dict] = None,
                 memory_saver: bool = False):
        self.engine = engine
        self.runner = engine.runner
        self.api_key = api_key or ""
        self.served_args = served_args or {}
        self.control = EngineControl(engine, memory_saver=memory_saver)
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
        r.add_post("/abort_request", self.abort_request)
        self.control.add_routes(r)

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
            return fail(str(exc))

    # ------------------------------------------------------------------ info
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.is_progressing(HEALTH_STALL_S) else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.runner.model.config
        return web.json_response({
            "model_path": self.runner.model_path, "tokenizer_path": self.runner.model_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.runner.weight_version, "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None)})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self.served_args, "weight_version": self.runner.weight_version,
                                  "paused": self.engine.paused, "weights_released": self.runner.weights_released,
                                  "num_generated_tokens": self.engine.num_generated_tokens,
                                  "num_forward_steps": self.engine.num_forward_steps,
                                  "max_running_seen": self.engine.max_batch_seen,
                                  "weight_receive": self.control.receiver.stats_dict(),
                                  "engine": "dapo_mega.engines.embedded.server"})

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang's GET /v1/loads, its core per-DP-rank fields (one rank here)."""
        running, waiting = self.engine.load()
        used, total = self.engine.kv_tokens()
        load = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "max_running_requests": self.engine.max_running_requests, "num_used_tokens": used,
                "max_total_num_tokens": total, "token_usage": used / max(total, 1)}
        return web.json_response({"timestamp": time.time(), "loads": [load]})

    # ------------------------------------------------------------------ generate
    async def generate(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        prompts, is_single = parse_prompts(body, self.runner.tokenizer, self.runner.model.config.vocab_size)
        sp = body.get("sampling_params")
        sp_list = sp if isinstance(sp, list) else [sp] * len(prompts)
        if len(sp_list) != len(prompts):
            raise BadGenerateRequest("sampling_params list length differs from the batch size")
        parsed = [parse_sampling(s) for s in sp_list]
        for prompt, (spec, _) in zip(prompts, parsed):
            check_lengths(len(prompt), spec.max_new_tokens, self.runner.max_context)
            # SGLang's scheduler clamps max_new_tokens to max_req_len - input_len - 1, with
            # max_req_len = context - 1: a sequence ends (length) 2 tokens short of the context
            spec.max_new_tokens = min(spec.max_new_tokens, self.runner.max_context - 2 - len(prompt))
        n = parsed[0][1]
        if any(k != n for _, k in parsed):
            raise BadGenerateRequest("The parallel_sample_num should be the same for all samples in sample params.")
        rl = body.get("return_logprob") or False
        rl_list = rl if isinstance(rl, list) else [rl] * len(prompts)
        input_logprobs = await self._input_logprobs(prompts, rl_list, body.get("logprob_start_len"))
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
        experts_from = self._routed_experts_start(body, prompts)
        replies = [self._reply(seq, seq.rid, bool(rl_list[i]), input_logprobs[i], experts_from) for i, seq in seqs]
        if is_single and n == 1:
            return web.json_response(replies[0])
        return web.json_response(replies)

    async def _input_logprobs(self, prompts: List[List[int]], return_logprob: list, start: object) -> list:
        """Per prompt, SGLang's `input_token_logprobs` ([logprob, token id, None] from
        `logprob_start_len` on, the first logprob None), when it asked for log-probs with a
        logprob_start_len >= 0; else [] (SGLang's default start, -1, scores no prompt token
        here). Computed before the prompt's generation starts, with the weights held then."""
        starts = start if isinstance(start, list) else [start] * len(prompts)
        if len(starts) != len(prompts):
            raise BadGenerateRequest("logprob_start_len list length differs from the batch size")
        out = []
        for prompt, asked, first in zip(prompts, return_logprob, starts):
            if not asked or first is None or int(first) < 0:
                out.append([])
                continue
            if int(first) > len(prompt):  # SGLang's scheduler aborts the request with this message
                raise BadGenerateRequest(f"req.logprob_start_len={int(first)} is higher than the number of input "
                                         f"tokens len(req.origin_input_ids)={len(prompt)}. Please use a smaller "
                                         "logprob_start_len.")
            if int(first) == len(prompt):
                out.append([])
                continue
            try:
                values = await asyncio.to_thread(self.runner.prompt_logprobs, prompt, int(first))
            except RuntimeError as exc:  # weights released
                raise BadGenerateRequest(str(exc)) from exc
            out.append([[v, t, None] for v, t in zip(values, prompt[int(first):])])
        return out

    def _routed_experts_start(self, body: dict, prompts: List[List[int]]) -> Optional[int]:
        """SGLang's `return_routed_experts`: the first position reported (`routed_experts_start_len`,
        refused as SGLang's scheduler refuses it), or None when not asked for or not captured
        (a dense model, or no --enable-return-routed-experts: SGLang then reports none)."""
        if not body.get("return_routed_experts"):
            return None
        start = int(body.get("routed_experts_start_len") or 0)
        if start < 0:
            raise BadGenerateRequest(f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a "
                                     "non-negative routed_experts_start_len.")
        if any(start > len(p) for p in prompts):
            raise BadGenerateRequest(f"recv_req.routed_experts_start_len={start} is higher than the number of input "
                                     f"tokens len(req.origin_input_ids)={min(len(p) for p in prompts)}. Please use a "
                                     "smaller routed_experts_start_len.")
        return start if self.runner.routing is not None else None

    def _reply(self, seq: Sequence_, rid: str, return_logprob: bool, input_logprobs: list,
               experts_from: Optional[int] = None) -> dict:
        reason = seq.finish_reason or {"type": "abort", "message": "unfinished"}
        out_ids = list(seq.output_ids)
        matched = reason.get("matched")
        text_ids = out_ids
        if isinstance(matched, int) and not seq.spec.no_stop_trim and out_ids:
            text_ids = out_ids[:-1]  # SGLang trims a matched stop token from the text, not from output_ids
        text = self.runner.tokenizer.decode(text_ids, skip_special_tokens=seq.spec.skip_special_tokens)
        if isinstance(matched, str):
            pos = text.find(matched)
            if pos >= 0:
                text = text[: pos + len(matched)] if seq.spec.no_stop_trim else text[:pos]
        n_out = len(seq.output_ids)
        meta = {"id": rid, "finish_reason": reason, "prompt_tokens": len(seq.prompt_ids),
                "weight_version": self.runner.weight_version, "completion_tokens": n_out,
                "cached_tokens": 0,
                # Not in SGLang's default meta_info: timing the ledger records.
                "queue_time": (seq.start_time or seq.enqueue_time) - seq.enqueue_time,
                "e2e_latency": (seq.end_time or time.monotonic()) - seq.enqueue_time}
        if seq.spans:
            meta["weight_versions"] = [dict(s) for s in seq.spans]
            meta["weight_version"] = seq.spans[-1]["version"]
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids)]
            meta["input_token_logprobs"] = input_logprobs
        if experts_from is not None and seq.routed:
            # positions [start, prompt + output - 1): the last token was sampled, never fed
            end = len(seq.prompt_ids) + n_out - 1
            rows = seq.routed[min(experts_from, end):end]
            data = torch.stack(rows).numpy().tobytes() if rows else b""
            meta["routed_experts"] = base64.b64encode(data).decode()
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    async def abort_request(self, request: web.Request) -> web.Response:
        b = parse_control_body("/abort_request", await read_json(request, allow_empty=True))
        if b["abort_all"] or b.get("rid"):
            await asyncio.to_thread(self.engine.abort, b.get("rid"), bool(b["abort_all"]))
        return web.Response(status=200)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


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
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="a mixture of experts records each token's routed experts; /generate with "
                        "return_routed_experts reports them (SGLang's flag and format)")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="hold torch_memory_saver's contract: a second release, or a weight update while "
                        "released, ends the engine as it would on a GPU")
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
    try:
        require_api_key(args.host, args.api_key, "--api-key", "pass --api-key or bind --host 127.0.0.1")
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING))
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    engine = GenerationEngine(args.model_path, dtype=args.dtype, max_running_requests=args.max_running_requests,
                              weight_version=args.weight_version, batch_wait_s=args.batch_wait_ms / 1000,
                              seed=args.random_seed, enable_weights_cpu_backup=args.enable_weights_cpu_backup,
                              max_queued_requests=args.max_queued_requests,
                              decode_delay_s=args.test_decode_delay_ms / 1000)
    if args.enable_return_routed_experts:
        engine.runner.enable_expert_capture()
    served = {k: v for k, v in vars(args).items() if k != "api_key"}
    server = EngineServer(engine, api_key=args.api_key, served_args=served, memory_saver=args.enable_memory_saver)
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
