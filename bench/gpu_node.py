"""One GPU node (H100/H200 class): learner step, weight sync and rollout at 7B shape.

NOT RUNNABLE ON THE CPU (it exits saying so); its pure helpers (parameter count, FLOPs,
MFU) are tested on the CPU in tests/test_bench_formulas.py. Sized to finish within ~10
minutes on one H200:

    python bench/gpu_node.py                       8 of Qwen2.5-7B's 28 layers
    python bench/gpu_node.py --layers 28           the full depth, if memory allows
    python bench/gpu_node.py --skip-sglang --out /tmp/gpu_node.json

What it measures, each with the seconds it took (`seconds` = wall-clock of that part):

1. learner step, bf16: megatron-core GPTModel of Qwen2.5-7B's shape (hidden 3584, 28 heads,
   4 KV heads, FFN 18944, vocab 152064; random weights; `--layers` of them) through
   `MegatronLearner._update` (the trainer's DAPO step: forward, backward, Megatron
   optimizer), world size 1 on NCCL, on `--samples` variable-length samples up to
   `--seq-len` tokens. Transformer Engine layer spec when TE is importable, else the local
   spec (said in the result).
2. learner step, FP8 (TE only; tensorwise recipe): the same batch.
   MFU = model FLOPs / (seconds x peak); model FLOPs per step = 6·N·tokens + attention,
   N = non-embedding parameters + LM head (Eq. 1 of `train_flops`); peak = 989 TFLOP/s
   dense bf16 and 1979 FP8 (H100/H200 SXM). FP8 MFU is reported against both peaks.
3. weight sync into a real SGLang server (when `sglang` is importable): a server is
   started on an HF directory of the same shape, then `bench/gpu_sglang_sync.py` (NCCL
   group with the server, `WeightSyncer` buckets) syncs it twice; GB/s of the second.
4. SGLang rollout tokens/s on that server: `--rollout-prompts` prompts x n=`--rollout-n`
   samples of `--rollout-tokens` tokens (ignore_eos, random weights).
5. the colocated hand-over on one GPU (`part_handover`): the learner process builds the
   CUDA-IPC payload of the project's hand-over for the shape's layer weights, a second
   process on the same GPU (the engine's side) unpickles it with the same UUID patch and
   copies it out: bytes unchanged (checksum) and GB/s. Needs neither SGLang nor a NCCL
   group, so it runs on one GPU (a NCCL group of two processes on GPU 0 is refused:
   "Duplicate GPU detected"; the SGLang sync of part 3 needs a server on its own GPU).

Each part runs in its own subprocess, so GPU memory is free between parts. Whatever is not
installed is skipped and listed under "skipped" with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from dapo_mega.models.shape import ModelShape
from dapo_mega.plan import KNOWN_MODELS

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}
"""Dense peak TFLOP/s of H100/H200 SXM (no sparsity)."""


QWEN25_7B: ModelShape = KNOWN_MODELS["qwen2.5-7b"]
"""Qwen2.5-7B's shape (the project's one model-shape record, from plan's table)."""


# ============================================================================ pure helpers
def count_parameters(shape: ModelShape, include_embeddings: bool = True) -> int:
    """Parameters of a Qwen2 decoder (QKV bias, SwiGLU, RMSNorm, untied head by default).

    Per layer: Q (h·h + h), K and V (h·d_kv + d_kv each, d_kv = kv_heads·h/heads), O (h·h),
    MLP 3·h·ffn, two RMSNorms 2·h; plus the final norm h. With embeddings: the input
    embedding V·h and, untied, the LM head V·h.
    """
    h = shape.hidden_size
    kv_dim = shape.num_key_value_heads * (h // shape.num_attention_heads)
    per_layer = (h * h + h) + 2 * (h * kv_dim + kv_dim) + h * h + 3 * h * shape.ffn_hidden_size + 2 * h
    total = shape.num_layers * per_layer + h
    if include_embeddings:
        total += shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    return total


def train_flops(shape: ModelShape, sequence_lengths: Sequence[int]) -> float:
    """Model FLOPs of one training pass (forward + backward) over packed causal sequences.

        F = 6 · N · T  +  3 · 4 · L · h · Σ_s s²/2                                   (1)

    N = non-embedding parameters + LM head (the input embedding is a lookup), T = Σ s
    tokens. Attention: QKᵀ and AV are h·s²/2 multiply-adds each per layer under the causal
    mask (2 FLOPs per MAC), the backward pass twice the forward.
    """
    n = count_parameters(shape, include_embeddings=False) + shape.vocab_size * shape.hidden_size
    tokens = sum(sequence_lengths)
    attention = 3 * 4 * shape.num_layers * shape.hidden_size * sum(s * s / 2 for s in sequence_lengths)
    return 6.0 * n * tokens + attention


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak."""
    return flops / seconds / (peak_tflops * 1e12)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="transformer layers of the 7B shape (28 = full)")
    ap.add_argument("--seq-len", type=int, default=4096, help="longest sample (prompt + response) in tokens")
    ap.add_argument("--samples", type=int, default=32, help="samples per optimizer step")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="token budget of one micro-batch")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--rollout-prompts", type=int, default=64)
    ap.add_argument("--rollout-n", type=int, default=8)
    ap.add_argument("--rollout-tokens", type=int, default=1024)
    ap.add_argument("--skip-sglang", action="store_true", help="learner only")
    ap.add_argument("--out", default=str(BENCH_DIR / "results" / "gpu_node.json"))
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)  # internal: one part per subprocess
    return ap.parse_args(argv)


def sample_lengths(num: int, max_len: int, seed: int = 0) -> List[tuple]:
    """(prompt, response) lengths like DAPO math rollouts: prompts 1/8..1/4, responses
    1/4..3/4 of max_len (deterministic)."""
    import random

    rng = random.Random(seed)
    return [(rng.randint(max_len // 8, max_len // 4), rng.randint(max_len // 4, 3 * max_len // 4))
            for _ in range(num)]


def _model_config(shape: ModelShape, max_len: int):
    from dapo_mega.config import ModelConfig

    return ModelConfig(name="qwen2.5-7b-shape", tiny_hidden_size=shape.hidden_size, tiny_num_layers=shape.num_layers,
                       tiny_num_attention_heads=shape.num_attention_heads,
                       tiny_num_key_value_heads=shape.num_key_value_heads,
                       tiny_intermediate_size=shape.ffn_hidden_size,
                       tiny_tie_word_embeddings=shape.tie_word_embeddings,
                       tiny_max_position_embeddings=max(max_len, 4096))


# ============================================================================ parts (GPU)
def part_learner(args, precision: str) -> Dict[str, Any]:
    """One learner variant (bf16 or fp8), world size 1 on NCCL, through bench_learner's timing."""
    import random

    import torch

    sys.path.insert(0, str(BENCH_DIR))
    from bench_learner import _bench_megatron

    from dapo_mega.algo.train_sample import TrainSample
    from dapo_mega.backends.megatron.model import transformer_engine_import_error
    from dapo_mega.config import DapoConfig
    from dapo_mega.models.tiny import tiny_hf_config

    te_error = transformer_engine_import_error()
    te = te_error is None
    if precision == "fp8" and not te:
        return {"skipped": f"Transformer Engine does not import ({te_error}): no FP8 run"}
    shape = replace(QWEN25_7B, num_layers=args.layers)
    cfg = DapoConfig()
    cfg.model = _model_config(shape, args.seq_len)
    cfg.megatron.params_dtype = "bf16"
    cfg.megatron.micro_batch_tokens = max(args.micro_batch_tokens, args.seq_len)
    cfg.algo.lr, cfg.algo.lr_warmup_steps = 1e-6, 0
    hf_config = tiny_hf_config(cfg.model, vocab_size=shape.vocab_size)
    rng = random.Random(0)
    lengths = sample_lengths(args.samples, args.seq_len)
    samples = [TrainSample(prompt_ids=[rng.randrange(3, shape.vocab_size) for _ in range(p)],
                           response_ids=[rng.randrange(3, shape.vocab_size) for _ in range(r)],
                           advantage=1.0 if i % 2 else -1.0) for i, (p, r) in enumerate(lengths)]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    t0 = time.perf_counter()
    out = _bench_megatron(cfg, hf_config, samples, args.repeats, impl="transformer_engine" if te else "local",
                          fp8=precision == "fp8")
    flops = args.repeats * train_flops(shape, [p + r for p, r in lengths])
    timed = out.pop("seconds")  # the `repeats` timed steps only
    out.update(precision=precision, layers=args.layers, parameters=count_parameters(shape),
               tokens_per_step=sum(p + r for p, r in lengths), timed_seconds=timed,
               step_seconds=timed / args.repeats, model_tflops_per_step=flops / args.repeats / 1e12,
               mfu_vs_bf16_peak=mfu(flops, timed, PEAK_TFLOPS["bf16"]),
               seconds=time.perf_counter() - t0, max_memory_gib=torch.cuda.max_memory_allocated() / 2**30)
    if precision == "fp8":
        out["mfu_vs_fp8_peak"] = mfu(flops, timed, PEAK_TFLOPS["fp8"])
    if not te:
        out["note"] = "Transformer Engine not installed: local layer spec in bf16"
    return out


def _write_model_dir(shape: ModelShape, out: Path) -> Path:
    """An HF directory of the shape with random bf16 weights (and the char tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dapo_mega.models.tiny import build_char_tokenizer, tiny_hf_config

    config = tiny_hf_config(_model_config(shape, 8192), vocab_size=shape.vocab_size)
    config.dtype = "bfloat16"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    build_char_tokenizer().save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def part_sglang(args) -> Dict[str, Any]:
    """Start an SGLang server on a 7B-shaped model, sync into it, time a rollout."""
    from dapo_mega.backends.sglang.client import EngineClient
    from dapo_mega.config import RolloutConfig
    from dapo_mega.rollout.fleet import EngineFleet

    shape = replace(QWEN25_7B, num_layers=args.layers)
    result: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_node_model_") as tmp:
        t0 = time.perf_counter()
        model_dir = _write_model_dir(shape, Path(tmp) / "model")
        rollout_cfg = RolloutConfig(backend="sglang", mem_fraction_static=0.6, max_running_requests=512,
                                    health_timeout_s=600, request_timeout_s=900)
        fleet = EngineFleet(rollout_cfg, str(model_dir), Path(tmp), device="cuda")
        try:
            started = time.perf_counter()
            engine = fleet.start_on_this_node("bench/gpu_node.py", 1)[0]  # GPU 0 by the device rule
            url = engine.url
            result["server_start_seconds"] = time.perf_counter() - started
            t = time.perf_counter()
            import torch

            if torch.cuda.device_count() < 2:  # the syncer's NCCL rank would share GPU 0 with the server
                sync = None
                result["weight_sync"] = {"skipped": "one GPU: a NCCL group with the server on its GPU is refused "
                                                    "(Duplicate GPU detected); part 5 measures the hand-over"}
            else:
                from dapo_mega.backends.placement import gpu_block

                sync = subprocess.run([sys.executable, str(BENCH_DIR / "gpu_sglang_sync.py"), "--url", url,
                                       "--model-path", str(model_dir), "--gpu", str(gpu_block(1, 1)[0])],
                                      capture_output=True, text=True, timeout=600)  # the block after the engine's
            if sync is None:
                pass
            elif sync.returncode != 0:
                result["weight_sync"] = {"error": sync.stderr[-2000:]}
            else:
                text = sync.stdout[sync.stdout.index("{"):]
                report = json.loads(text)
                report["seconds"] = time.perf_counter() - t
                report["gbps"] = report["runs"][-1]["gbps"]
                result["weight_sync"] = report

            async def rollout():
                prompts = [[(7 * i + j) % 1000 + 3 for j in range(256)] for i in range(args.rollout_prompts)]
                params = {"n": args.rollout_n, "max_new_tokens": args.rollout_tokens, "temperature": 1.0,
                          "ignore_eos": True}
                async with EngineClient(engine) as client:
                    await client.generate(prompts[:1], {**params, "n": 1, "max_new_tokens": 8})  # warm-up
                    start = time.perf_counter()
                    out = await client.generate(prompts, params)
                    return time.perf_counter() - start, sum(len(s.token_ids) for s in out)

            seconds, tokens = asyncio.run(rollout())
            result["rollout"] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                                 "prompts": args.rollout_prompts, "n": args.rollout_n,
                                 "max_new_tokens": args.rollout_tokens}
        finally:
            fleet.close(grace_s=60)
        result["seconds"] = time.perf_counter() - t0
    return result


HANDOVER_RECEIVER = """
import base64, json, pickle, sys, time, torch
from dapo_mega.weights import transport
transport.patch_torch_reductions()  # the engine's side: the UUID back to this process's index
payload = sys.stdin.read()
t0 = time.perf_counter()
named = pickle.loads(base64.b64decode(payload))
kept = [(n, t.clone()) for n, t in named]  # what an engine's load does: copy out of the sender's memory
torch.cuda.synchronize()
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "tensors": len(kept), "device": str(kept[0][1].device),
                  "checksum": float(sum(t.double().sum().item() for _, t in kept)),
                  "bytes": sum(t.numel() * t.element_size() for _, t in kept)}))
"""


def part_handover(args) -> Dict[str, Any]:
    """The colocated weight path on one GPU: this process (the learner) builds the CUDA-IPC
    payload of the project's hand-over (`transport.serialize_cuda_ipc`: torch's reductions
    patched to name the GPU by UUID) for the 7B shape's layer tensors; a second process on
    the same GPU (the engine's side) unpickles it with the same patch and copies each tensor
    out; the bytes must arrive unchanged (checksum), and GB/s is what the copy-out sustains."""
    import torch

    from dapo_mega.weights import transport

    shape = replace(QWEN25_7B, num_layers=args.layers)
    h, ffn = shape.hidden_size, shape.ffn_hidden_size
    kv = shape.num_key_value_heads * (h // shape.num_attention_heads)
    gen = torch.Generator(device="cuda").manual_seed(0)
    named = []
    for layer in range(shape.num_layers):
        for name, dims in (("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (kv, h)),
                           ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, h)),
                           ("mlp.gate_proj.weight", (ffn, h)), ("mlp.up_proj.weight", (ffn, h)),
                           ("mlp.down_proj.weight", (h, ffn))):
            named.append((f"model.layers.{layer}.{name}",
                          torch.randn(dims, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    payload = transport.serialize_cuda_ipc(named)
    serialize_s = time.perf_counter() - t0
    proc = subprocess.run([sys.executable, "-c", HANDOVER_RECEIVER], input=payload, capture_output=True, text=True,
                          timeout=150, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        return {"error": f"receiver exit {proc.returncode}: {proc.stderr[-3000:]}"}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = float(sum(t.double().sum().item() for _, t in named))
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    return {"tensors": len(named), "bytes": nbytes, "serialize_seconds": serialize_s, "payload_chars": len(payload),
            "receive_seconds": got["seconds"], "gbps": nbytes / got["seconds"] / 1e9,
            "bytes_unchanged": got["bytes"] == nbytes and got["checksum"] == expected,
            "receiver_device": got["device"]}


# ============================================================================ driver
def _run_part(part: str, argv: List[str], timeout_s: float) -> Dict[str, Any]:
    """One part in a fresh process; its JSON is the last line of its stdout."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--part", part],
                              capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s", "seconds": time.perf_counter() - t0}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}", "seconds": time.perf_counter() - t0}
    return json.loads(lines[-1])


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.part:
        part = {"learner_bf16": lambda: part_learner(args, "bf16"), "learner_fp8": lambda: part_learner(args, "fp8"),
                "sglang": lambda: part_sglang(args), "handover": lambda: part_handover(args)}[args.part]
        print(json.dumps(part()))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_node.py needs a CUDA GPU (H100/H200 class); nothing run on this machine.")
        return 2
    from dapo_mega.backends.megatron.model import transformer_engine_import_error

    report: Dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "shape": {**asdict(QWEN25_7B), "num_layers": args.layers},
                              "parameters": count_parameters(replace(QWEN25_7B, num_layers=args.layers)),
                              "peak_tflops": PEAK_TFLOPS, "skipped": {}}
    t0 = time.perf_counter()
    report["learner_bf16"] = _run_part("learner_bf16", argv, 240)
    te_error = transformer_engine_import_error()
    if te_error is None:
        report["learner_fp8"] = _run_part("learner_fp8", argv, 240)
    else:
        report["skipped"]["learner_fp8"] = f"Transformer Engine does not import ({te_error}); the bf16 run used " \
                                           "the local spec"
    report["handover"] = _run_part("handover", argv, 180)  # two processes on one GPU: no NCCL group
    if args.skip_sglang:
        report["skipped"]["sglang"] = "--skip-sglang"
    elif importlib.util.find_spec("sglang") is None:
        report["skipped"]["sglang"] = "sglang is not installed: no weight sync into SGLang, no rollout tokens/s"
    else:
        report["sglang"] = _run_part("sglang", argv, 420)
    report["total_seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    for name, reason in report["skipped"].items():
        print(f"SKIPPED {name}: {reason}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
