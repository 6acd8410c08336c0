"""Weight-sync throughput: WeightSyncer end to end vs a raw flat broadcast, same processes.

One learner (this process, group rank 0) and two embedded engine processes share one gloo
group. (1) `WeightSyncer.sync` of a Qwen2-shaped model (pause + flush, buckets of
`bucket_mb`, per-bucket HTTP metadata + flattened broadcast, engines load by HF name and set
the version, continue). (2) one broadcast of a flat uint8 buffer of the same byte count into
the same engine processes (`/debug/receive_flat`, receive and discard). Reports both GB/s
and sync/raw (goal >= 0.8). JSON to bench/results/weight_sync.json.

Where the real SGLang CPU venv exists (`$DAPO_MEGA_SGLANG_PYTHON` or `.venv-sglang`, built by
../shared/sglang-cpu/setup.sh), the same sync also goes into one real SGLang 0.5.23 server
(update session, flattened buckets over gloo), against a raw broadcast of the same bytes into
a plain receiver process (SGLang has no receive-and-discard endpoint): keys `sglang_*`.

    python bench/bench_weight_sync.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dapo_mega.config import ModelConfig, RolloutConfig
from dapo_mega.backends.sglang.client import EngineClient
from dapo_mega.rollout.fleet import EngineFleet, free_port
from dapo_mega.weights.sync import WeightSyncer

RESULTS = Path(__file__).resolve().parent / "results" / "weight_sync.json"


def run(quick: bool = False) -> dict:
    from transformers import AutoModelForCausalLM

    from dapo_mega.models.tiny import build_tiny_model_dir

    cfg = (ModelConfig(tiny_hidden_size=512, tiny_num_layers=4, tiny_num_attention_heads=8, tiny_num_key_value_heads=4,
                       tiny_intermediate_size=1408) if quick else
           ModelConfig(tiny_hidden_size=1024, tiny_num_layers=8, tiny_num_attention_heads=16,
                       tiny_num_key_value_heads=8, tiny_intermediate_size=2816))
    bucket_mb = 16 if quick else 128
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model_dir(tmp, model_cfg=cfg, seed=0)
        state = {k: v.clone() + 1e-3 for k, v in AutoModelForCausalLM.from_pretrained(tmp).state_dict().items()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        fleet = EngineFleet(RolloutConfig(health_timeout_s=300, request_timeout_s=600), tmp, Path(tmp) / "logs",
                            num_threads=1)
        engines = fleet.start(2)
        syncer = WeightSyncer(engines, bucket_mb=bucket_mb, backend="gloo", timeout_s=600)
        try:
            syncer.init_group(master_port=free_port())
            syncer.sync(iter(state.items()), weight_version="0")  # warm-up (first touches, allocator)
            stats = syncer.sync(iter(state.items()), weight_version="1")

            async def raw_receivers():
                async def one(url):
                    async with EngineClient(url) as c:
                        return await c._request("POST", "/debug/receive_flat",
                                                {"group_name": syncer.group_name, "nbytes": nbytes})
                return await asyncio.gather(*(one(e) for e in engines))

            flat = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
            raw_seconds = []
            for _ in range(2):  # first is warm-up
                fut = syncer._io.submit(raw_receivers())
                t0 = time.perf_counter()
                torch.distributed.broadcast(flat, src=0, group=syncer.group)
                fut.result(600)
                raw_seconds.append(time.perf_counter() - t0)
            async def read_version(url):
                async with EngineClient(url) as c:
                    return await c.weight_version()
            versions = [asyncio.run(read_version(e)) for e in engines]
        finally:
            syncer.destroy_group()
            syncer.close()
            fleet.close()
    raw_gbps = nbytes / raw_seconds[-1] / 1e9
    result = {"quick": quick, "model_bytes": nbytes, "num_tensors": stats.num_tensors, "bucket_mb": bucket_mb,
              "num_buckets": stats.num_buckets, "num_engines": 2, "sync_seconds": stats.seconds,
              "sync_gbps": stats.gbps, "raw_broadcast_seconds": raw_seconds[-1], "raw_broadcast_gbps": raw_gbps,
              "ratio_sync_over_raw": stats.gbps / raw_gbps, "goal_ratio": 0.8, "engine_versions_after": versions,
              "backend": "gloo (CPU)"}
    # the keys bench/run.py tabulates
    result.update(name="weight_sync", metric="weight sync GB/s", ours=stats.gbps, baseline=raw_gbps,
                  baseline_name="raw broadcast of the same bytes", ratio=result["ratio_sync_over_raw"],
                  higher_is_better=True)
    result.update(run_sglang(cfg, bucket_mb))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    return result


RAW_RECEIVER = """
import sys, torch
from dapo_mega.weights import transport
port, nbytes = int(sys.argv[1]), int(sys.argv[2])
pg = transport.init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 1, "raw")
for _ in range(3):
    torch.distributed.broadcast(torch.empty(nbytes, dtype=torch.uint8), src=0, group=pg)
transport.destroy_custom_process_group(pg)
"""


def run_sglang(cfg, bucket_mb: float) -> dict:
    """The sync into one real SGLang server vs a raw broadcast of the same bytes; {} without SGLang."""
    from transformers import AutoModelForCausalLM

    from dapo_mega.models.tiny import build_tiny_model_dir
    from dapo_mega.weights import transport

    python = Path(os.environ.get("DAPO_MEGA_SGLANG_PYTHON") or Path(__file__).resolve().parents[1] / ".venv-sglang"
                  / "bin" / "python")
    if not python.exists():
        return {"sglang_skipped": f"no SGLang venv at {python} (../shared/sglang-cpu/setup.sh)"}
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model_dir(tmp, model_cfg=cfg, seed=0)
        state = {k: v.clone() + 1e-3 for k, v in AutoModelForCausalLM.from_pretrained(tmp).state_dict().items()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        rollout = RolloutConfig(backend="sglang", engine_python=str(python), dtype="float32", health_timeout_s=300,
                                request_timeout_s=600, extra_server_args=["--max-total-tokens", "4096"])
        fleet = EngineFleet(rollout, tmp, Path(tmp) / "logs", device="cpu")
        syncer = None
        try:
            engines = fleet.start(1)
            syncer = WeightSyncer(engines, bucket_mb=bucket_mb, backend="gloo", timeout_s=600)
            syncer.init_group(master_port=free_port())
            syncer.sync(iter(state.items()), weight_version="0")  # warm-up
            stats = syncer.sync(iter(state.items()), weight_version="1")
            version = asyncio.run(_version(engines[0]))
        finally:
            if syncer is not None:
                syncer.destroy_group()
                syncer.close()
            fleet.close()
    port = free_port()
    receiver = subprocess.Popen([sys.executable, "-c", RAW_RECEIVER, str(port), str(nbytes)])
    try:
        pg = transport.init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "raw")
        flat = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        seconds = []
        for _ in range(3):  # first is warm-up; the best of the other two
            t0 = time.perf_counter()
            torch.distributed.broadcast(flat, src=0, group=pg)
            seconds.append(time.perf_counter() - t0)
        receiver.wait(timeout=120)
        transport.destroy_custom_process_group(pg)
    finally:
        if receiver.poll() is None:
            receiver.kill()
    raw_gbps = nbytes / min(seconds[1:]) / 1e9
    return {"sglang_sync_gbps": stats.gbps, "sglang_sync_seconds": stats.seconds, "sglang_num_buckets": stats.num_buckets,
            "sglang_raw_broadcast_gbps": raw_gbps, "sglang_ratio_sync_over_raw": stats.gbps / raw_gbps,
            "sglang_version_after": version, "sglang_model_bytes": nbytes}


async def _version(url) -> str:
    async with EngineClient(url) as c:
        return await c.weight_version()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(run(ap.parse_args().quick), indent=2))
