"""`dapo-mega plan`: layout and memory of a config on a cluster shape, before any GPU is used.

    dapo-mega plan +experiment=dapo_qwen2.5_32b            a table
    dapo-mega plan +experiment=dapo_qwen2.5_32b --json     the same as JSON

The clock of the run (durations beside the timeouts that bound them) is `dapo_mega.clock`,
which builds on this module; the command (`dapo_mega.cli`) prints both.

Memory per learner GPU (bytes), for TP=t, PP=p, CP=c, DP=d = W/(t·p·c), the parameters
Φ_s held by one GPU of pipeline stage s (linear weights, QKV bias and embedding/output
split over t; norms replicated):

    model state  M_s = Φ_s · (2 + 4 + 12/d)       bf16 params (2) + fp32 main grads (4)
                                                  + fp32 master params, Adam m, Adam v (12)
                                                  sharded over DP by Megatron's
                                                  distributed optimizer (ZeRO-1);
                                                  without it: Φ_s · 18
    activations  per transformer layer, s = micro_batch_tokens / c tokens, hidden h
                 (Korthikanti et al. 2022, Eq. 2, flash attention: no a·s/h term, b = 1):
                 A = s·h·34/t with sequence parallelism, s·h·(10 + 24/t) without;
                 full recompute keeps only the layer input, 2·s·h/t (SP) or 2·s·h, plus
                 one layer's A while recomputing. 1F1B keeps p micro-batches in flight on
                 stage 0 (p − s on stage s); the last stage adds fp32 logits 4·s·V/t.

KV cache per engine (TP=e GPUs, mem_fraction_static f, GPU memory G):
    room = e · (f·G − R) − 2·Φ,  R = learner model state left on the GPU in colocated
    mode (0 disaggregated), Φ all parameters; bytes per token 2 (K,V) · L · n_kv · d_head · 2.
Weight sync per step: 2·Φ bytes (bf16) to every engine.

Learner efficiency (`LengthAssumption`, default: log-normal responses of median
max_response_length/8 and σ 1, capped at max_response_length, prompts of
min(150, max_prompt_length/4) tokens): one
mini-batch of mini_batch_size × G such samples, drawn from a fixed seed, laid out the way
the learner lays it out (backends/megatron/packing.py) as configured and, for comparison,
without packing and balancing:
    padding efficiency = useful tokens / tokens computed (rows × columns of every micro-batch)
    DP imbalance       = tokens of the busiest data-parallel rank / mean over ranks
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dapo_mega.backends.megatron.packing import measure_layout, token_multiple
from dapo_mega.backends.placement import ClusterShape, place
from dapo_mega.config import DapoConfig
from dapo_mega.models.shape import ModelShape

GIB = 1024 ** 3


KNOWN_MODELS: Dict[str, ModelShape] = {
    # The sizes of the published config.json files; `plan` reads no other field.
    "qwen2.5-32b": ModelShape(model_type="qwen2", vocab_size=152064, hidden_size=5120, ffn_hidden_size=27648,
                              num_layers=64, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                              tie_word_embeddings=False, qkv_bias=True),
    "qwen2.5-7b": ModelShape(model_type="qwen2", vocab_size=152064, hidden_size=3584, ffn_hidden_size=18944,
                             num_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                             tie_word_embeddings=False, qkv_bias=True),
}


def resolve_model_shape(cfg: DapoConfig) -> Tuple[ModelShape, str]:
    """(shape, source): config.json at model.hf_path if present ("hf_config"), else
    KNOWN_MODELS[model.name] ("table"), else the tiny model of the model config ("tiny")."""
    config_json = Path(cfg.model.hf_path) / "config.json" if cfg.model.hf_path else None
    if config_json is not None and config_json.exists():
        return ModelShape.from_hf_config(config_json), "hf_config"
    if cfg.model.name.lower() in KNOWN_MODELS:
        return KNOWN_MODELS[cfg.model.name.lower()], "table"
    from dapo_mega.models.tiny import tiny_hf_config

    return ModelShape.from_hf_config(tiny_hf_config(cfg.model)), "tiny"


def layer_params(shape: ModelShape) -> Dict[str, int]:
    """Parameters of one transformer layer, split into what TP shards and what it replicates."""
    h, hd = shape.hidden_size, shape.head_dim
    q_out, kv_out = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    attention = h * q_out + 2 * h * kv_out + q_out * h
    bias = (q_out + 2 * kv_out) if shape.qkv_bias else 0
    mlp = 3 * h * shape.ffn_hidden_size  # SwiGLU: gate, up, down
    return {"sharded": attention + bias + mlp, "replicated": 2 * h}  # 2 RMSNorm weights


def total_params(shape: ModelShape) -> int:
    per_layer = layer_params(shape)
    embedding = shape.vocab_size * shape.hidden_size
    output = 0 if shape.tie_word_embeddings else embedding
    return shape.num_layers * (per_layer["sharded"] + per_layer["replicated"]) + embedding + output + shape.hidden_size


def stage_params_per_gpu(shape: ModelShape, tp: int, pp: int, stage: int) -> int:
    """Φ_s: parameters one GPU of pipeline stage `stage` holds (layers split evenly)."""
    per_layer = layer_params(shape)
    layers = shape.num_layers // pp + (1 if stage < shape.num_layers % pp else 0)
    params = layers * (math.ceil(per_layer["sharded"] / tp) + per_layer["replicated"])
    embedding = math.ceil(shape.vocab_size / tp) * shape.hidden_size
    if stage == 0:
        params += embedding
    if stage == pp - 1:
        params += shape.hidden_size  # final norm
        if not shape.tie_word_embeddings or pp > 1:  # tied + pp>1: Megatron keeps a copy on the last stage
            params += embedding
    return params


def activation_bytes(cfg: DapoConfig, shape: ModelShape, stage: int) -> int:
    """Activation memory of pipeline stage `stage` (formula in the module docstring)."""
    m = cfg.megatron
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    s, h = m.micro_batch_tokens / cp, shape.hidden_size
    full_layer = s * h * 34 / tp if m.sequence_parallel else s * h * (10 + 24 / tp)
    layers = shape.num_layers // pp + (1 if stage < shape.num_layers % pp else 0)
    in_flight = pp - stage
    if m.recompute_granularity == "full":
        kept = 2 * s * h / tp if m.sequence_parallel else 2 * s * h
        total = layers * in_flight * kept + full_layer
    else:
        total = layers * in_flight * full_layer
    if stage == pp - 1:
        total += 4 * s * math.ceil(shape.vocab_size / tp)
    return int(total)


def kv_bytes_per_token(shape: ModelShape, engine_tp: int) -> int:
    """K and V of every layer for one token on one engine GPU (bf16; KV heads split by TP)."""
    kv_heads = max(1, math.ceil(shape.num_key_value_heads / engine_tp))
    return 2 * shape.num_layers * kv_heads * shape.head_dim * 2


@dataclass
class LengthAssumption:
    """Rollout lengths assumed for the learner-efficiency figures of the plan."""

    response_median: Optional[int] = None
    """Median response length in tokens; None = max_response_length / 8."""
    response_sigma: float = 1.0
    """σ of log(response length): 1.0 spans ~0.1× to ~7× the median (two σ)."""
    prompt_tokens: Optional[int] = None
    """Tokens of every prompt; None = min(150, max_prompt_length / 4) (DAPO-Math prompts
    with the chat template are ~100-300 tokens)."""
    seed: int = 0
    """Seed of the drawn mini-batch (the figures are deterministic)."""

    def resolved(self, max_prompt_length: int, max_response_length: int) -> "LengthAssumption":
        """The assumption with its defaults filled in from the config's length limits."""
        return LengthAssumption(response_median=self.response_median or max(1, max_response_length // 8),
                                response_sigma=self.response_sigma,
                                prompt_tokens=self.prompt_tokens or min(150, max(1, max_prompt_length // 4)),
                                seed=self.seed)

    def response_moment(self, power: int, max_response_length: int) -> float:
        """E[min(X, c)^r] of a response length X ~ LogNormal(μ = ln median, σ) capped at
        c = max_response_length (call on a `resolved` assumption); with Φ the normal CDF:

            E[min(X, c)^r] = e^(rμ + r²σ²/2) · Φ((ln c − μ − rσ²) / σ)
                           + c^r · (1 − Φ((ln c − μ) / σ))

        r = 1 is the mean length, r = 2 what attention's cost grows with (`dapo_mega.clock`)."""
        mu, sigma, cap, r = math.log(int(self.response_median)), self.response_sigma, max_response_length, power
        z = (math.log(cap) - mu) / sigma
        return math.exp(r * mu + r * r * sigma * sigma / 2) * _normal_cdf(z - r * sigma) + cap ** r * (1 - _normal_cdf(z))

    def response_quantile(self, q: float, max_response_length: int) -> float:
        """The q-quantile of the capped response length: min(c, median · e^(σ · Φ⁻¹(q)))."""
        from statistics import NormalDist

        return min(float(max_response_length), int(self.response_median) * math.exp(
            self.response_sigma * NormalDist().inv_cdf(q)))

    def longest_of(self, num: int, max_response_length: int) -> float:
        """The longest of `num` responses, taken as the num/(num+1) quantile (where the
        largest of num draws falls on average, in probability)."""
        return self.response_quantile(num / (num + 1), max_response_length)

    def draw(self, num: int, max_response_length: int) -> List[int]:
        """`num` sample lengths (prompt + response), responses capped at max_response_length
        (call on a `resolved` assumption)."""
        rng = random.Random(self.seed)
        return [int(self.prompt_tokens) + max(1, min(max_response_length, int(rng.lognormvariate(
            math.log(int(self.response_median)), self.response_sigma)))) for _ in range(num)]


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def learner_efficiency(cfg: DapoConfig, dp: int, lengths: Optional[LengthAssumption] = None) -> dict:
    """Padding efficiency and DP imbalance of one mini-batch under `cfg` (module docstring)."""
    m, a = cfg.megatron, cfg.algo
    assumption = (lengths or LengthAssumption()).resolved(a.max_prompt_length, a.max_response_length)
    samples = assumption.draw(a.mini_batch_size * a.n_samples_per_prompt, a.max_response_length)
    thd = m.transformer_impl != "local"  # the GPU spec: Transformer Engine, THD packing
    multiple = token_multiple(m.tensor_model_parallel_size, m.sequence_parallel, m.fp8.enabled, m.fp8.recipe)

    def measure(packing: bool, balanced: bool) -> dict:
        stats = measure_layout(samples, dp, m.micro_batch_tokens, packing=packing, balanced=balanced, thd=thd,
                               multiple=multiple).to_dict()
        stats.pop("rank_tokens")
        stats["max_micro_batches"] = max(stats.pop("micro_batches"))
        return stats

    return {"assumption": {"response_median": assumption.response_median,
                           "response_sigma": assumption.response_sigma, "prompt_tokens": assumption.prompt_tokens,
                           "samples": len(samples), "mean_length": sum(samples) / len(samples),
                           "max_length": max(samples)},
            "configured": {"sequence_packing": m.sequence_packing, "balance_data_parallel": m.balance_data_parallel,
                           "token_multiple": multiple, "thd": thd and m.sequence_packing,
                           **measure(m.sequence_packing, m.balance_data_parallel)},
            "padded_contiguous": measure(False, False)}


def compute_plan(cfg: DapoConfig, lengths: Optional[LengthAssumption] = None) -> dict:
    """The layout, memory, learner efficiency and warnings of `cfg` on its cluster.* shape.

    Pure (no I/O but config.json); `lengths` is the response-length assumption of the
    efficiency figures (default `LengthAssumption()`).
    """
    c, m, r, a = cfg.cluster, cfg.megatron, cfg.rollout, cfg.algo
    shape, source = resolve_model_shape(cfg)
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    gpus_per_node = c.gpus_per_node
    disagg = c.mode == "disaggregated"
    engine_nodes = c.engine_nodes if disagg else c.num_nodes
    learner_nodes = c.num_nodes - c.engine_nodes if disagg else c.num_nodes
    world = learner_nodes * gpus_per_node
    warnings: List[str] = []
    model_parallel = tp * pp * cp
    if world % model_parallel:
        warnings.append(f"learner GPUs {world} not divisible by tp*pp*cp = {model_parallel}")
    dp = max(1, world // model_parallel)
    if tp > gpus_per_node:
        warnings.append(f"TP {tp} crosses nodes ({gpus_per_node} GPUs per node): TP all-reduces go over the network")
    if r.engine_tp_size > gpus_per_node:
        warnings.append(f"engine TP {r.engine_tp_size} crosses nodes ({gpus_per_node} GPUs per node)")
    if shape.num_attention_heads % tp or shape.num_key_value_heads % tp and tp % shape.num_key_value_heads:
        warnings.append(f"{shape.num_attention_heads} heads / {shape.num_key_value_heads} KV heads do not split over TP {tp}")
    if shape.num_layers % pp:
        warnings.append(f"{shape.num_layers} layers do not split evenly over PP {pp}")

    gpu_bytes = c.gpu_memory_gib * GIB
    optimizer_factor = 2 + 4 + (12 / dp if m.use_distributed_optimizer else 12)
    stages = []
    for stage in range(pp):
        params = stage_params_per_gpu(shape, tp, pp, stage)
        state = params * optimizer_factor
        acts = activation_bytes(cfg, shape, stage)
        stages.append({"stage": stage, "params": params, "param_bytes": params * 2, "grad_bytes": params * 4,
                       "optimizer_bytes": params * (12 / dp if m.use_distributed_optimizer else 12),
                       "model_state_bytes": state, "activation_bytes": acts, "total_bytes": state + acts})
    worst = max(stages, key=lambda st: st["total_bytes"])
    if worst["total_bytes"] > 0.9 * gpu_bytes:
        warnings.append(f"learner does not fit: stage {worst['stage']} needs {worst['total_bytes'] / GIB:.1f} GiB of "
                        f"{c.gpu_memory_gib:.0f} GiB (keep 10% for the CUDA context and fragmentation); raise TP/PP, "
                        "enable megatron.recompute_granularity=full or lower micro_batch_tokens")

    phi = total_params(shape)
    e = r.engine_tp_size * r.engine_dp_size
    resident = max(st["model_state_bytes"] for st in stages) if not disagg else 0
    engine_room = e * (min(r.mem_fraction_static * gpu_bytes, gpu_bytes - resident)) - 2 * phi
    per_token = kv_bytes_per_token(shape, r.engine_tp_size) * r.engine_tp_size  # whole engine
    seq_tokens = a.max_prompt_length + a.max_response_length
    kv_tokens = max(0, int(engine_room // per_token))
    if engine_room <= 0:
        warnings.append(f"engines have no KV-cache room: {e} GPUs x mem_fraction_static {r.mem_fraction_static} "
                        f"cannot hold {2 * phi / GIB:.1f} GiB of weights"
                        + (" next to the resident learner state" if not disagg else ""))
    engine_gpus = engine_nodes * gpus_per_node
    used_engine_gpus = r.num_engines * e
    if used_engine_gpus > engine_gpus:
        warnings.append(f"{r.num_engines} engines x {e} GPUs need {used_engine_gpus} GPUs, the engine nodes have {engine_gpus}")
    elif used_engine_gpus < engine_gpus:
        warnings.append(f"engines idle GPUs: {engine_gpus - used_engine_gpus} of {engine_gpus} engine GPUs run no engine")
    if disagg and c.max_staleness == 0:
        warnings.append("engines idle while learners train: disaggregated with cluster.max_staleness=0 is synchronous")

    placement = place(cfg, ClusterShape.from_config(cfg, use_gpu=c.device != "cpu"))
    warnings.extend(f"placement: {problem}" for problem in placement.problems())
    layout = []
    for node in range(c.num_nodes):
        roles = []
        ranks = [lp.rank for lp in placement.learners if lp.device.node == node]
        if ranks:
            roles.append(f"learner ranks {ranks[0]}-{ranks[-1]}")
        engines = placement.engines_on_node(node)
        if engines:
            roles.append(f"engines {engines[0].index}-{engines[-1].index} (TP {r.engine_tp_size})")
        layout.append({"node": node, "roles": roles,
                       "engine_gpus": {e.index: list(e.gpu_ids) for e in engines}})
    groups = [{"name": g.name, "kind": g.kind, "stage": g.stage, "world_size": g.world_size,
               "learner_ranks": [m.index for m in g.members if m.role == "learner"]} for g in placement.groups]

    efficiency = learner_efficiency(cfg, dp, lengths)
    if efficiency["configured"]["dp_imbalance"] > 1.10 and not m.balance_data_parallel:
        warnings.append(f"data-parallel ranks uneven: the busiest carries "
                        f"{efficiency['configured']['dp_imbalance']:.2f}x the mean tokens; set "
                        "megatron.balance_data_parallel=true (or more samples per rank)")

    sync_bytes = 2 * phi
    return {
        "model": {"name": cfg.model.name, "source": source, **asdict(shape)}, "total_params": phi,
        "cluster": {"mode": c.mode, "num_nodes": c.num_nodes, "gpus_per_node": gpus_per_node,
                    "learner_nodes": learner_nodes, "engine_nodes": engine_nodes, "gpu_memory_gib": c.gpu_memory_gib},
        "parallel": {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "world_size": world,
                     "sequence_parallel": m.sequence_parallel, "recompute": m.recompute_granularity,
                     "distributed_optimizer": m.use_distributed_optimizer, "fp8": m.fp8.enabled},
        "learner_memory": {"stages": stages, "worst_stage": worst["stage"], "worst_total_gib": worst["total_bytes"] / GIB},
        "engines": {"num_engines": r.num_engines, "gpus_per_engine": e, "kv_room_bytes": max(0.0, engine_room),
                    "kv_bytes_per_token": per_token, "kv_tokens": kv_tokens,
                    "max_full_length_sequences": kv_tokens // seq_tokens if seq_tokens else 0},
        "weight_sync": {"bytes_per_step": sync_bytes, "gib_per_step": sync_bytes / GIB,
                        "seconds_at_400gbps": sync_bytes * 8 / 400e9},
        "learner_efficiency": efficiency,
        "layout": layout, "warnings": warnings,
        "sync": {"transport": placement.transport, "groups": groups},
    }


def format_plan(plan: dict, sections: Sequence[str] = ()) -> str:
    """The plan as a fixed-width table; `sections` (e.g. the clock of `dapo_mega.clock`) are
    printed before the warnings."""
    p, mdl = plan["parallel"], plan["model"]
    lines = [f"model {mdl['name']} ({mdl['source']}): {plan['total_params'] / 1e9:.2f} B params, "
             f"{mdl['num_layers']} layers, hidden {mdl['hidden_size']}",
             f"cluster {plan['cluster']['mode']}: {plan['cluster']['num_nodes']} nodes x "
             f"{plan['cluster']['gpus_per_node']} GPUs ({plan['cluster']['gpu_memory_gib']:.0f} GiB)",
             f"learners: TP {p['tp']} PP {p['pp']} CP {p['cp']} DP {p['dp']} (world {p['world_size']}), "
             f"SP {p['sequence_parallel']}, recompute {p['recompute']}, fp8 {p['fp8']}", "",
             "stage  params/GPU   params   grads    optim    state    activ    total  (GiB)"]
    for st in plan["learner_memory"]["stages"]:
        lines.append(f"{st['stage']:>5}  {st['params'] / 1e9:8.3f}B  " + "  ".join(
            f"{st[k] / GIB:7.2f}" for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes",
                                            "activation_bytes", "total_bytes")))
    eng = plan["engines"]
    lines += ["", f"engines: {eng['num_engines']} x {eng['gpus_per_engine']} GPUs, KV room "
              f"{eng['kv_room_bytes'] / GIB:.1f} GiB per engine = {eng['kv_tokens']:,} tokens "
              f"= {eng['max_full_length_sequences']} full-length sequences",
              f"weight sync: {plan['weight_sync']['gib_per_step']:.1f} GiB per step "
              f"(>= {plan['weight_sync']['seconds_at_400gbps']:.2f} s from one 400 Gb/s NIC)"]
    eff = plan["learner_efficiency"]
    assumed, conf, base = eff["assumption"], eff["configured"], eff["padded_contiguous"]
    lines += ["", f"learner efficiency, one mini-batch of {assumed['samples']} samples (assumed: responses "
              f"log-normal, median {assumed['response_median']:,}, sigma {assumed['response_sigma']}, prompts "
              f"{assumed['prompt_tokens']}; mean {assumed['mean_length']:,.0f}, max {assumed['max_length']:,} tokens)",
              f"  configured (packing {conf['sequence_packing']}{' THD' if conf['thd'] else ''}, balanced DP "
              f"{conf['balance_data_parallel']}, token multiple {conf['token_multiple']}): padding efficiency "
              f"{conf['padding_efficiency']:.2%}, DP imbalance {conf['dp_imbalance']:.3f}, "
              f"<= {conf['max_micro_batches']} micro-batches per rank",
              f"  padded, contiguous DP blocks: padding efficiency {base['padding_efficiency']:.2%}, "
              f"DP imbalance {base['dp_imbalance']:.3f}, <= {base['max_micro_batches']} micro-batches per rank",
              "", "layout:"]
    lines += [f"  node {n['node']:>3}: " + "; ".join(n["roles"]) for n in plan["layout"]]
    groups = plan["sync"]["groups"]
    if plan["sync"]["transport"] == "cuda_ipc":
        lines += [f"weight sync: CUDA IPC hand-over on each GPU ({len(groups)} engines, each fed by the learner "
                  "ranks on its GPUs; no NCCL group with an engine)"]
    else:
        lines += [f"weight sync: {plan['sync']['transport']}; " + ", ".join(
            f"{g['name']} (source rank {g['learner_ranks'][0]} + {g['world_size'] - 1} engine ranks)"
            for g in groups)]
    for section in sections:
        lines += ["", section]
    lines += [""] + [f"WARNING: {w}" for w in plan["warnings"]] if plan["warnings"] else ["", "no warnings"]
    return "\n".join(lines)
