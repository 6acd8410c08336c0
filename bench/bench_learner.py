"""Learner throughput: the Megatron train step vs HF transformers on the same packed rows.

    python bench/bench_learner.py [--quick] [--no-dp2]      -> bench/results/learner.json

Both sides train the same Qwen2-shaped model on the same batch of samples with a
long-tailed length distribution (groups of G responses to one prompt with correlated
log-normal lengths, median 1/8 of the longest, one at the cap, as DAPO's responses are):
forward + backward + clip + AdamW step of one mini-batch, the DAPO token-level loss with the global token count. The old-log-prob pass is
done once before timing, on both sides.

* ours: `MegatronLearner._update` (megatron-core GPTModel, get_forward_backward_func,
  Megatron DDP + get_megatron_optimizer), sequence packing on (the default): on the CPU
  the local spec in fp32 (rows as wide as the longest sample, a block-diagonal causal mask);
  on a GPU the Transformer Engine spec in bf16 (THD rows), FP8 too where TE is installed.
* baseline, the strongest fair one: transformers `Qwen2ForCausalLM` (attn_implementation
  "sdpa") on *the same packed rows* as ours: each row the same samples side by side with
  position_ids restarting per sample and the same block-diagonal causal mask, passed as a
  4D boolean mask (transformers hands a 4D mask to SDPA as given; `hf_packed_inputs`; a test
  checks that a packed row's log-probs equal each sample run alone), the same loss
  (`compute_policy_loss`), `torch.optim.AdamW`, grad clipping. On the CPU it runs outside
  the learner's CUDA-to-CPU function mode (`without_function_mode`), so it pays none of it.
* secondary rows: both on one sample per padded row (what packing buys each), and ours
  packed against ours padded.
* DP 2 (two gloo processes, one thread each, `--no-dp2` skips): the same mini-batch split
  over two ranks by token count (`megatron.balance_data_parallel`, Karmarkar-Karp) and in
  contiguous blocks, timed in alternation in the same processes. Each rank records when it
  reaches the gradient all-reduce (megatron's `finalize_model_grads`); the measured
  imbalance is the slowest rank's compute time over the mean (fastest round of each rank),
  beside the computed-token imbalance it should follow. The step time (slowest rank, whole
  update) is the row's figure.

Every side is timed in alternation, `repeats` rounds (>= 3 quick, >= 5 full); a figure is
its fastest round, with median and range (bench/timing.py). Tokens/s counts useful
(unpadded) prompt + response tokens. `run(quick)` returns the result dict (bench/run.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import alternation_order, spread, throughput_figure, time_alternating, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "learner.json"
# Dense bf16 peak TFLOP/s used for MFU (H100/H200 SXM); override with DAPO_PEAK_TFLOPS.
DEFAULT_PEAK_TFLOPS = 989.0


# ---------------------------------------------------------------------- workload
def _model_shape(quick: bool, gpu: bool) -> Dict[str, int]:
    if gpu:
        return dict(tiny_hidden_size=1024, tiny_num_layers=8, tiny_num_attention_heads=16, tiny_num_key_value_heads=4,
                    tiny_intermediate_size=2816, tiny_max_position_embeddings=4096)
    if quick:
        return dict(tiny_hidden_size=64, tiny_num_layers=2, tiny_num_attention_heads=4, tiny_num_key_value_heads=2,
                    tiny_intermediate_size=256, tiny_max_position_embeddings=512)
    return dict(tiny_hidden_size=256, tiny_num_layers=4, tiny_num_attention_heads=8, tiny_num_key_value_heads=2,
                tiny_intermediate_size=768, tiny_max_position_embeddings=1024)


def _samples(num: int, max_len: int, vocab: int, group: int, seed: int = 0):
    """`num` samples in groups of `group` responses to one prompt, as a rollout hands them
    over: prompts of max_len/16..max_len/8 tokens; each group's length scale log-normal
    (median max_len/8, σ 1), its responses log-normal around it (σ 0.5), capped so that
    prompt + response <= max_len; the first sample is at the cap. Lengths correlate within
    a group (a hard prompt's responses are all long), which is what leaves contiguous DP
    blocks unbalanced."""
    from dapo_mega.algo.train_sample import TrainSample

    rng = random.Random(seed)
    out = []
    for i in range(num):
        if i % group == 0:
            prompt_len = rng.randint(max(1, max_len // 16), max(1, max_len // 8))
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            scale = rng.lognormvariate(math.log(max_len / 8), 1.0)
        cap = max_len - len(prompt)
        response_len = cap if i == 0 else max(1, min(cap, int(rng.lognormvariate(math.log(scale), 0.5))))
        response = [rng.randrange(3, vocab) for _ in range(response_len)]
        out.append(TrainSample(prompt_ids=prompt, response_ids=response, advantage=1.0 if i % 2 else -1.0))
    return out


@dataclasses.dataclass
class Workload:
    """One benchmark size: the model, the samples of one mini-batch, the repeats."""

    cfg: Any
    hf_config: Any
    shape: Dict[str, int]
    samples: List[Any]
    max_len: int
    repeats: int

    @property
    def useful_tokens(self) -> int:
        return sum(s.length for s in self.samples)


def build_workload(quick: bool, gpu: bool) -> Workload:
    """quick: 2 groups of 4 samples of <= 64 tokens, hidden 64 (fixed per-op costs dominate);
    full on a CPU: 4 groups of 8 samples of <= 512 tokens (~5k tokens), hidden 256, 4 layers;
    GPU: 4 groups of 8 of <= 2048."""
    from dapo_mega.config import DapoConfig, ModelConfig
    from dapo_mega.models.tiny import tiny_hf_config

    shape = _model_shape(quick, gpu)
    cfg = DapoConfig()
    cfg.model = ModelConfig(**shape)
    hf_config = tiny_hf_config(cfg.model, vocab_size=32000 if gpu else None)
    max_len = 2048 if gpu else (64 if quick else 512)
    num, group = (8, 4) if quick and not gpu else (32, 8)
    cfg.megatron.micro_batch_tokens = max_len * (4 if gpu else 2)
    cfg.algo.lr, cfg.algo.lr_warmup_steps = 1e-5, 0
    return Workload(cfg=cfg, hf_config=hf_config, shape=shape, samples=_samples(num, max_len, hf_config.vocab_size, group),
                    max_len=max_len, repeats=3 if quick else 5)


def _flops_per_token(shape: Dict[str, int], vocab: int, seq: int) -> float:
    """6·N (dense params, fwd+bwd) + attention 12·L·h·s/2 (causal), per token."""
    h, layers, ffn = shape["tiny_hidden_size"], shape["tiny_num_layers"], shape["tiny_intermediate_size"]
    heads, kv = shape["tiny_num_attention_heads"], shape["tiny_num_key_value_heads"]
    head_dim = h // heads
    attn_params = h * (heads + 2 * kv) * head_dim + heads * head_dim * h
    params = layers * (attn_params + 3 * h * ffn) + 2 * vocab * h
    return 6.0 * params + 6.0 * layers * h * seq


def _rank_device(rank: int, ranks: int) -> Optional[int]:
    """The GPU of this benchmark's rank `rank` of `ranks` by the device rule (None without a GPU)."""
    from dapo_mega.backends.placement import CPU, CUDA, rank_cuda_index

    device = CUDA if torch.cuda.is_available() else CPU
    return rank_cuda_index(rank, ranks, device, torch.cuda.device_count() if device == CUDA else 0,
                           "bench_learner", "run it on a node with that many GPUs")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _layout_stats(micro) -> Dict[str, Any]:
    return {"micro_batches": len(micro), "rows": sum(mb.tokens.shape[0] for mb in micro),
            "computed_tokens": sum(mb.tokens.numel() for mb in micro),
            "padding_efficiency": sum(mb.real_tokens for mb in micro) / sum(mb.tokens.numel() for mb in micro)}


# ---------------------------------------------------------------------- the HF baseline
def same_rows(samples: Sequence[Any], micro_batch) -> Any:
    """A copy of `micro_batch`'s layout (the same samples in the same rows and columns) with
    the explicit block-diagonal causal mask, whatever the learner's attention layout; its
    old_log_probs are zeros, to be filled by the baseline's own forward."""
    from dapo_mega.backends.megatron.batch import ATTENTION_MASK, collate_packed_micro_batch

    rows: List[List[int]] = [[] for _ in range(micro_batch.tokens.shape[0])]
    for p in sorted(micro_batch.placements, key=lambda p: (p.row, p.start)):
        rows[p.row].append(p.sample_index)
    bare = [dataclasses.replace(s, old_log_probs=None, engine_log_probs=None) for s in samples]
    return collate_packed_micro_batch(bare, rows, seq_len=micro_batch.tokens.shape[1], attention=ATTENTION_MASK)


def hf_packed_inputs(micro_batch, device: torch.device | str = "cpu") -> Dict[str, torch.Tensor]:
    """transformers forward kwargs for a micro-batch: packed rows (attention="mask") get
    position_ids restarting per sample and the 4D [B, 1, S, S] boolean mask, True = attend
    (transformers' convention, the inverse of megatron's), which `create_causal_mask`
    returns as given and SDPA applies as is; padded rows (one sample each, right padding)
    need only the ids: the causal mask alone keeps the padding out."""
    from dapo_mega.backends.megatron.batch import ATTENTION_CAUSAL, ATTENTION_MASK

    if micro_batch.attention == ATTENTION_CAUSAL:
        return {"input_ids": micro_batch.tokens.to(device)}
    if micro_batch.attention != ATTENTION_MASK:
        raise ValueError(f"hf_packed_inputs takes causal or mask micro-batches, not {micro_batch.attention!r}")
    return {"input_ids": micro_batch.tokens.to(device), "position_ids": micro_batch.position_ids.to(device),
            "attention_mask": (~micro_batch.attention_mask).to(device)}


def hf_token_log_probs(model, micro_batch, temperature: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, S] log-probs of each position's label under `model` (float32)."""
    logits = model(**hf_packed_inputs(micro_batch, device)).logits.float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, micro_batch.labels.to(device)[..., None])[..., 0]


class HFBaseline:
    """transformers Qwen2 (SDPA) + torch AdamW training on given micro-batches."""

    def __init__(self, cfg, hf_config, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
        self.model.to(self.device).train()
        algo = cfg.algo
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.lr, betas=(algo.adam_beta1, algo.adam_beta2),
                                           weight_decay=algo.weight_decay)

    def write_old_log_probs(self, micro) -> None:
        with torch.no_grad():
            for mb in micro:
                mb.old_log_probs = hf_token_log_probs(self.model, mb, self.cfg.algo.temperature, self.device).cpu()

    def update(self, micro, global_tokens: float) -> None:
        from dapo_mega.algo import compute_policy_loss
        from dapo_mega.backends.megatron.cpu_support import without_function_mode

        with without_function_mode():  # the learner's CPU op interception is not the baseline's cost
            self.optimizer.zero_grad(set_to_none=True)
            for mb in micro:
                log_probs = hf_token_log_probs(self.model, mb, self.cfg.algo.temperature, self.device)
                loss, _ = compute_policy_loss(log_probs, mb.old_log_probs.to(self.device), mb.advantages.to(self.device),
                                              mb.response_mask.to(self.device), global_num_tokens=global_tokens)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.algo.grad_clip)
            self.optimizer.step()


# ---------------------------------------------------------------------- DP 1: four sides in alternation
def _loss_denominators(samples) -> tuple:
    from dapo_mega.backends.megatron.batch import count_loss_tokens

    indices = list(range(len(samples)))
    tokens = float(count_loss_tokens(samples, indices))
    seqs = float(sum(1 for s in samples if any(s.response_loss_mask())))
    return tokens, seqs


def _bench_dp1(work: Workload, impl: str, fp8: bool) -> Dict[str, Any]:
    """Megatron packed / padded and HF packed / padded, timed in alternation in this process."""
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.distributed import free_port

    cfg, samples = work.cfg, work.samples
    cfg.megatron.transformer_impl = impl
    cfg.megatron.fp8.enabled = fp8
    cfg.megatron.fp8.recipe = "tensorwise" if fp8 else cfg.megatron.fp8.recipe
    layout = ParallelLayout.from_config(cfg.megatron, 1, work.hf_config).initialize(
        init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, cuda_device=_rank_device(0, 1))
    try:
        learner = MegatronLearner(cfg, work.hf_config, layout)
        indices = list(range(len(samples)))
        micro = {}
        for packing in (True, False):
            cfg.megatron.sequence_packing = packing
            micro["megatron_packed" if packing else "megatron_padded"] = learner._micro_batches(samples, indices)
        cfg.megatron.sequence_packing = True
        for name in ("megatron_packed", "megatron_padded"):
            learner._write_old_log_probs(micro[name])
        # the baseline's rows are ours, sample for sample (packed) or the same padded rows
        micro["hf_packed"] = [same_rows(samples, mb) for mb in micro["megatron_packed"]]
        micro["hf_padded"] = [dataclasses.replace(mb, old_log_probs=None) for mb in micro["megatron_padded"]]
        dtype = torch.float32 if not torch.cuda.is_available() else torch.bfloat16
        hf = HFBaseline(cfg, work.hf_config, dtype)
        hf.write_old_log_probs(micro["hf_packed"])
        hf.write_old_log_probs(micro["hf_padded"])
        tokens, seqs = _loss_denominators(samples)
        loss_func = partial(learner._policy_loss_func, tokens, seqs)
        sides = {"megatron_packed": lambda: learner._update(micro["megatron_packed"], loss_func, lr=None),
                 "hf_packed": lambda: hf.update(micro["hf_packed"], tokens),
                 "megatron_padded": lambda: learner._update(micro["megatron_padded"], loss_func, lr=None),
                 "hf_padded": lambda: hf.update(micro["hf_padded"], tokens)}
        for call in sides.values():  # warm-up (allocations, kernels)
            call()
        seconds = time_alternating(sides, work.repeats, sync=_sync)
        info = {"layer_spec": learner.info.layer_spec, "params_dtype": learner.info.params_dtype,
                "fp8": learner.info.fp8, "hf_params_dtype": str(dtype).replace("torch.", "")}
    finally:
        torch.distributed.destroy_process_group()
        layout.destroy()
    runs = {name: {"seconds": seconds[name], "best_update_s": min(seconds[name]),
                   "tokens_per_s": work.useful_tokens / min(seconds[name]), **_layout_stats(micro[name])}
            for name in sides}
    return {"runs": runs, "seconds": seconds, **info}


def _bench_fp8(work: Workload) -> Dict[str, Any]:
    """Megatron packed with FP8 (Transformer Engine), timed alone (best of repeats)."""
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.distributed import free_port

    cfg = work.cfg
    cfg.megatron.transformer_impl, cfg.megatron.fp8.enabled, cfg.megatron.fp8.recipe = "transformer_engine", True, "tensorwise"
    layout = ParallelLayout.from_config(cfg.megatron, 1, work.hf_config).initialize(
        init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, cuda_device=_rank_device(0, 1))
    try:
        learner = MegatronLearner(cfg, work.hf_config, layout)
        micro = learner._micro_batches(work.samples, list(range(len(work.samples))))
        learner._write_old_log_probs(micro)
        loss_func = partial(learner._policy_loss_func, *_loss_denominators(work.samples))
        learner._update(micro, loss_func, lr=None)
        seconds = time_alternating({"fp8": lambda: learner._update(micro, loss_func, lr=None)}, work.repeats,
                                   sync=_sync)["fp8"]
    finally:
        torch.distributed.destroy_process_group()
        layout.destroy()
        cfg.megatron.fp8.enabled = False
    return {"seconds": seconds, "best_update_s": min(seconds), "tokens_per_s": work.useful_tokens / min(seconds),
            "spread_s": spread(seconds), **_layout_stats(micro)}


# ---------------------------------------------------------------------- DP 2: balanced vs contiguous
def _dp2_rank(rank: int, world_size: int, quick: bool, repeats: int) -> Dict[str, Any]:
    """One DP rank: the mini-batch split balanced and contiguous, updates timed in alternation;
    per round the time to the gradient all-reduce (this rank's compute) and the whole update."""
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.backends.megatron.model import transformer_engine_import_error

    work = build_workload(quick, gpu=torch.cuda.is_available())
    cfg, samples = work.cfg, work.samples
    # the local spec on the CPU, and on a GPU whose TE does not import (the dp1 part notes why)
    cfg.megatron.transformer_impl = "transformer_engine" if transformer_engine_import_error() is None else "local"
    layout = ParallelLayout.from_config(cfg.megatron, world_size, work.hf_config).initialize(
        cuda_device=_rank_device(rank, world_size))
    try:
        learner = MegatronLearner(cfg, work.hf_config, layout)
        reached: List[float] = []
        finalize = learner.config.finalize_model_grads_func

        def timed_finalize(*args, **kwargs):
            _sync()
            reached.append(time.perf_counter())
            return finalize(*args, **kwargs)

        learner.config.finalize_model_grads_func = timed_finalize
        indices = list(range(len(samples)))
        loss_func = partial(learner._policy_loss_func, *_loss_denominators(samples))
        layouts = {}
        for balanced in (True, False):
            cfg.megatron.balance_data_parallel = balanced
            shard = learner._shard(samples, indices)
            micro = learner._schedule_passes(samples, [shard])[0]
            learner._write_old_log_probs(micro)
            layouts["balanced" if balanced else "contiguous"] = (shard, micro)
        compute = {name: [] for name in layouts}
        step = {name: [] for name in layouts}
        for round_ in range(repeats + 1):  # round 0 is the warm-up
            for name in alternation_order(list(layouts), round_):
                micro = layouts[name][1]
                torch.distributed.barrier()
                reached.clear()
                start = time.perf_counter()
                learner._update(micro, loss_func, lr=None)
                _sync()
                end = time.perf_counter()
                if round_:
                    compute[name].append(reached[0] - start)
                    step[name].append(end - start)
        return {name: {"compute_s": compute[name], "step_s": step[name], "samples": len(shard),
                       "useful_tokens": sum(samples[i].length for i in shard), **_layout_stats(micro)}
                for name, (shard, micro) in layouts.items()}
    finally:
        torch.distributed.destroy_process_group()
        layout.destroy()


def summarize_dp(ranks: Sequence[Dict[str, Any]], useful_tokens: int) -> Dict[str, Any]:
    """Per layout, from each rank's rounds: the step time (slowest rank, per round), the
    measured compute imbalance (slowest rank's fastest compute / the mean of the ranks'
    fastest) and per round, and the computed-token imbalance."""
    out = {}
    for name in ranks[0]:
        per_rank = [r[name] for r in ranks]
        rounds = len(per_rank[0]["step_s"])
        step_s = [max(r["step_s"][k] for r in per_rank) for k in range(rounds)]
        best = [min(r["compute_s"]) for r in per_rank]
        per_round = [max(c) / statistics.mean(c) for c in zip(*(r["compute_s"] for r in per_rank))]
        computed = [r["computed_tokens"] for r in per_rank]
        out[name] = {"step_s": step_s, "step_spread_s": spread(step_s), "tokens_per_s": useful_tokens / min(step_s),
                     "compute_best_s": best, "measured_imbalance": max(best) / statistics.mean(best),
                     "measured_imbalance_per_round": spread(per_round),
                     "token_imbalance": max(computed) / statistics.mean(computed),
                     "ranks": [{k: r[k] for k in ("samples", "useful_tokens", "computed_tokens", "micro_batches")}
                               for r in per_rank]}
    return out


def _bench_dp2(quick: bool, repeats: int, useful_tokens: int) -> Dict[str, Any]:
    import bench_learner  # the spawned ranks import the worker by this name, also under __main__

    from dapo_mega.backends.placement import CPU, CUDA
    from dapo_mega.weights.spawn import spawn_ranks

    start = time.perf_counter()
    ranks = spawn_ranks(bench_learner._dp2_rank, 2, args=(quick, repeats), timeout_s=3600,
                        device=CUDA if torch.cuda.is_available() else CPU)
    return {**summarize_dp(ranks, useful_tokens), "seconds": time.perf_counter() - start,
            "threads_per_rank": max(1, (os.cpu_count() or 1) // 2)}


# ---------------------------------------------------------------------- the result
def run(quick: bool, dp2: bool = True, reps: int = 0) -> Dict[str, Any]:
    """Run the benchmark; returns (and writes to bench/results/learner.json) the result dict.

    reps: rounds per side (default 3 quick, 5 full)."""
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.packing import measure_layout

    gpu = torch.cuda.is_available()
    work = build_workload(quick, gpu)
    work.repeats = reps or work.repeats
    cfg = work.cfg
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    lengths = [s.length for s in work.samples]
    result: Dict[str, Any] = {
        "device": torch.cuda.get_device_name() if gpu else "cpu", "threads": torch.get_num_threads(),
        "model": work.shape, "vocab": work.hf_config.vocab_size, "samples": len(work.samples),
        "tokens_per_update": work.useful_tokens, "longest_sample": max(lengths), "repeats": work.repeats,
        "quick": quick, "micro_batch_tokens": cfg.megatron.micro_batch_tokens,
        "predicted_dp_imbalance": {
            f"dp{dp}_{mode}": measure_layout(lengths, dp, cfg.megatron.micro_batch_tokens, True, mode == "balanced"
                                             ).dp_imbalance for dp in (2, 4) for mode in ("contiguous", "balanced")}}
    impl = "local"
    if gpu:
        from dapo_mega.backends.megatron.model import transformer_engine_import_error

        te_error = transformer_engine_import_error()
        impl = "transformer_engine" if te_error is None else "local"
        if te_error is not None:
            result["note"] = f"Transformer Engine does not import ({te_error}): megatron ran the local spec in bf16, " \
                             "no FP8 run"
    dp1 = _bench_dp1(work, impl=impl, fp8=False)
    runs, seconds = dp1.pop("runs"), dp1.pop("seconds")
    result.update(dp1, **runs)
    if gpu and impl == "transformer_engine":
        result["megatron_fp8"] = _bench_fp8(work)
    if gpu:
        peak = float(os.environ.get("DAPO_PEAK_TFLOPS", DEFAULT_PEAK_TFLOPS)) * 1e12
        flops = _flops_per_token(work.shape, work.hf_config.vocab_size, work.max_len // 2)
        for name in list(runs) + (["megatron_fp8"] if "megatron_fp8" in result else []):
            result[name]["mfu"] = result[name]["tokens_per_s"] * flops / peak
        result["peak_tflops"] = peak / 1e12
    tokens = work.useful_tokens
    attention = "THD rows (TE)" if impl == "transformer_engine" else "rows as wide as the longest sample"
    result.update(throughput_figure(
        "learner", "useful train tokens/s", tokens, seconds["megatron_packed"], tokens, seconds["hf_packed"],
        "HF transformers + AdamW, same packed rows",
        f"transformers Qwen2 (SDPA, {result['hf_params_dtype']}) + torch AdamW on the same packed rows as ours "
        f"({attention}; position_ids per sample, block-diagonal causal 4D mask), the same loss and clipping; "
        f"{len(work.samples)} samples, {tokens} tokens per update, hidden {work.shape['tiny_hidden_size']}, DP 1"))
    result["rows"] = [
        throughput_figure("learner (padded rows)", "useful train tokens/s", tokens, seconds["megatron_padded"],
                          tokens, seconds["hf_padded"], "HF transformers + AdamW, same padded rows",
                          "both sides one sample per right-padded row, causal mask only"),
        throughput_figure("learner (packing)", "useful train tokens/s", tokens, seconds["megatron_packed"],
                          tokens, seconds["megatron_padded"], "ours with one sample per padded row",
                          "what sequence packing buys the Megatron step"),
    ]
    if dp2 and (not gpu or torch.cuda.device_count() >= 2):
        dp = _bench_dp2(quick, work.repeats, tokens)
        result["dp2"] = dp
        bal, con = dp["balanced"], dp["contiguous"]
        result["rows"].append(throughput_figure(
            "learner DP 2 (balanced)", "useful train tokens/s, 2 gloo ranks", tokens, bal["step_s"], tokens,
            con["step_s"], "the same, contiguous blocks per rank",
            "two processes, one mini-batch split by token count (Karmarkar-Karp) vs in contiguous blocks; "
            "step = slowest rank's whole update",
            measured_imbalance={"balanced": bal["measured_imbalance"], "contiguous": con["measured_imbalance"]},
            token_imbalance={"balanced": bal["token_imbalance"], "contiguous": con["token_imbalance"]}))
    else:
        result["dp2"] = {"skipped": "--no-dp2" if not dp2 else "needs 2 GPUs"}
    result["ratio_megatron_over_pytorch"] = result["ratio"]
    result["ratio_packed_over_padded"] = result["megatron_packed"]["tokens_per_s"] / result["megatron_padded"]["tokens_per_s"]
    write_result(RESULTS, result)
    return result


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and batch (seconds)")
    parser.add_argument("--no-dp2", action="store_true", help="skip the two-process DP run")
    args = parser.parse_args(argv)
    result = run(args.quick, dp2=not args.no_dp2)
    rows = [result] + result["rows"]
    print(json.dumps({r["name"]: {k: r[k] for k in ("ours", "baseline", "ratio", "ratio_median", "ours_spread",
                                                     "baseline_spread")} for r in rows}, indent=2))
    if "balanced" in result["dp2"]:
        print(json.dumps({k: {m: result["dp2"][k][m] for m in ("measured_imbalance", "token_imbalance")}
                          for k in ("balanced", "contiguous")}, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
