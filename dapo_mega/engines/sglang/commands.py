"""Command lines of rollout engines and of sglang-router, built from `RolloutConfig`.

Both engines start the same way: `python -m sglang.launch_server ...` on GPU clusters and
`python -m dapo_mega.engines.embedded.server ...` (the embedded CPU engine, which accepts the same
flags) everywhere else. Flag names come from `api.SERVER_FLAGS`, pinned from sglang 0.5.23
(`srt/arg_groups/fields/*.py`); router flags from sglang-router 0.3.2.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence

from dapo_mega.config import EngineKind, RolloutConfig, require_api_key
from dapo_mega.engines.sglang.api import ROUTER_FLAGS, ROUTER_POLICIES, SERVER_FLAGS

SGLANG_MODULE = "sglang.launch_server"
EMBEDDED_MODULE = "dapo_mega.engines.embedded.server"
ROUTER_MODULE = "sglang_router.launch_router"


def resolve_engine_dtype(dtype: str, backend: str) -> str:
    """`auto` means float32 on the CPU engine and bfloat16 on SGLang (GPU)."""
    if dtype != "auto":
        return dtype
    return "float32" if backend == EngineKind.EMBEDDED else "bfloat16"


def build_engine_command(
    cfg: RolloutConfig,
    model_path: str,
    port: int,
    weight_version: str = "default",
    host: Optional[str] = None,
    python: str = sys.executable,
    memory_saver: bool = False,
    base_gpu_id: Optional[int] = None,
    routed_experts: bool = False,
    max_total_tokens: Optional[int] = None,
) -> List[str]:
    """argv of one engine: `[python, -m, <module>, --model-path, ..., *extra_server_args]`.

    The module is sglang.launch_server for rollout.backend=sglang, else the embedded
    engine. Memory flags (`--mem-fraction-static`, `--enable-memory-saver`) are passed to
    both; the embedded engine accepts and ignores what has no meaning on a CPU.

    memory_saver: `--enable-memory-saver`, for colocated engines (cluster.mode=colocated):
        without it SGLang's `/release_memory_occupation` frees nothing and the learner
        trains next to a full KV cache (sglang 0.5.23 `ExecConfig.enable_memory_saver`).
    base_gpu_id: SGLang `--base-gpu-id` (the first GPU the engine uses among those visible
        to it); the placement narrows CUDA_VISIBLE_DEVICES per engine and passes 0.
        SGLang only: the embedded CPU engine has no GPUs.
    routed_experts: `--enable-return-routed-experts` (`reports_routed_experts` says when).
    max_total_tokens: SGLang `--max-total-tokens`, the KV pool's cap (`cpu_kv_tokens` on a CPU);
        a value in `extra_server_args` wins.
    """
    host = host or cfg.host
    require_api_key(host, cfg.api_key, "rollout.api_key")
    module = SGLANG_MODULE if cfg.backend == EngineKind.SGLANG else EMBEDDED_MODULE
    f = SERVER_FLAGS
    argv = [python, "-m", module,
            f["model_path"], str(model_path),
            f["host"], host,
            f["port"], str(port),
            f["tp_size"], str(cfg.engine_tp_size),
            f["dp_size"], str(cfg.engine_dp_size),
            f["dtype"], resolve_engine_dtype(cfg.dtype, cfg.backend),
            f["mem_fraction_static"], str(cfg.mem_fraction_static),
            f["max_running_requests"], str(cfg.max_running_requests),
            f["weight_version"], str(weight_version)]
    if cfg.api_key:
        argv += [f["api_key"], cfg.api_key]
    if memory_saver:
        argv.append(f["enable_memory_saver"])
    if base_gpu_id is not None and cfg.backend == EngineKind.SGLANG:
        argv += [f["base_gpu_id"], str(base_gpu_id)]
    if routed_experts and ROUTED_EXPERTS_FLAG not in cfg.extra_server_args:
        argv.append(ROUTED_EXPERTS_FLAG)
    if max_total_tokens and not any(a.split("=")[0] == f["max_total_tokens"] for a in cfg.extra_server_args):
        argv += [f["max_total_tokens"], str(max_total_tokens)]
    argv += list(cfg.extra_server_args)
    return argv


def cpu_server_args(cfg: RolloutConfig) -> List[str]:
    """What an SGLang engine on a CPU adds to its command line, where rollout.extra_server_args
    does not already say it: `--device cpu`, and `--sleep-on-idle`: without it SGLang's
    scheduler polls its sockets with no pause between batches, so an idle engine takes a whole
    core from the learners beside it (measured on 2 cores: 1.0 core idle, 0.02 with the flag,
    which waits on the sockets and wakes when a request arrives)."""
    f, given = SERVER_FLAGS, {a.split("=")[0] for a in cfg.extra_server_args}
    return ([] if f["device"] in given else [f["device"], "cpu"]) + \
        ([] if f["sleep_on_idle"] in given else [f["sleep_on_idle"]])


CPU_KV_MARGIN = 1.25
"""Head-room of a CPU engine's KV pool over the run's need (prefix-cache entries kept between
rounds, a continuation's re-sent prefix)."""


def cpu_kv_tokens(max_running_requests: int, context_tokens: int) -> int:
    """The KV pool of an SGLang engine on a CPU, in tokens: every running request at its
    longest (prompt + response) with CPU_KV_MARGIN, as a user sizes it by hand. On a CPU
    SGLang sizes its pool as on a GPU, mem_fraction_static of the host's free memory (0.7 of
    24 GiB held resident for a 2-layer model); `--max-total-tokens` caps it at this need."""
    if max_running_requests < 1 or context_tokens < 1:
        raise ValueError(f"cpu_kv_tokens: {max_running_requests} running requests x {context_tokens} tokens")
    return -(-max_running_requests * context_tokens * int(CPU_KV_MARGIN * 100) // 100)


def cpu_pool_tokens(cfg: RolloutConfig, context_tokens: int) -> int:
    """The KV pool an SGLang CPU engine of `cfg` holds: `--max-total-tokens N` where
    rollout.extra_server_args gives it, else `cpu_kv_tokens`."""
    args, flag = list(cfg.extra_server_args), SERVER_FLAGS["max_total_tokens"]
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith(flag + "=") else (
            args[i + 1] if arg == flag and i + 1 < len(args) else None)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"rollout.extra_server_args: {flag} {value!r} is not a whole number of tokens") \
                    from None
    return cpu_kv_tokens(cfg.max_running_requests, context_tokens)


def cpu_threads_per_engine(cpus: int, engines: int) -> int:
    """Threads of each embedded engine a trainer starts on its own machine's CPUs: one CPU is
    left to the trainer's process, which parses the replies and scores the samples while the
    engines generate (measured on 2 cores: a rollout step 0.125 s with both cores' threads in
    the engine, 0.10 s with one; the learner, idle then, takes every core in its turn)."""
    return max(1, (cpus - 1) // max(1, engines))


DEFAULT_CONTEXT_TOKENS = 4096
"""A request's longest context where neither the run nor the model's config says."""


def model_context_tokens(model_path: str) -> int:
    """The model's context length (config.json's max_position_embeddings), DEFAULT_CONTEXT_TOKENS
    where the path holds no readable config (a stand-in model path)."""
    import json
    from pathlib import Path

    try:
        value = json.loads((Path(model_path) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return DEFAULT_CONTEXT_TOKENS
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_CONTEXT_TOKENS


ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
"""SGLang's (and the embedded engine's) flag that records each token's experts for /generate."""


def reports_routed_experts(model_path: str) -> bool:
    """Whether engines started on `model_path` report each token's experts: a mixture of
    experts, on the embedded engine or SGLang (on a CPU the venv of tools/setup_sglang_cpu.sh
    gives its capturer a host buffer without CUDA: tools/sglang_cpu/cpu_host_buffers.py)."""
    from dapo_mega.models.shape import ModelShape

    if not model_path:
        return False
    try:
        moe = ModelShape.from_hf_config(model_path).is_moe
    except (OSError, ValueError, KeyError, TypeError):  # no readable config.json (a stand-in model path)
        return False
    return moe


def build_router_command(
    worker_urls: Sequence[str],
    port: int,
    host: str = "127.0.0.1",
    policy: str = "cache_aware",
    python: str = sys.executable,
    api_key: str = "",
) -> List[str]:
    """argv of sglang-router in front of `worker_urls` (cache-aware routing by default).

    `api_key`: the engines' key; sglang-router 0.3.2 sends it to its workers
    (`--api-key`, "the api key used for the authorization with the worker").
    """
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"router policy {policy!r} not in {ROUTER_POLICIES}")
    if not worker_urls:
        raise ValueError("sglang-router needs at least one worker url")
    argv = [python, "-m", ROUTER_MODULE, ROUTER_FLAGS["worker_urls"], *worker_urls,
            ROUTER_FLAGS["host"], host, ROUTER_FLAGS["port"], str(port),
            ROUTER_FLAGS["policy"], policy]
    if api_key:
        argv += [ROUTER_FLAGS["api_key"], api_key]
    return argv
