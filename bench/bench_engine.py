"""Rollout throughput: the embedded engine (HTTP, batched, KV cache) vs transformers `generate`.

Same tiny model, same prompts, same number of samples and new tokens (EOS ignored so both
produce exactly the same token count), same torch thread count. The engine is measured end
to end through its HTTP API (one batched /generate with n samples per prompt); transformers
runs `model.generate(do_sample=True, num_return_sequences=n)` on the left-padded batch
in this process. JSON to bench/results/engine.json.

Where the real SGLang CPU venv exists (`$DAPO_MEGA_SGLANG_PYTHON` or `.venv-sglang`, built by
tools/setup_sglang_cpu.sh), the same rollout also runs on a real SGLang 0.5.23 server
(float32, the same thread count): keys `sglang_*`.

    python bench/bench_engine.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from dapo_mega.backends.sglang.client import EngineClient
from dapo_mega.config import RolloutConfig
from dapo_mega.rollout.fleet import EngineFleet

RESULTS = Path(__file__).resolve().parent / "results" / "engine.json"


def run(quick: bool = False) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_mega.models.tiny import build_tiny_model_dir

    num_prompts, n, new_tokens, threads = (4, 4, 32, 2) if quick else (16, 8, 96, 2)
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model_dir(tmp, seed=0)
        tok = AutoTokenizer.from_pretrained(tmp)
        prompts = [tok(f"{a}+{b}=", add_special_tokens=False).input_ids for a, b in
                   zip(range(10, 10 + num_prompts), range(37, 37 + num_prompts))]
        with EngineFleet(RolloutConfig(), tmp, Path(tmp) / "logs", num_threads=threads) as fleet:
            engine_s, engine_tokens = timed_rollout(fleet.start(1)[0], prompts, n, new_tokens)
        sglang = run_sglang(tmp, prompts, n, new_tokens, threads)

        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(tmp).eval()
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        with torch.no_grad():
            model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=True,
                           pad_token_id=tok.pad_token_id)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=True, num_return_sequences=n, pad_token_id=tok.pad_token_id)
            hf_s = time.perf_counter() - t0
        hf_tokens = (out.shape[1] - width) * out.shape[0]
    result = {"quick": quick, "num_prompts": num_prompts, "n": n, "max_new_tokens": new_tokens, "threads": threads,
              "engine_seconds": engine_s, "engine_tokens": engine_tokens, "engine_tokens_per_s": engine_tokens / engine_s,
              "hf_generate_seconds": hf_s, "hf_tokens": hf_tokens, "hf_tokens_per_s": hf_tokens / hf_s,
              "ratio_engine_over_hf": (engine_tokens / engine_s) / (hf_tokens / hf_s), **sglang}
    if "sglang_tokens_per_s" in sglang:
        result["sglang_ratio_over_hf"] = sglang["sglang_tokens_per_s"] / result["hf_tokens_per_s"]
    # the keys bench/run.py tabulates
    result.update(name="engine", metric="rollout tokens/s", ours=result["engine_tokens_per_s"],
                  baseline=result["hf_tokens_per_s"], baseline_name="transformers generate",
                  ratio=result["ratio_engine_over_hf"], higher_is_better=True)
    if "sglang_tokens_per_s" in sglang:
        result["rows"] = [{"name": "engine (SGLang)", "metric": "rollout tokens/s, real SGLang 0.5.23 (CPU)",
                           "ours": sglang["sglang_tokens_per_s"], "baseline": result["hf_tokens_per_s"],
                           "baseline_name": "transformers generate", "ratio": result["sglang_ratio_over_hf"],
                           "higher_is_better": True}]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    return result


def timed_rollout(endpoint, prompts, n: int, new_tokens: int) -> tuple:
    """(seconds, generated tokens) of one sampled rollout on `endpoint`, after a warm-up request."""
    async def rollout_once():
        async with EngineClient(endpoint) as c:
            await c.generate(prompts[:1], {"max_new_tokens": 2, "n": 1})  # warm-up
            t0 = time.perf_counter()
            out = await c.generate(prompts, {"n": n, "max_new_tokens": new_tokens, "temperature": 1.0,
                                             "ignore_eos": True})
            return time.perf_counter() - t0, sum(len(s.token_ids) for s in out)
    return asyncio.run(rollout_once())


def run_sglang(model_dir: str, prompts, n: int, new_tokens: int, threads: int) -> dict:
    """The same rollout on a real SGLang server; {} (with the reason) without the SGLang venv."""
    python = Path(os.environ.get("DAPO_MEGA_SGLANG_PYTHON") or Path(__file__).resolve().parents[1] / ".venv-sglang"
                  / "bin" / "python")
    if not python.exists():
        return {"sglang_skipped": f"no SGLang venv at {python} (tools/setup_sglang_cpu.sh)"}
    rollout = RolloutConfig(backend="sglang", engine_python=str(python), dtype="float32", health_timeout_s=300,
                            max_running_requests=len(prompts) * n,
                            extra_server_args=["--max-total-tokens", "8192"])
    with EngineFleet(rollout, model_dir, Path(model_dir) / "sglang_logs", device="cpu",
                     extra_env={"OMP_NUM_THREADS": str(threads)}) as fleet:
        seconds, tokens = timed_rollout(fleet.start(1)[0], prompts, n, new_tokens)
    return {"sglang_seconds": seconds, "sglang_tokens": tokens, "sglang_tokens_per_s": tokens / seconds}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(run(ap.parse_args().quick), indent=2))
