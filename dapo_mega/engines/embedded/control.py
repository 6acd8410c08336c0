"""The embedded engine's control endpoints: pausing, the KV cache and memory, the
weight-update groups and sessions, and the weight updates themselves (SGLang 0.5.23's
paths, fields and replies).

What it enforces as SGLang does: weight updates only inside a `/begin_weight_update` ...
`/end_weight_update` session (else 400). Where it departs, deliberately:
* `/update_weights_from_tensor` never unpickles: SGLang's pickled CUDA-IPC format
  (load_format null) is refused; the CPU colocated format `load_format="shared_memory_json"`
  carries, per entry of `serialized_named_tensors`, base64 of a JSON handle to a /dev/shm
  file (`wire.transport.write_shm_bucket`).
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
  (KV lives only as long as a batch).
* Memory release and resume keep the contract of the libraries behind them, and the engine
  exits (status 1) where SGLang's would: a resume of a tag not released (SGLang's scheduler
  raises KeyError from `offload_tags.remove`, and the server dies of it, with or without
  --enable-memory-saver); with --enable-memory-saver, a second release of a tag
  (torch_memory_saver: "Cannot pause allocation that is not active", `exit(1)`) and a weight
  update or read while the weights are released (on a GPU the paused pages are unmapped: an
  illegal memory access). Without --enable-memory-saver those two are a 400, as before.

Weight receives run in worker threads, so the event loop keeps answering /health during a
sync. A flattened bucket whose tensors lie back to back in the parameters' flat layout is
received straight into them; others go through a reused scratch buffer and a copy
(`flat_weights.py`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from typing import TYPE_CHECKING, Dict, Optional

import torch
from aiohttp import web

from dapo_mega.engines.embedded.engine import GenerationEngine
from dapo_mega.engines.embedded.flat_weights import BucketReceiver
from dapo_mega.engines.embedded.validation import BadRequest, fail, parse_control_body, read_json
from dapo_mega.engines.sglang.api import FLATTENED_BUCKET, PAUSE_MODES
from dapo_mega.wire import transport
from dapo_mega.wire.checksum import engine_checksum, overall_checksum, tensor_checksum

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SHM_LOAD_FORMAT = "shared_memory_json"

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""SGLang's GPU memory tags (`GPU_MEMORY_ALL_TYPES`): a release or resume without tags means all."""


def die(message: str) -> None:
    """End the engine process as SGLang's does on a broken memory contract: the message on
    stderr, exit status 1, nothing answered."""
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


class EngineControl:
    """The control endpoints of one GenerationEngine: its weight-update groups and session."""

    def __init__(self, engine: GenerationEngine, memory_saver: bool = False):
        self.engine = engine
        self.memory_saver = memory_saver
        """--enable-memory-saver: torch_memory_saver's contract holds (see the module docstring)."""
        self.offload_tags: set = set()
        """Tags released and not resumed (SGLang's `offload_tags`)."""
        self.runner = engine.runner
        self.receiver = BucketReceiver(engine.runner)
        self.groups: Dict[str, ProcessGroup] = {}
        self.update_session: Optional[str] = None
        """The open weight-update session's selector (None: no session; updates are refused)."""
        self._update_lock = asyncio.Lock()
        self._debug_buffer: Optional[torch.Tensor] = None

    def add_routes(self, r: web.UrlDispatcher) -> None:
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
        r.add_route("*", "/get_weights_by_name", self.get_weights_by_name)
        r.add_route("*", "/weights_checker", self.check_weights)
        # Not SGLang: receive-and-discard one flat broadcast, the raw-transport baseline of
        # bench/bench_weight_sync.py.
        r.add_post("/debug/receive_flat", self.debug_receive_flat)

    # ------------------------------------------------------------------ pause / cache / memory
    async def pause_generation(self, request: web.Request) -> web.Response:
        body = parse_control_body("/pause_generation", await read_json(request, allow_empty=True))
        if body["mode"] not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {PAUSE_MODES}")
        await asyncio.to_thread(self.engine.pause, body["mode"])
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        parse_control_body("/continue_generation", await read_json(request, allow_empty=True))
        self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(text="Cache flushed.\n", status=200)
        return web.Response(text="Flush cache failed: requests hold the KV cache (paused in_place).\n", status=400)

    async def release_memory(self, request: web.Request) -> web.Response:
        body = parse_control_body("/release_memory_occupation", await read_json(request, allow_empty=True))
        tags = body["tags"] or list(MEMORY_TAGS)
        if set(tags) - set(MEMORY_TAGS):
            raise BadRequest(f"unknown tags {tags}")
        if not self.engine.is_idle():  # SGLang asserts this, and its scheduler dies of it
            running, waiting = self.engine.load()
            raise BadRequest(f"release_memory_occupation should be called only when server is idle "
                             f"({running} running, {waiting} waiting)")
        again = [t for t in tags if t in self.offload_tags and t != "cuda_graph"]  # no graphs on a CPU
        if again and self.memory_saver:
            die(f"[torch_memory_saver.cpp] Cannot pause allocation that is not active. tag={again[0]} "
                "(a second /release_memory_occupation: torch_memory_saver exits the engine)")
        self.offload_tags.update(tags)
        if "weights" in tags:
            await asyncio.to_thread(self.engine.release_weights)
            self.receiver.scratch.free()
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        body = parse_control_body("/resume_memory_occupation", await read_json(request, allow_empty=True))
        tags = body["tags"] or list(MEMORY_TAGS)
        missing = [t for t in tags if t not in self.offload_tags]
        if missing:  # SGLang: offload_tags.remove(tag) raises in the scheduler, and the server dies
            die(f"KeyError: {missing[0]!r} (/resume_memory_occupation of memory that was not released: "
                "SGLang's scheduler raises in resume_memory_occupation and the server exits)")
        self.offload_tags.difference_update(tags)
        if "weights" in tags:
            await asyncio.to_thread(self.engine.resume_weights)
        return web.json_response(None)

    def _require_weights(self, what: str) -> None:
        """Weights released: with --enable-memory-saver the engine dies as on a GPU (the paused
        pages are unmapped), else a 400."""
        if not self.runner.weights_released:
            return
        if self.memory_saver:
            die(f"CUDA error: an illegal memory access was encountered ({what} while the weights are released: "
                "torch_memory_saver unmapped them)")
        raise BadRequest(f"{what}: weights are released; call /resume_memory_occupation first")

    # ------------------------------------------------------------------ weight updates
    async def init_group(self, request: web.Request) -> web.Response:
        b = parse_control_body("/init_weights_update_group", await read_json(request))
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
            return fail(f"Failed to initialize custom process group: {exc}.")
        self.groups[b["group_name"]] = pg
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_group(self, request: web.Request) -> web.Response:
        b = parse_control_body("/destroy_weights_update_group", await read_json(request, allow_empty=True))
        if b["group_name"] not in self.groups:
            return fail("The group to be destroyed does not exist.")
        pg = self.groups.pop(b["group_name"])
        await asyncio.to_thread(transport.destroy_custom_process_group, pg)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        b = parse_control_body("/begin_weight_update", await read_json(request, allow_empty=True))
        if b["selector"] not in ("target", "draft", "all"):
            raise BadRequest(f"selector must be one of target, draft, all; got {b['selector']!r}")
        if self.update_session is not None:
            return fail("a weight-update session is already open; call end_weight_update() first")
        self.update_session = b["selector"]
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        parse_control_body("/end_weight_update", await read_json(request, allow_empty=True))
        if self.update_session is None:
            return fail("no weight-update session is open; call begin_weight_update() first")
        async with self._update_lock:  # loads still running finish inside the session
            self.update_session = None
        return web.json_response({"success": True, "message": "Success"})

    def _require_session(self, path: str) -> None:
        if self.update_session is None:
            raise BadRequest(f"{path.lstrip('/')} must run between begin_weight_update() and end_weight_update()")

    async def _maybe_abort(self, abort_all: bool) -> None:
        if abort_all:
            was_paused = self.engine.paused
            await asyncio.to_thread(self.engine.pause, "abort")
            if not was_paused:
                self.engine.resume()

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        b = parse_control_body("/update_weights_from_distributed", await read_json(request))
        self._require_session("/update_weights_from_distributed")
        names, dtypes, shapes = b["names"], b["dtypes"], b["shapes"]
        if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
            raise BadRequest("names, dtypes and shapes must be lists")
        error = self.runner.check_named_meta(names, dtypes, shapes)
        if error:
            raise BadRequest(error)
        if b["load_format"] not in (None, FLATTENED_BUCKET):
            raise BadRequest(f"load_format {b['load_format']!r} not supported (null or {FLATTENED_BUCKET})")
        if b["group_name"] not in self.groups:
            raise BadRequest(f"Group {b['group_name']} not in {sorted(self.groups)}. "
                             "Please call `init_weights_update_group` first.")
        self._require_weights("/update_weights_from_distributed")
        try:
            # Receives are serialised (they must match the sender's broadcast order); the
            # load runs outside the lock so bucket k loads while bucket k+1 is received.
            async with self._update_lock:
                await self._maybe_abort(b["abort_all_requests"])
                received = await asyncio.to_thread(
                    self.receiver.receive, self.groups[b["group_name"]], names,
                    [transport.parse_dtype(d) for d in dtypes], shapes, b["load_format"])
            await asyncio.to_thread(self.receiver.load, received, b["weight_version"])
        except Exception as exc:
            return fail(f"Failed to update parameter online: {exc}. The weights may be partially updated.")
        message = _updated("Succeeded to update parameter online.", b["weight_version"])
        return web.json_response({"success": True, "message": message})

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        b = parse_control_body("/update_weights_from_tensor", await read_json(request))
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
        error = self.runner.check_named_meta([m.name for m in metas], [transport.dtype_name(m.dtype) for m in metas],
                                             [list(m.shape) for m in metas])
        if error:
            raise BadRequest(error)
        self._require_weights("/update_weights_from_tensor")
        async with self._update_lock:
            await self._maybe_abort(b["abort_all_requests"])
            try:
                named = await asyncio.to_thread(transport.read_shm_bucket, path, metas)
                await asyncio.to_thread(self.runner.load_named_tensors, named, b["weight_version"])
            except (OSError, ValueError) as exc:
                return fail(f"Failed to read shared-memory tensors: {exc}")
        return web.json_response({"success": True, "message": _updated("Success", b["weight_version"])})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        b = parse_control_body("/update_weight_version", await read_json(request))
        await self._maybe_abort(b["abort_all_requests"])
        with self.runner.model_lock:
            self.runner.weight_version = str(b["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {b['new_version']}",
                                  "new_version": b["new_version"]})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        if not body and request.query:
            body = {k: (int(v) if k == "truncate_size" else v) for k, v in request.query.items()}
        b = parse_control_body("/get_weights_by_name", body)
        try:
            w = await asyncio.to_thread(self.runner.get_weight, b["name"])
        except (KeyError, RuntimeError) as exc:
            return web.json_response({"error": {"message": f"Get parameter by name failed: {exc}"}}, status=400)
        rows = w.numpy().tolist()
        return web.json_response(rows[: int(b["truncate_size"])] if isinstance(rows, list) else rows)


    async def check_weights(self, request: web.Request) -> web.Response:
        """SGLang's `/weights_checker`, action checksum (the only one here): every parameter's
        checksum by HF name (`wire.checksum`), as one TP rank, in SGLang's reply."""
        b = parse_control_body("/weights_checker", await read_json(request, allow_empty=True) or {})
        if b["action"] != "checksum":
            raise BadRequest(f"/weights_checker: action {b['action']!r} is not served by the embedded engine "
                             "(checksum is)")
        skip = tuple(b["skip_tensor_list"] or ())

        self._require_weights("/weights_checker")

        def compute() -> Dict[str, str]:
            with self.runner.model_lock:
                if self.runner.weights_released:
                    raise BadRequest("/weights_checker: the weights are released (resume_memory_occupation first)")
                return {name: tensor_checksum(self.runner.tensor(name)) for name in self.runner.views
                        if not any(pattern in name for pattern in skip)}
        checksums = await asyncio.to_thread(compute)
        digest = overall_checksum(checksums)
        rank = {"checksums": checksums, "per_gpu_checksum": digest, "parallelism_info": [{
            "role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
            "rank": 0, "size": 1}]}
        return web.json_response({"success": True, "message": "Success.", "ranks": [rank],
                                  "per_engine_checksum": engine_checksum([digest])})

    async def debug_receive_flat(self, request: web.Request) -> web.Response:
        """The benchmark's raw baseline: receive `nbytes` from group rank 0 in broadcasts of
        `bucket_bytes` (default: one) into a buffer kept and touched across calls (the
        transport alone, no first-touch page faults), and discard them."""
        body = await read_json(request)
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

