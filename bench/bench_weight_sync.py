"""Weight-sync throughput: WeightSyncer end to end vs a raw flat broadcast, same processes.

One learner (this process, group rank 0) and two embedded engine processes share one gloo
group. (1) `WeightSyncer.sync` of a Qwen2-shaped model (pause + flush, buckets of
`bucket_mb`, per-bucket HTTP metadata + flattened broadcast, engines load by HF name and set
the version, continue). (2) the strongest fair baseline: broadcasts of a flat uint8 buffer of
the same byte count in the same bucket sizes into the same engine processes
(`/debug/receive_flat`: receive into a buffer the engine touched before, and discard), so
neither side pays first-touch page faults. The two are timed in alternation, `reps` times
each; reports the best of each as GB/s, sync/raw (goal >= 0.8), the ratio of medians and
each side's min / median / max. JSON to bench/results/weight_sync.json.

Where the real SGLang CPU venv exists (`$DAPO_MEGA_SGLANG_PYTHON` or `.venv-sglang`, built by
tools/setup_sglang_cpu.sh), a `WeightSyncer.sync` of a 378 MB float32 model (the same at
--quick: fixed round trips must not dominate) goes into one real SGLang 0.5.23 server (update
session, 32 MB flattened buckets over gloo), against a raw broadcast of the same bytes into a
plain receiver process (SGLang has no receive-and-discard endpoint) that runs at the same
time: sync, raw, raw again into a freshly allocated buffer, in turn, `reps` times; the
fastest of each is reported (keys `sglang_*`, and a second row for bench/run.py's table). The
headline baseline receives into a buffer it has touched before (the transport alone); the
fresh-buffer figure, which pays first-touch page faults on the receiving side, is beside it.

    python bench/bench_weight_sync.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from dapo_mega.config import ModelConfig, RolloutConfig
from dapo_mega.engines.fleet import EngineFleet, free_port
from dapo_mega.engines.sglang.client import EngineClient
from dapo_mega.weights.sync import WeightSyncer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import spread, throughput_figure, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "weight_sync.json"


def run(quick: bool = False, reps: int = 0) -> dict:
    from transformers import AutoModelForCausalLM

    from dapo_mega.models.tiny import build_tiny_model_dir

    cfg = (ModelConfig(tiny_hidden_size=512, tiny_num_layers=4, tiny_num_attention_heads=8, tiny_num_key_value_heads=4,
                       tiny_intermediate_size=1408) if quick else
           ModelConfig(tiny_hidden_size=1024, tiny_num_layers=8, tiny_num_attention_heads=16,
                       tiny_num_key_value_heads=8, tiny_intermediate_size=2816))
    bucket_mb = 16 if quick else 128
    reps = reps or (5 if quick else 7)
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model_dir(tmp, model_cfg=cfg, seed=0)
        state = {k: v.clone() + 1e-3 for k, v in AutoModelForCausalLM.from_pretrained(tmp).state_dict().items()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        fleet = EngineFleet(RolloutConfig(health_timeout_s=300, request_timeout_s=600), tmp, Path(tmp) / "logs",
                            num_threads=1)
        engines = fleet.start_on_this_node("bench_weight_sync", 2)
        syncer = WeightSyncer(engines, bucket_mb=bucket_mb, backend="gloo", timeout_s=600)
        try:
            syncer.init_group(master_port=free_port())
            syncer.sync(iter(state.items()), weight_version="0")  # warm-up (first touches, allocator)
            bucket_bytes = bucket_mb << 20

            async def raw_receivers():
                async def one(url):
                    async with EngineClient(url) as c:
                        return await c._request("POST", "/debug/receive_flat", {
                            "group_name": syncer.group_name, "nbytes": nbytes, "bucket_bytes": bucket_bytes})
                return await asyncio.gather(*(one(e) for e in engines))

            flat = torch.empty(nbytes, dtype=torch.uint8).fill_(1)

            def raw() -> float:
                """The same bytes in the sync's bucket sizes into buffers the engines touched before."""
                fut = syncer._io.submit(raw_receivers())
                t0 = time.perf_counter()
                for start in range(0, nbytes, bucket_bytes):
                    torch.distributed.broadcast(flat[start:start + bucket_bytes], src=0, group=syncer.group)
                fut.result(600)
                return time.perf_counter() - t0

            raw()  # warm-up: the engines' receive buffers are allocated and touched
            sync_s, raw_s = [], []
            for rep in range(reps):  # in alternation, so drift hits both sides alike
                sync_s.append(syncer.sync(iter(state.items()), weight_version=str(rep + 1)).seconds)
                raw_s.append(raw())

            async def read_version(url):
                async with EngineClient(url) as c:
                    return await c.weight_version()
            versions = [asyncio.run(read_version(e)) for e in engines]
        finally:
            syncer.destroy_group()
            syncer.close()
            fleet.close()
    sync_gbps, raw_gbps = nbytes / min(sync_s) / 1e9, nbytes / min(raw_s) / 1e9
    result = {"quick": quick, "model_bytes": nbytes, "num_tensors": len(state), "bucket_mb": bucket_mb,
              "num_buckets": -(-nbytes // bucket_bytes), "num_engines": 2, "reps": reps,
              "sync_seconds": sync_s, "sync_gbps": sync_gbps, "sync_seconds_spread": spread(sync_s),
              "raw_broadcast_seconds": raw_s, "raw_broadcast_gbps": raw_gbps,
              "raw_broadcast_seconds_spread": spread(raw_s), "ratio_sync_over_raw": sync_gbps / raw_gbps,
              "ratio_median": statistics.median(raw_s) / statistics.median(sync_s), "goal_ratio": 0.8,
              "engine_versions_after": versions, "backend": "gloo (CPU)",
              "baseline_detail": "raw broadcast of the same bytes in the same bucket sizes into a receive buffer "
                                 "the engines touched before; best of reps each, timed in alternation"}
    # the keys bench/run.py tabulates (best of each side, ratio of medians, spreads in GB/s)
    result.update(throughput_figure("weight_sync", "weight sync GB/s", nbytes / 1e9, sync_s, nbytes / 1e9, raw_s,
                                    "raw broadcast, same bytes and buckets, touched buffer",
                                    result["baseline_detail"]))
    sglang = run_sglang(reps=3 if quick else 5)
    result.update(sglang)
    if "sglang_sync_gbps" in sglang:  # a second row of bench/run.py's table
        gb = sglang["sglang_model_bytes"] / 1e9
        result["rows"] = [throughput_figure(
            "weight_sync (SGLang)", "weight sync GB/s, real SGLang", gb, sglang["sglang_sync_seconds"], gb,
            sglang["sglang_raw_broadcast_seconds"], "raw broadcast of the same bytes, touched buffer",
            f"one raw broadcast of the same bytes into a plain receiver process beside the server, into a buffer it "
            f"touched before (into a fresh buffer: {sglang['sglang_raw_fresh_buffer_gbps']:.3g} GB/s); SGLang "
            f"receives {SGLANG_BUCKET_MB} MB buckets; timed in turn with the sync")]
    write_result(RESULTS, result)
    return result


RAW_RECEIVER = """
import sys, torch
from dapo_mega.wire import transport
port, nbytes, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
pg = transport.init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 1, "raw")
kept = torch.zeros(nbytes, dtype=torch.uint8)  # touched once: the transport alone
for i in range(rounds):  # even rounds into `kept`, odd ones into a fresh (page-faulting) buffer
    buf = kept if i % 2 == 0 else torch.empty(nbytes, dtype=torch.uint8)
    torch.distributed.broadcast(buf, src=0, group=pg)
transport.destroy_custom_process_group(pg)
"""

SGLANG_MODEL = ModelConfig(tiny_hidden_size=1024, tiny_num_layers=8, tiny_num_attention_heads=16,
                           tiny_num_key_value_heads=8, tiny_intermediate_size=2816)
"""378 MB in float32: the ~25 ms of fixed round trips per sync (pause, flush, begin, end,
continue) are a few percent of it."""
SGLANG_BUCKET_MB = 128
"""SGLang allocates every received bucket afresh (`FlattenedTensorBucket.empty`); on a CPU,
glibc maps anything over its 32 MiB mmap threshold anew and page-faults it in. With 4 KiB
pages 128 MB buckets ran at ~0.6x of 32 MB ones; the fleet now starts CPU SGLang engines with
transparent huge pages for malloc (`CPU_SGLANG_MALLOC_TUNABLE`), and 128 MB buckets (3 per
sync, fewer round trips) measured 0.30 s against 0.42 s for 32 MB ones without."""


def run_sglang(reps: int) -> dict:
    """The sync into one real SGLang server vs a raw broadcast of the same bytes into a plain
    process, both running at once and timed in alternation (the fastest of `reps` each);
    {"sglang_skipped": why} without the SGLang venv."""
    from transformers import AutoModelForCausalLM

    from dapo_mega.models.tiny import build_tiny_model_dir
    from dapo_mega.wire import transport

    python = Path(os.environ.get("DAPO_MEGA_SGLANG_PYTHON") or Path(__file__).resolve().parents[1] / ".venv-sglang"
                  / "bin" / "python")
    if not python.exists():
        return {"sglang_skipped": f"no SGLang venv at {python} (tools/setup_sglang_cpu.sh)"}
    load_before = os.getloadavg()[0]
    sync_s, kept_s, fresh_s = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model_dir(tmp, model_cfg=SGLANG_MODEL, seed=0)
        state = {k: v.clone() + 1e-3 for k, v in AutoModelForCausalLM.from_pretrained(tmp).state_dict().items()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        rollout = RolloutConfig(backend="sglang", engine_python=str(python), dtype="float32", health_timeout_s=300,
                                request_timeout_s=600,
                                # an idle SGLang 0.5.23 scheduler spins on a core: it would slow the raw side
                                extra_server_args=["--max-total-tokens", "4096", "--sleep-on-idle"])
        port = free_port()
        receiver = subprocess.Popen([sys.executable, "-c", RAW_RECEIVER, str(port), str(nbytes), str(2 * (reps + 1))])
        fleet = EngineFleet(rollout, tmp, Path(tmp) / "logs", device="cpu")
        syncer = pg = None
        try:
            engines = fleet.start(1)
            pg = transport.init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "raw",
                                                     timeout=timedelta(seconds=600))
            flat = torch.empty(nbytes, dtype=torch.uint8).fill_(1)

            def raw() -> float:
                t0 = time.perf_counter()
                torch.distributed.broadcast(flat, src=0, group=pg)
                return time.perf_counter() - t0

            syncer = WeightSyncer(engines, bucket_mb=SGLANG_BUCKET_MB, backend="gloo", timeout_s=600)
            syncer.init_group(master_port=free_port())
            syncer.sync(iter(state.items()), weight_version="0")  # warm-up
            raw(), raw()
            for rep in range(reps):
                stats = syncer.sync(iter(state.items()), weight_version=str(rep + 1))
                sync_s.append(stats.seconds)
                kept_s.append(raw())
                fresh_s.append(raw())
            version = asyncio.run(_version(engines[0]))
            receiver.wait(timeout=120)
        finally:
            if syncer is not None:
                syncer.destroy_group()
                syncer.close()
            if pg is not None:
                transport.destroy_custom_process_group(pg)
            fleet.close()
            if receiver.poll() is None:
                receiver.kill()
    gbps = nbytes / min(sync_s) / 1e9
    raw_gbps = nbytes / min(kept_s) / 1e9
    fresh_gbps = nbytes / min(fresh_s) / 1e9
    return {"sglang_sync_gbps": gbps, "sglang_sync_seconds": sync_s, "sglang_num_buckets": stats.num_buckets,
            "sglang_bucket_mb": SGLANG_BUCKET_MB, "sglang_model_bytes": nbytes, "sglang_reps": reps,
            "sglang_raw_broadcast_gbps": raw_gbps, "sglang_raw_broadcast_seconds": kept_s,
            "sglang_ratio_sync_over_raw": gbps / raw_gbps,
            "sglang_raw_fresh_buffer_gbps": fresh_gbps, "sglang_raw_fresh_buffer_seconds": fresh_s,
            "sglang_ratio_sync_over_raw_fresh_buffer": gbps / fresh_gbps,
            "sglang_ratio_median": statistics.median(kept_s) / statistics.median(sync_s),
            "sglang_version_after": version, "sglang_load_average_before_after": [load_before, os.getloadavg()[0]]}


async def _version(url) -> str:
    async with EngineClient(url) as c:
        return await c.weight_version()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(run(ap.parse_args().quick), indent=2))
