"""Learner throughput: the Megatron train step vs plain PyTorch (HF transformers), one run.

    python bench/bench_learner.py [--quick]          -> bench/results/learner.json

Both sides train the same Qwen2-shaped model on the same batch of samples with a
long-tailed length distribution (log-normal responses, median 1/8 of the longest, a few
at the cap, as DAPO's responses are) on the same machine in this process: forward +
backward + AdamW step per mini-batch. Megatron runs twice: with sequence packing (the
default, `megatron.sequence_packing`) and with one sample per padded row, to measure what
packing buys; the result also gives each run's padding efficiency (real tokens / tokens
computed) and, from `packing.measure_layout`, the data-parallel imbalance the same batch
would have over 4 ranks with and without balancing (the benchmark itself runs DP 1).

* megatron: `MegatronLearner._update` (megatron-core GPTModel, get_forward_backward_func,
  Megatron DDP + get_megatron_optimizer) with the DAPO loss, one process (TP=PP=DP=1).
  On the CPU this is the local layer spec in fp32 with the CPU substitutions installed;
  on a GPU the TE spec in bf16 and, when Transformer Engine is installed, FP8 too, with
  model FLOPs utilisation (MFU) against the GPU's bf16 peak. Without TE the GPU run uses
  the local spec in bf16 and says so in the result.
* pytorch: transformers `Qwen2ForCausalLM` with the same padded micro-batches, the same
  token-level policy loss (`compute_policy_loss`), `torch.optim.AdamW`.

Tokens/s counts useful (unpadded) prompt + response tokens per second of the fastest of
`repeats` updates (each side; the total time is in the JSON too). The old-log-prob pass is
excluded on both sides. `run(quick)` returns the result dict (for a future bench/run.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "learner.json"
# Dense bf16 peak TFLOP/s used for MFU (H100/H200 SXM); override with DAPO_PEAK_TFLOPS.
DEFAULT_PEAK_TFLOPS = 989.0


def _model_shape(quick: bool, gpu: bool) -> Dict[str, int]:
    if gpu:
        return dict(tiny_hidden_size=1024, tiny_num_layers=8, tiny_num_attention_heads=16, tiny_num_key_value_heads=4,
                    tiny_intermediate_size=2816, tiny_max_position_embeddings=4096)
    if quick:
        return dict(tiny_hidden_size=64, tiny_num_layers=2, tiny_num_attention_heads=4, tiny_num_key_value_heads=2,
                    tiny_intermediate_size=256, tiny_max_position_embeddings=512)
    return dict(tiny_hidden_size=256, tiny_num_layers=4, tiny_num_attention_heads=8, tiny_num_key_value_heads=2,
                tiny_intermediate_size=768, tiny_max_position_embeddings=512)


def _samples(num: int, max_len: int, vocab: int, seed: int = 0):
    """Prompts of max_len/16..max_len/8 tokens; responses log-normal (median max_len/8, σ 1),
    capped so that prompt + response <= max_len; the longest sample is at the cap."""
    from dapo_mega.backends.megatron.batch import TrainSample

    rng = random.Random(seed)
    out = []
    for i in range(num):
        prompt_len = rng.randint(max(1, max_len // 16), max(1, max_len // 8))
        cap = max_len - prompt_len
        response_len = cap if i == 0 else max(1, min(cap, int(rng.lognormvariate(math.log(max_len / 8), 1.0))))
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        response = [rng.randrange(3, vocab) for _ in range(response_len)]
        out.append(TrainSample(prompt_ids=prompt, response_ids=response, advantage=1.0 if i % 2 else -1.0))
    return out


def _flops_per_token(shape: Dict[str, int], vocab: int, seq: int) -> float:
    """6·N (dense params, fwd+bwd) + attention 12·L·h·s/2 (causal), per token."""
    h, layers, ffn = shape["tiny_hidden_size"], shape["tiny_num_layers"], shape["tiny_intermediate_size"]
    heads, kv = shape["tiny_num_attention_heads"], shape["tiny_num_key_value_heads"]
    head_dim = h // heads
    attn_params = h * (heads + 2 * kv) * head_dim + heads * head_dim * h
    params = layers * (attn_params + 3 * h * ffn) + 2 * vocab * h
    return 6.0 * params + 6.0 * layers * h * seq


def _bench_megatron(cfg, hf_config, samples, repeats: int, impl: str, fp8: bool, packing: bool = True) -> Dict[str, Any]:
    from functools import partial

    from dapo_mega.backends.megatron.batch import count_loss_tokens
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.train_step import MegatronLearner
    from dapo_mega.distributed import free_port

    cfg.megatron.transformer_impl = impl
    cfg.megatron.sequence_packing = packing
    cfg.megatron.fp8.enabled = fp8
    cfg.megatron.fp8.recipe = "tensorwise" if fp8 else cfg.megatron.fp8.recipe
    layout = ParallelLayout.from_config(cfg.megatron, 1, hf_config).initialize(
        init_method=f"tcp://127.0.0.1:{free_port()}", rank=0)
    learner = MegatronLearner(cfg, hf_config, layout)
    indices = list(range(len(samples)))
    old = learner._local_log_probs(samples, indices)
    samples = [dataclasses.replace(s, old_log_probs=old[i].tolist()) for i, s in enumerate(samples)]
    tokens = float(count_loss_tokens(samples, indices))
    micro = learner._micro_batches(samples, indices)
    seqs = float(sum(1 for i in indices if any(samples[i].response_loss_mask())))  # seq-mean denominators
    loss_func = partial(learner._policy_loss_func, tokens, seqs)
    learner._update(micro, loss_func, lr=None)  # warm-up (allocations, TE kernels)
    _sync()
    elapsed, best = _time_updates(lambda: learner._update(micro, loss_func, lr=None), repeats)
    result = {"layer_spec": learner.info.layer_spec, "params_dtype": learner.info.params_dtype,
              "fp8": learner.info.fp8, "seconds": elapsed, "best_update_s": best,
              "tokens_per_s": sum(s.length for s in samples) / best,
              "micro_batches": len(micro), "sequence_packing": packing,
              "padding_efficiency": sum(mb.real_tokens for mb in micro) / sum(mb.tokens.numel() for mb in micro)}
    torch.distributed.destroy_process_group()
    layout.destroy()
    return result


def _bench_pytorch(cfg, hf_config, samples, repeats: int, dtype: torch.dtype) -> Dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from dapo_mega.algo import compute_policy_loss
    from dapo_mega.backends.megatron.batch import collate_micro_batch, count_loss_tokens, plan_micro_batches

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.algo.lr, betas=(cfg.algo.adam_beta1, cfg.algo.adam_beta2),
                                  weight_decay=cfg.algo.weight_decay)
    indices = list(range(len(samples)))
    groups = plan_micro_batches(samples, indices, cfg.megatron.micro_batch_tokens)
    micro = [collate_micro_batch(samples, g) for g in groups]
    with torch.no_grad():
        for mb in micro:
            logits = model(input_ids=mb.tokens.to(device)).logits.float() / cfg.algo.temperature
            mb.old_log_probs = torch.log_softmax(logits, -1).gather(-1, mb.labels.to(device)[..., None])[..., 0].cpu()
    tokens = float(count_loss_tokens(samples, indices))

    def update():
        optimizer.zero_grad(set_to_none=True)
        for mb in micro:
            logits = model(input_ids=mb.tokens.to(device)).logits.float() / cfg.algo.temperature
            log_probs = torch.log_softmax(logits, -1).gather(-1, mb.labels.to(device)[..., None])[..., 0]
            loss, _ = compute_policy_loss(log_probs, mb.old_log_probs.to(device), mb.advantages.to(device),
                                          mb.response_mask.to(device), global_num_tokens=tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.algo.grad_clip)
        optimizer.step()

    update()
    _sync()
    elapsed, best = _time_updates(update, repeats)
    return {"seconds": elapsed, "best_update_s": best, "tokens_per_s": sum(s.length for s in samples) / best,
            "params_dtype": str(dtype).replace("torch.", ""), "micro_batches": len(micro),
            "padding_efficiency": sum(mb.real_tokens for mb in micro) / sum(mb.tokens.numel() for mb in micro)}


def _time_updates(update, repeats: int):
    """(total seconds, fastest single update) over `repeats` timed updates.

    Throughput uses the fastest update (as timeit does): on a shared machine the others
    measure the neighbours as much as the code.
    """
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        update()
        _sync()
        times.append(time.perf_counter() - start)
    return sum(times), min(times)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()




def run(quick: bool) -> Dict[str, Any]:
    """Run the benchmark; returns (and writes to bench/results/learner.json) the result dict."""
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.config import DapoConfig, ModelConfig
    from dapo_mega.models.tiny import tiny_hf_config

    gpu = torch.cuda.is_available()
    shape = _model_shape(quick, gpu)
    cfg = DapoConfig()
    cfg.model = ModelConfig(**shape)
    vocab = 32000 if gpu else None
    hf_config = tiny_hf_config(cfg.model, vocab_size=vocab)
    max_len = 2048 if gpu else (64 if quick else 256)
    num = 32 if gpu else (8 if quick else 16)
    repeats = 3 if quick else 5
    cfg.megatron.micro_batch_tokens = max_len * (4 if gpu else 2)
    cfg.algo.lr, cfg.algo.lr_warmup_steps = 1e-5, 0
    samples = _samples(num, max_len, hf_config.vocab_size)
    result: Dict[str, Any] = {"device": torch.cuda.get_device_name() if gpu else "cpu",
                              "threads": torch.get_num_threads(), "model": shape, "vocab": hf_config.vocab_size,
                              "samples": num, "tokens_per_update": sum(s.length for s in samples),
                              "repeats": repeats, "quick": quick}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from dapo_mega.backends.megatron.packing import measure_layout

    lengths = [s.length for s in samples]
    result["dp4_imbalance"] = {
        "contiguous": measure_layout(lengths, 4, cfg.megatron.micro_batch_tokens, False, False).dp_imbalance,
        "balanced": measure_layout(lengths, 4, cfg.megatron.micro_batch_tokens, True, True).dp_imbalance}
    if not gpu:
        megatron = _bench_megatron(cfg, hf_config, samples, repeats, impl="local", fp8=False)
        padded = _bench_megatron(cfg, hf_config, samples, repeats, impl="local", fp8=False, packing=False)
        pytorch = _bench_pytorch(cfg, hf_config, samples, repeats, torch.float32)
        result.update(megatron=megatron, megatron_padded=padded, pytorch=pytorch,
                      note="CPU: megatron local spec fp32 with the CPU substitutions (a TorchFunctionMode adds "
                           "Python overhead per op), packed rows with a per-sample causal mask, vs HF "
                           "transformers fp32 with padded rows")
    else:
        from dapo_mega.backends.megatron.model import transformer_engine_available

        te = transformer_engine_available()
        impl = "transformer_engine" if te else "local"
        runs = {"megatron_bf16": _bench_megatron(cfg, hf_config, samples, repeats, impl=impl, fp8=False),
                "megatron_padded": _bench_megatron(cfg, hf_config, samples, repeats, impl=impl, fp8=False,
                                                   packing=False)}
        if te:
            runs["megatron_fp8"] = _bench_megatron(cfg, hf_config, samples, repeats, impl="transformer_engine", fp8=True)
        else:
            result["note"] = "Transformer Engine not installed: megatron ran the local spec in bf16, no FP8 run"
        pytorch = _bench_pytorch(cfg, hf_config, samples, repeats, torch.bfloat16)
        peak = float(os.environ.get("DAPO_PEAK_TFLOPS", DEFAULT_PEAK_TFLOPS)) * 1e12
        flops = _flops_per_token(shape, hf_config.vocab_size, max_len // 2)
        for run_result in list(runs.values()) + [pytorch]:
            run_result["mfu"] = run_result["tokens_per_s"] * flops / peak
        result.update(runs, pytorch=pytorch, megatron=runs["megatron_bf16"], peak_tflops=peak / 1e12)
    result["ratio_megatron_over_pytorch"] = result["megatron"]["tokens_per_s"] / result["pytorch"]["tokens_per_s"]
    result["ratio_packed_over_padded"] = (result["megatron"]["tokens_per_s"]
                                          / result["megatron_padded"]["tokens_per_s"])
    # the keys bench/run.py tabulates
    result.update(name="learner", metric="useful train tokens/s", ours=result["megatron"]["tokens_per_s"],
                  baseline=result["pytorch"]["tokens_per_s"], baseline_name="HF transformers + AdamW",
                  ratio=result["ratio_megatron_over_pytorch"], higher_is_better=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    return result


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and batch (seconds)")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(json.dumps({k: result[k] for k in ("device", "megatron", "megatron_padded", "pytorch",
                                             "ratio_megatron_over_pytorch", "ratio_packed_over_padded",
                                             "dp4_imbalance")}, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
