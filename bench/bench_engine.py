"""Rollout throughput: the embedded engine (HTTP, batched, KV cache) vs transformers `generate`.

Same tiny model, same prompts, same number of samples and new tokens (EOS ignored, so both
produce exactly the same token count), same torch thread count. The engine is measured end
to end through its HTTP API (one batched /generate with n samples per prompt); the
baseline is `model.generate(do_sample=True, num_return_sequences=n, min_new_tokens=...)`
(SDPA attention, KV cache) on the left-padded batch in this process. Both run a full-size
call once to warm up, then are timed in alternation, `reps` rounds (3 quick, 5 full); the
figure is each side's fastest round with median and range (bench/timing.py). The workload
is 2,048 generated tokens per call at --quick (8 prompts x 4 x 64) and 16,384 at full size
(16 x 8 x 128). JSON to bench/results/engine.json.

Where the real SGLang CPU venv exists (`$DAPO_MEGA_SGLANG_PYTHON` or `.venv-sglang`, built by
tools/setup_sglang_cpu.sh), the same rollout also runs on a real SGLang 0.5.23 server
(float32, the same thread count), in a phase of its own after the embedded engine's
(alternating with `generate` again, its own baseline timings; the server stays up while
`generate` runs, with `--sleep-on-idle`, since SGLang's scheduler otherwise spins on a core
when idle): keys `sglang_*`, a second table row.

    python bench/bench_engine.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.engines.sglang.client import EngineClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import throughput_figure, time_alternating, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "engine.json"


class HFGenerate:
    """transformers `generate` on the left-padded prompts, n samples each, exactly `new_tokens` new."""

    def __init__(self, model_dir: str, prompts, n: int, new_tokens: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
        self.pad = tok.pad_token_id
        self.width = max(len(p) for p in prompts)
        self.ids = torch.tensor([[self.pad] * (self.width - len(p)) + p for p in prompts])
        self.mask = (torch.arange(self.width)[None] >= torch.tensor([self.width - len(p) for p in prompts])[:, None]).long()
        self.n, self.new_tokens = n, new_tokens
        self.tokens = 0

    def __call__(self) -> None:
        with torch.no_grad():
            out = self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=self.new_tokens,
                                      min_new_tokens=self.new_tokens, do_sample=True, num_return_sequences=self.n,
                                      pad_token_id=self.pad)
        self.tokens = (out.shape[1] - self.width) * out.shape[0]


class EngineRollout:
    """One sampled /generate of every prompt, n samples each, on an engine endpoint."""

    def __init__(self, endpoint, prompts, n: int, new_tokens: int):
        self.endpoint, self.prompts = endpoint, prompts
        self.params = {"n": n, "max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
        self.tokens = 0

    def __call__(self) -> None:
        async def once():
            async with EngineClient(self.endpoint) as c:
                out = await c.generate(self.prompts, self.params)
                return sum(len(s.token_ids) for s in out)
        self.tokens = asyncio.run(once())


def sglang_python() -> Path:
    return Path(os.environ.get("DAPO_MEGA_SGLANG_PYTHON") or Path(__file__).resolve().parents[1] / ".venv-sglang"
                / "bin" / "python")


def _timed(ours, baseline, reps: int) -> dict:
    ours(), baseline()  # warm-up at full size
    seconds = time_alternating({"ours": ours, "baseline": baseline}, reps)
    if ours.tokens != baseline.tokens:
        raise RuntimeError(f"the two sides generated {ours.tokens} and {baseline.tokens} tokens")
    return seconds


def run(quick: bool = False, reps: int = 0, sglang: bool = True) -> dict:
    from transformers import AutoTokenizer

    from dapo_mega.models.tiny import build_tiny_model_dir

    num_prompts, n, new_tokens, threads = (8, 4, 64, 2) if quick else (16, 8, 128, 2)
    reps = reps or (3 if quick else 5)
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model_dir(tmp, seed=0)
        tok = AutoTokenizer.from_pretrained(tmp)
        prompts = [tok(f"{a}+{b}=", add_special_tokens=False).input_ids for a, b in
                   zip(range(10, 10 + num_prompts), range(37, 37 + num_prompts))]
        hf = HFGenerate(tmp, prompts, n, new_tokens)
        with EngineFleet(RolloutConfig(max_running_requests=max(256, num_prompts * n)), tmp, Path(tmp) / "logs",
                         num_threads=threads) as fleet:
            engine = EngineRollout(fleet.start_on_this_node("bench_engine", 1)[0], prompts, n, new_tokens)
            seconds = _timed(engine, hf, reps)
        tokens = engine.tokens
        python = sglang_python()
        sglang_seconds, sglang_skipped = None, None
        if not sglang:
            sglang_skipped = "sglang=False"
        elif not python.exists():
            sglang_skipped = f"no SGLang venv at {python} (tools/setup_sglang_cpu.sh)"
        else:
            rollout = RolloutConfig(backend="sglang", engine_python=str(python), dtype="float32", health_timeout_s=300,
                                    max_running_requests=num_prompts * n,
                                    # idle, SGLang's scheduler spins on a core unless told to sleep:
                                    # the baseline's rounds beside it would get one core of two
                                    extra_server_args=["--max-total-tokens", str(max(8192, 2 * tokens)),
                                                       "--sleep-on-idle"])
            with EngineFleet(rollout, tmp, Path(tmp) / "sglang_logs", device="cpu",
                             extra_env={"OMP_NUM_THREADS": str(threads)}) as fleet:
                sglang_seconds = _timed(EngineRollout(fleet.start(1)[0], prompts, n, new_tokens), hf, reps)
    workload = f"{num_prompts} prompts x {n} samples x {new_tokens} new tokens = {tokens} tokens per call"
    detail = (f"transformers generate (SDPA, KV cache, do_sample, min_new_tokens) on the left-padded batch in one "
              f"process, {threads} threads as the engine; {workload}")
    result = {"quick": quick, "num_prompts": num_prompts, "n": n, "max_new_tokens": new_tokens, "threads": threads,
              "tokens_per_call": tokens, "reps": reps,
              **throughput_figure("engine", "rollout tokens/s", tokens, seconds["ours"], tokens, seconds["baseline"],
                                  "transformers generate", detail)}
    result.update(engine_tokens_per_s=result["ours"], hf_tokens_per_s=result["baseline"],
                  ratio_engine_over_hf=result["ratio"])
    if sglang_seconds is not None:
        row = throughput_figure("engine (SGLang)", "rollout tokens/s, real SGLang 0.5.23 (CPU)", tokens,
                                sglang_seconds["ours"], tokens, sglang_seconds["baseline"], "transformers generate",
                                detail + "; timed in alternation with the SGLang server in its own phase")
        result["rows"] = [row]
        result.update(sglang_tokens_per_s=row["ours"], sglang_hf_tokens_per_s=row["baseline"],
                      sglang_ratio_over_hf=row["ratio"])
    else:
        result["sglang_skipped"] = sglang_skipped
    write_result(RESULTS, result)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sglang", action="store_true", help="skip the real SGLang server's row")
    args = ap.parse_args()
    out = run(args.quick, sglang=not args.no_sglang)
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("_seconds")}, indent=2))
