"""A mixture's learner update: Megatron's MoE step vs transformers + AdamW on the same packed rows.

    python bench/bench_moe.py [--quick]      -> bench/results/moe_learner.json

The workload of bench_learner.py (one mini-batch of long-tailed samples in groups, the DAPO
token-level loss, forward + backward + clip + AdamW step, the old log-probs computed once
before timing) on a Qwen3-MoE of the same dense size with every layer sparse: 8 experts, 2
per token, each expert's SwiGLU half the dense FFN (`models/tiny.py`, TINY_MOE's routing),
both sides from the same weights (the HF model's, loaded into Megatron), so both route the
same tokens to the same experts.

* ours: `MegatronLearner._update` at EP 1 (one process): megatron-core's MoE layer with
  the all-to-all dispatcher (a permutation on one rank) and its experts one after another
  (SequentialMLP: the local spec; a GPU would take TE's grouped GEMM), the load-balancing
  loss at the model's weight (router_aux_loss_coef), sequence packing on.
* baseline, the strongest fair one: transformers `Qwen3MoeForCausalLM` (SDPA) on the same
  packed rows (bench_learner.same_rows / hf_packed_inputs), the same policy loss plus its own
  load-balancing loss at the same weight (`load_balancing_loss_func` on the routers' logits), torch AdamW, grad clipping;
  each experts implementation transformers offers here (eager: a loop over the experts hit;
  grouped_mm where torch dispatches it; `EXPERTS_IMPLEMENTATIONS`) is timed, and the fastest is
  the baseline (the other is a row beside it).

Both sides' log-probs of the rows before any update are compared (`max_abs_logprob_diff_before_
update`, per experts implementation): the same model, the same routing, the same work. Timed in
alternation, best of `repeats` rounds with median and range (bench/timing.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_learner import (  # noqa: E402
    HFBaseline,
    _layout_stats,
    _loss_denominators,
    _rank_device,
    _samples,
    _sync,
    hf_token_log_probs,
    same_rows,
)
from timing import throughput_figure, time_alternating, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "moe_learner.json"
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm")
"""transformers' experts implementations timed (the fastest is the baseline). Not batched_mm: it
gathers each token's expert weights ([tokens x k, 3 h mf]; 19 GB at the full size, over this
machine's memory beside the rest) and ran 6x slower than grouped_mm at the quick size."""


def _shape(quick: bool) -> Dict[str, int]:
    if quick:
        return dict(tiny_hidden_size=64, tiny_num_layers=2, tiny_num_attention_heads=4, tiny_num_key_value_heads=2,
                    tiny_intermediate_size=256, tiny_max_position_embeddings=512)
    return dict(tiny_hidden_size=256, tiny_num_layers=4, tiny_num_attention_heads=8, tiny_num_key_value_heads=2,
                tiny_intermediate_size=768, tiny_max_position_embeddings=1024)


class HFMoEBaseline(HFBaseline):
    """transformers Qwen3-MoE with one experts implementation, its load-balancing loss added."""

    def __init__(self, cfg, hf_dir: str, experts_implementation: str):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.device = torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                          experts_implementation=experts_implementation)
        self.model.train()
        self.coef = float(self.model.config.router_aux_loss_coef)
        # the routers' logits of each forward, for the balancing loss over every token (transformers'
        # own, under output_router_logits, masks by a 2D attention mask and refuses the packed rows' 4D one)
        self.router_logits: List[torch.Tensor] = []
        for layer in self.model.model.layers:
            layer.mlp.gate.register_forward_hook(lambda m, a, out: self.router_logits.append(out[0]))
        algo = cfg.algo
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.lr, betas=(algo.adam_beta1, algo.adam_beta2),
                                           weight_decay=algo.weight_decay)

    def update(self, micro, global_tokens: float) -> None:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        from dapo_mega.algo import compute_policy_loss
        from dapo_mega.backends.megatron.cpu_support import without_function_mode

        with without_function_mode():
            self.optimizer.zero_grad(set_to_none=True)
            for mb in micro:
                self.router_logits.clear()
                log_probs = hf_token_log_probs(self.model, mb, self.cfg.algo.temperature)
                aux_loss = load_balancing_loss_func(tuple(self.router_logits), self.model.config.num_experts,
                                                    self.model.config.num_experts_per_tok)
                loss, _ = compute_policy_loss(log_probs, mb.old_log_probs, mb.advantages, mb.response_mask,
                                              global_num_tokens=global_tokens)
                tokens = float(mb.response_mask.sum())  # the balancing loss per token, as the learner weighs it
                (loss + self.coef * aux_loss * tokens / global_tokens).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.algo.grad_clip)
            self.optimizer.step()


def _available(hf_dir: str, implementation: str) -> bool:
    """Whether transformers runs `implementation` here (a forward of one short row)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, experts_implementation=implementation)
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5, 6]]))
        return True
    except Exception:  # noqa: BLE001 -- any failure means: not offered on this machine
        return False


def run(quick: bool, reps: int = 0) -> Dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.config import DapoConfig, ModelConfig
    from dapo_mega.distributed import free_port
    from dapo_mega.models.tiny import build_tiny_model_dir
    from dapo_mega.weights.hf_io import HFCheckpointReader
    from dapo_mega.weights.stream import load_hf_into_megatron

    shape = _shape(quick)
    cfg = DapoConfig()
    cfg.model = ModelConfig(**shape)
    max_len = 64 if quick else 512
    num, group = (8, 4) if quick else (32, 8)
    cfg.megatron.micro_batch_tokens = max_len * 2
    cfg.algo.lr, cfg.algo.lr_warmup_steps = 1e-5, 0
    repeats = reps or (3 if quick else 5)
    tmp = tempfile.TemporaryDirectory()
    hf_dir = str(build_tiny_model_dir(Path(tmp.name) / "moe", cfg.model, seed=0, architecture="qwen3_moe",
                                      dense_layers=[]))
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    samples = _samples(num, max_len, hf_config.vocab_size, group)
    tokens_total = sum(s.length for s in samples)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    cfg.megatron.transformer_impl = "local"
    layout = ParallelLayout.from_config(cfg.megatron, 1, hf_dir).initialize(
        init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, cuda_device=_rank_device(0, 1))
    try:
        learner = MegatronLearner(cfg, hf_dir, layout, initialize=False)
        load_hf_into_megatron(learner.model_chunks, learner.info, layout, HFCheckpointReader(hf_dir))
        learner.optimizer.reload_model_params()
        micro = learner._micro_batches(samples, list(range(len(samples))))
        learner._write_old_log_probs(micro)
        tokens, seqs = _loss_denominators(samples)
        loss_func = partial(learner._policy_loss_func, tokens, seqs)
        learner._scale_router_loss(tokens_total)
        sides = {"megatron_packed": lambda: learner._update(micro, loss_func, lr=None)}
        offered = [impl for impl in EXPERTS_IMPLEMENTATIONS if _available(hf_dir, impl)]
        same_work = {}
        for impl in offered:
            rows = [same_rows(samples, mb) for mb in micro]
            hf = HFMoEBaseline(cfg, hf_dir, impl)
            hf.write_old_log_probs(rows)
            # the same weights, routing and rows: the same log-probs before any update (a token whose
            # two best experts are tied to rounding may route apart: counted)
            diffs = torch.cat([((a.old_log_probs - b.old_log_probs).abs())[a.response_mask.bool()]
                               for a, b in zip(micro, rows)])
            same_work[impl] = {"max": float(diffs.max()), "mean": float(diffs.mean()),
                               "tokens_over_1e-3": int((diffs > 1e-3).sum()), "tokens": int(diffs.numel())}
            sides[f"hf_{impl}"] = partial(hf.update, rows, tokens)
        for call in sides.values():  # warm-up
            call()
        seconds = time_alternating(sides, repeats, sync=_sync)
    finally:
        torch.distributed.destroy_process_group()
        layout.destroy()
        tmp.cleanup()
    best = min(offered, key=lambda impl: min(seconds[f"hf_{impl}"]))
    result: Dict[str, Any] = {
        "device": "cpu", "threads": torch.get_num_threads(), "model": shape,
        "moe": {"num_experts": hf_config.num_experts, "num_experts_per_tok": hf_config.num_experts_per_tok,
                "moe_intermediate_size": hf_config.moe_intermediate_size, "sparse_layers": hf_config.num_hidden_layers},
        "samples": len(samples), "tokens_per_update": tokens_total, "longest_sample": max(s.length for s in samples),
        "repeats": repeats, "quick": quick, "micro_batch_tokens": cfg.megatron.micro_batch_tokens,
        "experts_implementations": offered, "baseline_experts_implementation": best,
        "max_abs_logprob_diff_before_update": same_work,
        "megatron_packed": {"seconds": seconds["megatron_packed"], **_layout_stats(micro)},
        **{f"hf_{impl}": {"seconds": seconds[f"hf_{impl}"]} for impl in offered}}
    result.update(throughput_figure(
        "MoE learner", "useful train tokens/s", tokens_total, seconds["megatron_packed"], tokens_total,
        seconds[f"hf_{best}"], f"HF transformers Qwen3-MoE ({best} experts) + AdamW, same packed rows",
        f"transformers Qwen3MoeForCausalLM (SDPA, fp32, experts_implementation={best}, the fastest of "
        f"{', '.join(offered)} here) + torch AdamW on the same packed rows, the same loss with its own "
        f"load-balancing loss at the same weight, clipping; {len(samples)} samples, {tokens_total} tokens per "
        f"update, hidden {shape['tiny_hidden_size']}, {hf_config.num_experts} experts top "
        f"{hf_config.num_experts_per_tok}, EP 1"))
    result["rows"] = [throughput_figure(
        f"MoE learner vs {impl}", "useful train tokens/s", tokens_total, seconds["megatron_packed"], tokens_total,
        seconds[f"hf_{impl}"], f"HF transformers Qwen3-MoE ({impl} experts) + AdamW",
        "as the main row, another experts implementation") for impl in offered if impl != best]
    write_result(RESULTS, result)
    return result


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and batch (seconds)")
    parser.add_argument("--reps", type=int, default=0, help="rounds per side (default 3 quick, 5 full)")
    args = parser.parse_args(argv)
    result = run(args.quick, args.reps)
    rows = [result] + result["rows"]
    print(json.dumps({r["name"]: {k: r[k] for k in ("ours", "baseline", "ratio", "ratio_median", "ours_spread",
                                                     "baseline_spread")} for r in rows}, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
