"""GPU clusters: sync a 7B-shaped model into a real SGLang server; seconds and GB/s.

NOT RUNNABLE IN THIS REPOSITORY'S CPU ENVIRONMENT (no GPU, sglang not installed). Written
against sglang 0.5.23's HTTP API (the pinned tables in dapo_mega/engines/sglang/api.py):
start a server yourself, e.g.

    python -m sglang.launch_server --model-path Qwen/Qwen2.5-7B --tp-size 1 --port 30000 \
        --weight-version 0
    python bench/gpu_sglang_sync.py --url http://127.0.0.1:30000 --model-path Qwen/Qwen2.5-7B \
        [--bucket-mb 512] [--engine-tp-size 1]

This process (one GPU, group rank 0) loads the HF checkpoint's tensors (bf16, CUDA), joins
an NCCL group with the server (`/init_weights_update_group`), then times two full syncs with
`WeightSyncer` (flattened buckets over NCCL) and prints seconds, GB/s and the version the
server reports. The server must be on the same node or reachable over the network with
NCCL; pick --master-address accordingly.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import torch

from dapo_mega.engines.fleet import free_port
from dapo_mega.engines.sglang.client import EngineClient
from dapo_mega.engines.sglang.endpoint import EngineEndpoint
from dapo_mega.weights.sync import WeightSyncer


def load_hf_state(model_path: str, device: str = "cuda"):
    """Every tensor of the safetensors shards, bf16 on `device` (~15 GB for a 7B model)."""
    from pathlib import Path

    from huggingface_hub import snapshot_download
    from safetensors.torch import load_file

    root = Path(model_path) if Path(model_path).is_dir() else Path(snapshot_download(model_path))
    state = {}
    for shard in sorted(root.glob("*.safetensors")):
        for name, t in load_file(str(shard)).items():
            state[name] = t.to(device=device, dtype=torch.bfloat16)
    return state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--api-key", default="")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--engine-tp-size", type=int, default=1)
    ap.add_argument("--master-address", default="127.0.0.1")
    ap.add_argument("--gpu", type=int, default=0,
                    help="this process's GPU, one the server does not hold (its caller's device rule)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU and a running SGLang server; see the docstring")
    torch.cuda.set_device(args.gpu)
    state = load_hf_state(args.model_path, device=f"cuda:{args.gpu}")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    engine = EngineEndpoint(args.url, api_key=args.api_key, timeout_s=1800)
    syncer = WeightSyncer([engine], bucket_mb=args.bucket_mb, backend="nccl",
                          master_address=args.master_address, engine_tp_size=args.engine_tp_size, timeout_s=1800)
    results = []
    try:
        syncer.init_group(master_port=free_port())
        for version in ("1", "2"):
            torch.cuda.synchronize()
            stats = syncer.sync(iter(state.items()), weight_version=version)
            results.append({"version": version, "seconds": stats.seconds, "gbps": stats.gbps,
                            "buckets": stats.num_buckets})

        async def version():
            async with EngineClient(engine) as c:
                return await c.weight_version()
        reported = asyncio.run(version())
    finally:
        syncer.destroy_group()
        syncer.close()
    print(json.dumps({"model_bytes": nbytes, "runs": results, "server_weight_version": reported}, indent=2))


if __name__ == "__main__":
    main()
