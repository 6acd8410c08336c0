"""`dapo-mega plan`: layout and memory of a config on a cluster shape, before any GPU is used.

    dapo-mega plan +experiment=dapo_qwen2.5_32b            a table
    dapo-mega plan +experiment=dapo_qwen2.5_32b --json     the same as JSON

The clock of the run (durations beside the timeouts that bound them) is `dapo_mega.plan.clock`,
which builds on this module; the command (`dapo_mega.cli`) prints both.

Memory per learner GPU (bytes), for TP=t, PP=p, CP=c (must be 1: the learner refuses
more), DP=d = W/(t·p·c), the parameters Φ_s held by one GPU of pipeline stage s (linear
weights, QKV bias and embedding/output split over t, the vocabulary padded to 128·t rows as
the learner pads it; norms replicated):

    model state  M_s = Φ_s · (2 + 4 + 12/d)       bf16 params (2) + fp32 main grads (4)
                                                  + fp32 master params, Adam m, Adam v (12)
                                                  sharded over DP by Megatron's
                                                  distributed optimizer (ZeRO-1);
                                                  without it: Φ_s · 18
    FP8 caches   2 bytes per FP8 linear weight     Transformer Engine keeps an FP8 copy of
                                                  each weight and its transpose across the
                                                  micro-batches of a step
    activations  what one transformer layer keeps for backward for one micro-batch of
                 s = micro_batch_tokens tokens, tensor by tensor (`layer_saved_bytes`; the
                 derivation and the 32B numbers: docs/cluster.md, "Memory by hand"); with
                 sequence parallelism 46.8·s·h/t for Qwen2.5-32B, 45.2 without RoPE's cos
                 and sin (SwiGLU of 5.4h, GQA, no dropout, flash attention: no s² term;
                 GPT-3's is 34). Kept per stage (1F1B: p − s
                 micro-batches in flight on stage s): every layer's tensors (no or
                 selective recompute), or the input of each recompute chunk, s·h/t
                 elements (full, uniform), or both per layer (full, block); plus, one at a
                 time, the layers being recomputed and the backward's temporaries.
    logits       last stage: the bf16 [s, V/t] logits of the output layer, their gradient
                 and the fp32 chunks of `ChunkedVocabParallelLogProbs` (`logits_peak_bytes`),
                 at a different moment than the recompute, so the stage's peak takes the
                 larger of the two.

KV cache per engine (SGLang 0.5.23, `kv_cache_configurator._profile_available_bytes`): per
engine GPU, with B the free memory when the engine starts (after its CUDA context) and
f = mem_fraction_static,
    rest = free after loading the weights − B·(1 − f) = f·B − 2·Φ/e   (e = engine TP)
Colocated, the engines start after the learners initialise, so B = G − the learner's
resident state − both CUDA contexts; the GPU then holds, during rollout, the learner's
state, both contexts, the engine's weights, its KV pool and its CUDA graphs and activations
(`colocated_fit`). Bytes per token 2 (K,V) · L · n_kv · d_head · 2.
Weight sync per step: 2·Φ bytes (bf16) to every engine.
Checkpoints: the model in its dtype + the fp32 optimizer state, (keep_last_k + 1) of them on
disk while one is written (`checkpoint_bytes`).

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

from dapo_mega.backends.megatron.layout import check_expert_layout
from dapo_mega.backends.megatron.packing import measure_layout, token_multiple
from dapo_mega.backends.placement import ClusterShape, Placement, place
from dapo_mega.config import DapoConfig, EngineKind
from dapo_mega.engines.sglang.commands import CPU_KV_MARGIN, cpu_pool_tokens
from dapo_mega.models.shape import ModelShape
from dapo_mega.plan.hand_over import hand_over_bytes, hand_over_lines
from dapo_mega.plan.types import (
    AssumedBatch,
    CheckpointDisk,
    ClusterSummary,
    ColocatedFit,
    ConfiguredLayout,
    ConversionHostRam,
    ConversionRam,
    EngineMemory,
    KvRoom,
    LayoutEfficiency,
    LearnerEfficiency,
    LearnerMemory,
    LearnerParallel,
    LogitsPeak,
    ModelSummary,
    NodeRoles,
    Plan,
    StageActivations,
    StageMemory,
    SyncGroup,
    SyncTopology,
    WeightSync,
)

GIB = 1024 ** 3


KNOWN_MODELS: Dict[str, ModelShape] = {
    # The sizes of the published config.json files; `plan` reads no other field.
    "qwen2.5-32b": ModelShape(model_type="qwen2", vocab_size=152064, hidden_size=5120, ffn_hidden_size=27648,
                              num_layers=64, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                              tie_word_embeddings=False, qkv_bias=True),
    "qwen2.5-7b": ModelShape(model_type="qwen2", vocab_size=152064, hidden_size=3584, ffn_hidden_size=18944,
                             num_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                             tie_word_embeddings=False, qkv_bias=True),
    "qwen3-8b": ModelShape(model_type="qwen3", vocab_size=151936, hidden_size=4096, ffn_hidden_size=12288,
                           num_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                           tie_word_embeddings=False, qkv_bias=False, qk_layernorm=True, rope_theta=1e6,
                           max_position_embeddings=40960),
    "qwen3-30b-a3b": ModelShape(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, ffn_hidden_size=6144,
                                num_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                tie_word_embeddings=False, qkv_bias=False, qk_layernorm=True, rope_theta=1e6,
                                max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
                                moe_ffn_hidden_size=768, norm_topk_prob=True, router_aux_loss_coef=0.001),
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


def layer_params(shape: ModelShape, layer: int = 0) -> Dict[str, int]:
    """Parameters of transformer layer `layer`: what TP shards (attention, a dense MLP), what
    it replicates (norms, a MoE layer's router), and a MoE layer's routed experts (each a
    SwiGLU of moe_ffn_hidden_size; sharded over EP: `experts`, 0 in a dense layer)."""
    h, hd = shape.hidden_size, shape.head_dim
    q_out, kv_out = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    attention = h * q_out + 2 * h * kv_out + q_out * h
    bias = _qkv_bias(shape)
    qk_norms = 2 * hd if shape.qk_layernorm else 0  # Qwen3's q_norm, k_norm: one [head_dim] weight each
    if shape.is_sparse_layer(layer):
        experts = shape.num_experts * 3 * h * shape.moe_ffn_hidden_size
        return {"sharded": attention + bias, "replicated": 2 * h + qk_norms + h * shape.num_experts,
                "experts": experts}
    mlp = 3 * h * shape.ffn_hidden_size  # SwiGLU: gate, up, down
    return {"sharded": attention + bias + mlp, "replicated": 2 * h + qk_norms, "experts": 0}  # + 2 RMSNorm weights


def total_params(shape: ModelShape) -> int:
    """Every parameter of the model (Qwen3-30B-A3B: 30.5 B)."""
    layers = sum(sum(layer_params(shape, i).values()) for i in range(shape.num_layers))
    embedding = shape.vocab_size * shape.hidden_size
    output = 0 if shape.tie_word_embeddings else embedding
    return layers + embedding + output + shape.hidden_size


def active_params(shape: ModelShape) -> int:
    """Parameters one token computes with: all but the routed experts it is not sent to
    (num_experts_per_tok of num_experts in each sparse layer; Qwen3-30B-A3B: 3.3 B). A dense
    model's are all of them."""
    idle = shape.num_sparse_layers * (shape.num_experts - shape.num_experts_per_tok) * 3 * shape.hidden_size \
        * shape.moe_ffn_hidden_size
    return total_params(shape) - idle


def stage_params_per_gpu(shape: ModelShape, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """Φ_s: parameters one GPU of pipeline stage `stage` holds (layers split evenly; routed
    experts split over EP, whole on each expert rank: expert TP 1)."""
    return sum(stage_param_split(shape, tp, pp, stage, ep))


def stage_param_split(shape: ModelShape, tp: int, pp: int, stage: int, ep: int = 1) -> Tuple[int, int]:
    """(the dense parameters, the routed experts' parameters) one GPU of `stage` holds: the
    distributed optimizer shards the first over DP and the second over expert DP."""
    first = sum(stage_layers(shape, pp, s) for s in range(stage))
    params, experts = 0, 0
    for layer in range(first, first + stage_layers(shape, pp, stage)):
        part = layer_params(shape, layer)
        params += math.ceil(part["sharded"] / tp) + part["replicated"]
        experts += part["experts"] // ep
    embedding = padded_vocab_per_gpu(shape, tp) * shape.hidden_size
    if stage == 0:
        params += embedding
    if stage == pp - 1:
        params += shape.hidden_size  # final norm
        if not shape.tie_word_embeddings or pp > 1:  # tied + pp>1: Megatron keeps a copy on the last stage
            params += embedding
    return params, experts


def padded_vocab_per_gpu(shape: ModelShape, tp: int) -> int:
    """Rows of the embedding and output layer on one TP rank: the vocabulary padded as the
    learner pads it (`backends.megatron.model.pad_vocab_size`: 152,064 -> 152,576 at TP 8), split over TP."""
    from dapo_mega.backends.megatron.model import pad_vocab_size

    return pad_vocab_size(shape.vocab_size, tp) // tp


def stage_layers(shape: ModelShape, pp: int, stage: int) -> int:
    """Transformer layers of pipeline stage `stage` (split evenly, the first stages take the rest)."""
    return shape.num_layers // pp + (1 if stage < shape.num_layers % pp else 0)


def learner_spec_and_bytes(cfg: DapoConfig) -> Tuple[str, int]:
    """(layer spec, bytes per activation element) the learner will use: the local spec and
    fp32 on a CPU (cluster.device=cpu or megatron.transformer_impl=local), else Transformer
    Engine and bf16 (`backends.megatron.model.plan_transformer_config` on a GPU)."""
    m = cfg.megatron
    on_cpu = cfg.cluster.device == "cpu"
    spec = "local" if on_cpu or m.transformer_impl == "local" else "transformer_engine"
    fp32 = m.params_dtype == "float32" or (m.params_dtype == "auto" and on_cpu)
    return spec, 4 if fp32 else 2


def layer_saved_bytes(shape: ModelShape, tokens: float, tp: int, sequence_parallel: bool,
                      spec: str = "transformer_engine", element_bytes: int = 2,
                      selective: bool = False, layer: Optional[int] = None) -> Dict[str, float]:
    """Bytes one transformer layer keeps for backward for a micro-batch of `tokens` tokens (one
    packed row), tensor by tensor: {what: bytes}. e = element_bytes, s_n = tokens/t under
    sequence parallelism (the norms' side of the layer), tokens otherwise; TP splits heads
    and the FFN. Derived from what each op saves in megatron-core 0.16 / TE 2.x (docs/cluster.md,
    "Memory by hand"); the local spec's figure is checked against torch's saved-tensor hooks
    (tests/plan/test_plan_activations.py).

    Both specs: the two RMSNorm inputs and outputs (the outputs are the QKV and FC1 GEMM
    inputs; under SP the sequence shard is kept and all-gathered again in backward), RoPE's
    cos and sin for q and k (unfused RoPE: [s, d] each, not split by TP), q, k, v after RoPE,
    the attention output (flash attention keeps it; it is the proj GEMM's input), FC1's
    output (gate and up: the SwiGLU input) and the SwiGLU output (FC2's input). No dropout
    masks (dropout 0), no bias terms (the QKV bias adds into the GEMM output, which nothing
    keeps). Transformer Engine: fp32 1/rms and softmax log-sum-exp; fused SwiGLU. Local
    spec: torch's unfused RMSNorm also keeps x·(1/rms) and 1/rms in e bytes; SDPA keeps k and
    v repeated to every query head and the mask as fp32 [s, s]; unfused SwiGLU also keeps
    silu(gate) and `up + glu_linear_offset`. Selective recompute (megatron's default
    recompute_modules=["core_attn"]) keeps the attention's inputs instead of its internals.
    Qwen3's q/k norms (`qk_layernorm`) add their inputs (the query as a copy, the key as a
    view that keeps the whole QKV output alive), 1/rms per head and, unfused, x·(1/rms)
    (measured: tests/plan/test_plan_activations_qwen3.py).

    A sparse layer of a mixture (`layer`, `ModelShape.is_sparse_layer`) keeps `_moe_saved_bytes`
    in place of the dense FFN's terms.
    """
    h, d, f, s, e = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size, float(tokens), element_bytes
    s_n = s / tp if sequence_parallel else s
    q = shape.num_attention_heads * d / tp
    kv = shape.num_key_value_heads * d / tp
    local = spec == "local"
    saved = {
        "norm inputs (2 RMSNorms)": 2 * e * s_n * h,
        "norm outputs = QKV and FC1 inputs": 2 * e * s_n * h,
        "1/rms of each norm": 2 * (e if local else 4) * s_n,
        "RoPE cos and sin for q and k": 4 * e * s * d,
        "q": e * s * q,
        "k, v": 2 * e * s * (q if local and not selective else kv),
        "attention output = proj input": e * s * q,
    }
    if layer is not None and shape.is_sparse_layer(layer):
        saved.update(_moe_saved_bytes(shape, s_n, spec, e))
    else:
        saved["FC1 output = SwiGLU input (gate, up)"] = 2 * e * s * f / tp
        saved["SwiGLU output = FC2 input"] = e * s * f / tp
        if local:
            saved["silu(gate), up + 0 (unfused SwiGLU)"] = 2 * e * s * f / tp
    if not selective:
        saved["softmax log-sum-exp (fp32)"] = 4 * s * shape.num_attention_heads / tp
    if shape.qk_layernorm:  # Qwen3: an RMSNorm per q and k head, between the QKV GEMM and RoPE
        # megatron reshapes the query into a copy; the key stays a view of the whole QKV output
        saved["q before its norm (a copy)"] = e * s * q
        saved["QKV output (k's norm input is a view of it)"] = e * s * (q + 2 * kv)
        saved["1/rms of each q and k head"] = (e if local else 4) * s * (shape.num_attention_heads
                                                                      + shape.num_key_value_heads) / tp
        if local:
            saved["q, k * 1/rms (unfused q/k norms)"] = e * s * (q + kv)
    if local:
        saved["x * 1/rms of each norm (unfused)"] = 2 * e * s_n * h
        if not selective:
            saved["SDPA's fp32 additive mask [s, s]"] = 4 * s * s
    return saved


def _moe_saved_bytes(shape: ModelShape, s_n: float, spec: str, e: int) -> Dict[str, float]:
    """What a sparse layer keeps instead of the dense FFN, for s_n tokens on this rank (the
    sequence shard under SP: megatron-core's all-to-all dispatcher routes each TP rank's own
    tokens; expert TP 1), from megatron-core 0.16.1's router, alltoall dispatcher and experts:

    * the router: fp32 logits and scores [s, E], top-k indices (int64, twice), the kept
      probabilities [s, k] (fp32, and permuted with the tokens), the routing map (bool [E, s])
      and the permutation's index (int64 [s k]);
    * the experts' input: the all-to-all's output, s k token copies of h (balanced routing: each
      EP rank receives as many copies as it sends; the load-balancing loss keeps it near);
    * each expert's SwiGLU over its copies: FC1's output (2 mf) and the SwiGLU's output (mf, FC2's
      input), and, weighted by the routing probabilities, the unweighted output (mf); the local
      spec's unfused SwiGLU also keeps silu(gate) and up (2 mf): 6 mf a copy (3 mf fused).

    The local spec's figure is checked against torch's saved-tensor hooks at EP 1 and EP 2
    (tests/plan/test_plan_activations_moe.py)."""
    k, n_e, h, mf = shape.num_experts_per_tok, shape.num_experts, shape.hidden_size, shape.moe_ffn_hidden_size
    copies = s_n * k
    return {
        "router logits and scores (fp32 [s, E], twice)": 2 * 4 * s_n * n_e,
        "router top-k indices (int64, twice), probs (fp32, twice), permutation index": (2 * 8 + 2 * 4 + 8) * copies,
        "routing map (bool [E, s])": s_n * n_e,
        "expert input = all-to-all output (s k copies)": e * copies * h,
        "expert SwiGLU (FC1 output, output, unweighted output)": (6 if spec == "local" else 3) * e * copies * mf,
    }


def moe_workspace_bytes(shape: ModelShape, s_n: float, e: int) -> float:
    """Transient bytes around one sparse layer beyond what it keeps: the all-to-all buffers
    (the permuted tokens sent and the expert outputs sent back and received, [s k, h] each;
    in backward their gradients) and the experts' SwiGLU gradients ([s k, 3 mf])."""
    copies = s_n * shape.num_experts_per_tok
    return e * copies * (3 * shape.hidden_size + 3 * shape.moe_ffn_hidden_size)


def logits_peak_bytes(tokens: float, vocab_local: int, logits_bytes: int = 2,
                      chunk_tokens: Optional[int] = None) -> LogitsPeak:
    """What the last stage holds for the logits of one micro-batch, from
    `backends/megatron/logprobs.py` (`ChunkedVocabParallelLogProbs`), with n = tokens, V = vocab_local:

        logits      the output layer's [n, V] in the model dtype (saved for backward)
        forward     logits + 3 fp32 [chunk, V]: the scaled chunk, its exp and exp·scaled
        backward    logits + their gradient (`empty_like(logits)`) + two fp32 softmax chunks
                    (the loop's `p` of the previous chunk lives until the next one is
                    assigned) + with bf16 logits the fp32 cast of the chunk before the division
        peak        the larger; plus the per-token fp32 log p, logsumexp and entropy
    """
    if chunk_tokens is None:
        from dapo_mega.backends.megatron.logprobs import LOGPROB_CHUNK_TOKENS

        chunk_tokens = LOGPROB_CHUNK_TOKENS
    n = float(tokens)
    logits = logits_bytes * n * vocab_local
    chunk = 4 * min(chunk_tokens, n) * vocab_local
    second = chunk if logits_bytes != 4 else 0.0  # fp32 logits: .float() and .to(fp32) copy nothing
    forward = logits + 3 * chunk
    backward = 2 * logits + 2 * chunk + second
    return LogitsPeak(logits=logits, fp32_chunk=chunk, forward=forward, backward=backward,
                      peak=max(forward, backward) + 3 * 4 * n)


def stage_activation_bytes(cfg: DapoConfig, shape: ModelShape, stage: int) -> StageActivations:
    """Activation memory of pipeline stage `stage` for the learner's step (module docstring),
    in bytes; peak = kept + the larger of
    (recompute + workspace) and the logits peak (the last stage's loss runs before any layer
    is recomputed)."""
    m = cfg.megatron
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    spec, e = learner_spec_and_bytes(cfg)
    s, h, f = m.micro_batch_tokens / m.context_parallel_size, shape.hidden_size, shape.ffn_hidden_size
    s_n = s / tp if m.sequence_parallel else s
    layers, in_flight, last = stage_layers(shape, pp, stage), pp - stage, stage == pp - 1
    first = sum(stage_layers(shape, pp, st) for st in range(stage))
    each = [sum(layer_saved_bytes(shape, s, tp, m.sequence_parallel, spec, e,
                                  selective=m.recompute_granularity == "selective", layer=first + i).values())
            for i in range(layers)]
    per_layer = max(each, default=0.0)  # the stage's largest: a sparse layer where it has one
    layer_input = e * s_n * h  # what a recompute checkpoint keeps
    if m.recompute_granularity == "full":
        n = max(1, m.recompute_num_layers or 1)
        if m.recompute_method == "block":
            recomputed = min(n, layers)
            per_micro_batch = recomputed * layer_input + sum(each[recomputed:])
            recompute = per_layer if recomputed else 0.0
        else:
            per_micro_batch = math.ceil(layers / n) * layer_input
            recompute = min(n, layers) * per_layer
    else:
        per_micro_batch, recompute = sum(each), 0.0
    # backward of one layer: the SwiGLU's input and output gradients, one all-gathered [s, h] GEMM
    # input; a sparse layer's all-to-all buffers and expert gradients where larger
    workspace = e * s * (3 * f / tp + h)
    if any(shape.is_sparse_layer(first + i) for i in range(layers)):
        workspace = max(workspace, e * s * h + moe_workspace_bytes(shape, s_n, e))
    kept = in_flight * per_micro_batch
    logits = 0.0
    if last:
        kept += (2 if spec == "transformer_engine" else 3) * e * s_n * h  # final norm input, output-layer input
        logits = logits_peak_bytes(s, padded_vocab_per_gpu(shape, tp), e).peak
    return StageActivations(per_layer=per_layer, kept=kept, recompute=recompute, workspace=workspace,
                            logits=logits, peak=kept + max(recompute + workspace, logits))


def fp8_cache_bytes(cfg: DapoConfig, shape: ModelShape, stage: int) -> float:
    """FP8 weight caches of one GPU of `stage`: Transformer Engine keeps each FP8 GEMM's weight
    cast to FP8 and its transpose (1 byte each per parameter) from the first micro-batch of a
    step to the last. Layers kept in bf16 (num_layers_at_start/end_in_bf16, which megatron
    ignores under delayed scaling) have none."""
    m = cfg.megatron
    if not m.fp8.enabled:
        return 0.0
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    layers = stage_layers(shape, pp, stage)
    if m.fp8.recipe != "delayed":
        if stage == 0:
            layers -= min(layers, m.fp8.num_layers_at_start_in_bf16)
        if stage == pp - 1:
            layers -= min(layers, m.fp8.num_layers_at_end_in_bf16)
    part = layer_params(shape, shape.num_layers - 1)  # a sparse layer where the model has any
    linear = math.ceil((part["sharded"] - _qkv_bias(shape)) / tp) + part["experts"] // m.expert_model_parallel_size
    return 2.0 * max(0, layers) * linear


def _qkv_bias(shape: ModelShape) -> int:
    return (shape.num_attention_heads + 2 * shape.num_key_value_heads) * shape.head_dim if shape.qkv_bias else 0


def kv_bytes_per_token(shape: ModelShape, engine_tp: int) -> int:
    """K and V of every layer for one token on one engine GPU (bf16; KV heads split by TP)."""
    kv_heads = max(1, math.ceil(shape.num_key_value_heads / engine_tp))
    return 2 * shape.num_layers * kv_heads * shape.head_dim * 2


LEARNER_CONTEXT_GIB = 1.5
"""Assumed: one learner rank's CUDA context (~0.5 GiB with torch on an H100), the NCCL
communicators of its TP, PP, DP and embedding groups, and the cuBLAS / TE workspaces."""
ENGINE_CONTEXT_GIB = 1.0
"""Assumed: one engine GPU's CUDA context, NCCL and what SGLang allocates outside its memory
saver (kept while the engine is released for training)."""
ENGINE_RUNTIME_GIB = 3.0
"""Assumed: SGLang's CUDA graphs and forward activations on one engine GPU, what its
(1 − mem_fraction_static) share of the free memory is left for."""
WEIGHT_UPDATE_GROUP_GIB = 0.25
"""Assumed: NCCL's buffers for one weight-update communicator on one GPU: each channel keeps
NCCL_BUFFSIZE (4 MiB) for the Simple protocol, about as much for LL128 and 0.25 MiB for LL,
per ring peer; ~16 channels between nodes make ~0.15-0.3 GiB. An engine GPU joins one group
per learner PP stage, after SGLang sized its pool (`/init_weights_update_group`), so these
come out of its (1 − mem_fraction_static) share; the stage's source learner rank joins one."""


def weight_update_groups_per_engine_gpu(cfg: DapoConfig) -> int:
    """NCCL weight-update communicators on each engine GPU: one per learner PP stage where
    weights travel over groups (disaggregated, on GPUs: `placement.weight_update_group`); none
    colocated (the hand-over, `weights/handover.py`) or on a CPU cluster (gloo, host memory)."""
    if cfg.cluster.device == "cpu" or cfg.cluster.mode != "disaggregated":
        return 0
    return cfg.megatron.pipeline_model_parallel_size


def engine_kv_room(cfg: DapoConfig, phi: int, learner_resident: float, kv_cap: float = math.inf) -> KvRoom:
    """SGLang 0.5.23's KV budget on one engine GPU (`_profile_available_bytes`): free memory B
    measured when the engine starts (after its CUDA context, and, colocated, beside the
    learner's `learner_resident` bytes and context), the weights loaded, then
    rest = f·B − weights, at most `kv_cap` (`--max-total-tokens`: `_apply_token_constraints`)."""
    r, gpu = cfg.rollout, cfg.cluster.gpu_memory_gib * GIB
    contexts = 0.0 if cfg.cluster.device == "cpu" else (  # no CUDA on a CPU cluster
        ENGINE_CONTEXT_GIB + (LEARNER_CONTEXT_GIB if cfg.cluster.mode == "colocated" else 0.0)) * GIB
    free_at_start = gpu - learner_resident - contexts
    weights = 2 * phi / r.engine_tp_size
    return KvRoom(free_at_start=free_at_start, weights=weights, contexts=contexts,
                  kv=min(r.mem_fraction_static * free_at_start - weights, kv_cap))


def colocated_fit(cfg: DapoConfig, phi: int, stage: StageMemory, dp: int, kv_cap: float = math.inf) -> ColocatedFit:
    """One colocated GPU of a stage in both phases (bytes). The engine sizes its KV pool when
    it starts: on a fresh run the learner then holds its bf16 params, fp32 grads and fp32
    master shard but no Adam m, v (made at the first step) and no FP8 caches (made at the
    first forward); on a resumed run the whole model state. During rollout the learner holds
    model state + FP8 caches (torch's cache emptied before the engines resume) beside the
    engine's weights, KV pool and runtime, and at the weight sync that precedes it two
    buckets (`weights/handover.py`: the source rank's gathered HF tensors and the flat
    buffer every rank receives); during training the released engine keeps its context.
    The rollout figure is the fresh run's (the larger pool); `kv_cap`: the pool's cap on one GPU."""
    m, params = cfg.megatron, stage.params
    fresh = params * (2 + 4 + (4 / dp if m.use_distributed_optimizer else 4))
    at_fresh = engine_kv_room(cfg, phi, fresh, kv_cap)
    at_resume = engine_kv_room(cfg, phi, stage.model_state_bytes, kv_cap)
    learner = stage.model_state_bytes + stage.fp8_cache_bytes
    runtime = 0.0 if cfg.cluster.device == "cpu" else ENGINE_RUNTIME_GIB * GIB
    engine = at_fresh.weights + max(0.0, at_fresh.kv) + runtime
    sync = 2 * (cfg.rollout.weight_sync_bucket_mb << 20)
    return ColocatedFit(stage=stage.stage, kv_fresh=at_fresh.kv, kv_resumed=at_resume.kv, learner_resident=learner,
                        engine_weights=at_fresh.weights, contexts=at_fresh.contexts, engine_runtime=runtime,
                        sync_buffers=sync, rollout_bytes=learner + sync + at_fresh.contexts + engine,
                        training_bytes=stage.total_bytes + at_fresh.contexts)


def checkpoint_bytes(cfg: DapoConfig, phi: int) -> CheckpointDisk:
    """One training checkpoint (`backends/megatron/checkpoint.py` `_full_state`): the model's
    sharded state dict in its dtype (each tensor once, replicas deduplicated) and the
    optimizer's: fp32 master params + Adam m and v under bf16 (12 bytes per parameter), m and v
    only when the params are fp32 (8); RNG and trainer state are negligible. The run directory
    keeps `trainer.keep_last_k` and prunes only after the next one is committed, so the disk
    peak is keep_last_k + 1 of them, plus those `trainer.keep_every` keeps for good
    (`checkpoints_kept_for_good`). With `trainer.hf_export_interval` > 0 the run also keeps
    `trainer.hf_export_keep` HF exports of the weights in `trainer.hf_export_dtype` (each
    smaller than a checkpoint, and written at another time than one: the peak adds the kept
    ones)."""
    _, e = learner_spec_and_bytes(cfg)
    model, optimizer = e * phi, (12 if e == 2 else 8) * phi
    each = model + optimizer
    keep = cfg.trainer.keep_last_k
    t = cfg.trainer
    kept = checkpoints_kept_for_good(t.total_steps, t.save_interval, t.keep_every, keep)
    export = phi * {"float32": 4}.get(t.hf_export_dtype, 2) if t.hf_export_interval > 0 else 0
    return CheckpointDisk(model_bytes=model, optimizer_bytes=optimizer, bytes=each, keep_last_k=keep,
                          hf_export_bytes=export, hf_export_keep=t.hf_export_keep if export else 0,
                          kept_for_good=kept, disk_peak_bytes=(keep + 1 + kept) * each + (t.hf_export_keep * export))


def checkpoints_kept_for_good(total_steps: int, save_interval: int, keep_every: int, keep_last_k: int) -> int:
    """Saved checkpoints at a multiple of `keep_every` other than the newest `keep_last_k`
    (`run_files.checkpoints.prune_checkpoints` keeps them all): a run saves every `save_interval` steps and
    at its last step."""
    if keep_every <= 0:
        return 0
    saved = [s for s in range(1, total_steps + 1) if (save_interval > 0 and s % save_interval == 0)
             or s == total_steps]
    newest = set(saved[-keep_last_k:])
    return sum(1 for s in saved if s % keep_every == 0 and s not in newest)


CONVERSION_FIXED_BYTES = 0.4e9
"""Measured: the converting process's interpreter with torch and megatron imported
(`bench/bench_conversion_memory.py`: 386 MiB), which does not grow with the model."""


def conversion_host_ram_bytes(phi: int, tp: int, largest_tensor: int, dtype_bytes: int = 2, experts: int = 0,
                              ep: int = 1) -> ConversionRam:
    """Host RAM of `tools/convert_checkpoint.py` at `--tp tp`, by the rule the conversion
    benchmark measured (1.50x / 1.49x / 1.52x of a 929 MiB checkpoint for import / export /
    verify at TP 1): each process holds its share of the model once, in the checkpoint's
    dtype (no random initialisation, HF tensors read one at a time), plus up to two copies
    of the largest HF tensor (`largest_tensor` elements: the embedding or output layer)
    while it is gathered or padded (one copy at TP 1), plus `CONVERSION_FIXED_BYTES`. A
    mixture at `--ep ep`: its `experts` (parameters) split over EP instead of TP, on
    `backends.placement.conversion_world_size` processes (an expert tensor is gathered over EP
    one at a time: small beside the embedding)."""
    from dapo_mega.backends.placement import conversion_world_size

    copies = 2 if tp > 1 else 1
    per_process = (CONVERSION_FIXED_BYTES + dtype_bytes * ((phi - experts) / tp + experts / ep)
                   + copies * dtype_bytes * largest_tensor)
    processes = conversion_world_size(tp, 1, ep)
    return ConversionRam(tp=tp, per_process_bytes=per_process, total_bytes=processes * per_process, ep=ep)


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

        r = 1 is the mean length, r = 2 what attention's cost grows with (`dapo_mega.plan.clock`)."""
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


def learner_efficiency(cfg: DapoConfig, dp: int, lengths: Optional[LengthAssumption] = None) -> LearnerEfficiency:
    """Padding efficiency and DP imbalance of one mini-batch under `cfg` (module docstring)."""
    m, a = cfg.megatron, cfg.algo
    assumption = (lengths or LengthAssumption()).resolved(a.max_prompt_length, a.max_response_length)
    samples = assumption.draw(a.mini_batch_size * a.n_samples_per_prompt, a.max_response_length)
    thd = m.transformer_impl != "local"  # the GPU spec: Transformer Engine, THD packing
    multiple = token_multiple(m.tensor_model_parallel_size, m.sequence_parallel, m.fp8.enabled, m.fp8.recipe)

    def measure(packing: bool, balanced: bool) -> LayoutEfficiency:
        stats = measure_layout(samples, dp, m.micro_batch_tokens, packing=packing, balanced=balanced, thd=thd,
                               multiple=multiple)
        return LayoutEfficiency(useful_tokens=stats.useful_tokens, computed_tokens=stats.computed_tokens,
                                padding_efficiency=stats.padding_efficiency, dp_imbalance=stats.dp_imbalance,
                                max_micro_batches=max(stats.micro_batches))

    configured = measure(m.sequence_packing, m.balance_data_parallel)
    return LearnerEfficiency(
        assumption=AssumedBatch(response_median=assumption.response_median, response_sigma=assumption.response_sigma,
                                prompt_tokens=assumption.prompt_tokens, samples=len(samples),
                                mean_length=sum(samples) / len(samples), max_length=max(samples)),
        configured=ConfiguredLayout(**asdict(configured), sequence_packing=m.sequence_packing,
                                    balance_data_parallel=m.balance_data_parallel, token_multiple=multiple,
                                    thd=thd and m.sequence_packing),
        padded_contiguous=measure(False, False))


def compute_plan(cfg: DapoConfig, lengths: Optional[LengthAssumption] = None) -> Plan:
    """The layout, memory, learner efficiency and warnings of `cfg` on its cluster.* shape, as
    a `Plan` (`dapo_mega.plan.types`; `Plan.to_dict()` is its JSON).

    Pure (no I/O but config.json); `lengths` is the response-length assumption of the
    efficiency figures (default `LengthAssumption()`). ConfigError where the learner would
    refuse the layout (context parallelism), with the learner's own message.
    """
    c, m, r = cfg.cluster, cfg.megatron, cfg.rollout
    shape, source = resolve_model_shape(cfg)
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    disagg = c.mode == "disaggregated"
    engine_nodes = c.engine_nodes if disagg else c.num_nodes
    learner_nodes = c.num_nodes - c.engine_nodes if disagg else c.num_nodes
    world = learner_nodes * c.gpus_per_node
    warnings: List[str] = []
    dp = _check_layout(cfg, shape, world, warnings)

    stages = learner_stages(cfg, shape, dp)
    worst = max(stages, key=lambda st: st.total_bytes)
    group = WEIGHT_UPDATE_GROUP_GIB * GIB if weight_update_groups_per_engine_gpu(cfg) else 0.0  # a stage source's
    if worst.total_bytes + group > 0.9 * c.gpu_memory_gib * GIB:
        warnings.append(f"learner does not fit: stage {worst.stage} needs {(worst.total_bytes + group) / GIB:.1f} GiB of "
                        f"{c.gpu_memory_gib:.0f} GiB (keep 10% for the CUDA context and fragmentation); raise TP/PP, "
                        "enable megatron.recompute_granularity=full or lower micro_batch_tokens")
    phi = total_params(shape)
    engines = _engine_memory(cfg, shape, phi, stages, dp, warnings)
    engine_gpus = engine_nodes * c.gpus_per_node
    used_engine_gpus = r.num_engines * engines.gpus_per_engine
    if used_engine_gpus > engine_gpus:
        warnings.append(f"{r.num_engines} engines x {engines.gpus_per_engine} GPUs need {used_engine_gpus} GPUs, "
                        f"the engine nodes have {engine_gpus}")
    elif used_engine_gpus < engine_gpus:
        warnings.append(f"engines idle GPUs: {engine_gpus - used_engine_gpus} of {engine_gpus} engine GPUs run no engine")
    if disagg and c.max_staleness == 0:
        warnings.append("engines idle while learners train: disaggregated with cluster.max_staleness=0 is synchronous")

    placement = place(cfg, ClusterShape.from_config(cfg, use_gpu=c.device != "cpu"))
    warnings.extend(f"placement: {problem}" for problem in placement.problems())
    efficiency = learner_efficiency(cfg, dp, lengths)
    assumed = (lengths or LengthAssumption()).resolved(cfg.algo.max_prompt_length, cfg.algo.max_response_length)
    hand_over = hand_over_bytes(cfg, shape, dp, assumed.prompt_tokens,
                                assumed.response_moment(1, cfg.algo.max_response_length))
    if efficiency.configured.dp_imbalance > 1.10 and not m.balance_data_parallel:
        warnings.append(f"data-parallel ranks uneven: the busiest carries "
                        f"{efficiency.configured.dp_imbalance:.2f}x the mean tokens; set "
                        "megatron.balance_data_parallel=true (or more samples per rank)")
    spec, element_bytes = learner_spec_and_bytes(cfg)
    s_h_t = m.micro_batch_tokens * shape.hidden_size / tp if m.sequence_parallel else None
    embedding = shape.vocab_size * shape.hidden_size  # the largest HF tensor a conversion gathers
    sync_bytes = 2 * phi
    expert_params = sum(layer_params(shape, i)["experts"] for i in range(shape.num_layers))
    return Plan(
        model=ModelSummary(name=cfg.model.name, source=source, shape=shape), total_params=phi,
        active_params=active_params(shape),
        cluster=ClusterSummary(mode=c.mode, num_nodes=c.num_nodes, gpus_per_node=c.gpus_per_node,
                               learner_nodes=learner_nodes, engine_nodes=engine_nodes,
                               gpu_memory_gib=c.gpu_memory_gib),
        parallel=LearnerParallel(tp=tp, pp=pp, cp=cp, dp=dp, world_size=world, sequence_parallel=m.sequence_parallel,
                                 recompute=m.recompute_granularity, distributed_optimizer=m.use_distributed_optimizer,
                                 fp8=m.fp8.enabled),
        learner_memory=LearnerMemory(stages=stages, worst_stage=worst.stage, worst_total_gib=worst.total_bytes / GIB,
                                     layer_spec=spec, activation_element_bytes=element_bytes,
                                     per_layer_activation_s_h_over_t=(stages[0].per_layer_activation_bytes / s_h_t
                                                                      if s_h_t else None)),
        engines=engines,
        weight_sync=WeightSync(bytes_per_step=sync_bytes, gib_per_step=sync_bytes / GIB,
                               seconds_at_400gbps=sync_bytes * 8 / 400e9),
        checkpoint=checkpoint_bytes(cfg, phi),
        conversion_host_ram=ConversionHostRam(import_export=conversion_host_ram_bytes(
                                                  phi, tp, embedding, experts=expert_params, ep=m.expert_model_parallel_size),
                                              verify=conversion_host_ram_bytes(phi, 1, embedding, dtype_bytes=4),
                                              verify_stored=conversion_host_ram_bytes(phi, 1, embedding)),
        learner_efficiency=efficiency,
        layout=_node_layout(cfg, placement), warnings=warnings,
        sync=SyncTopology(transport=placement.transport, groups=[
            SyncGroup(name=g.name, kind=g.kind, stage=g.stage, world_size=g.world_size,
                      learner_ranks=[mb.index for mb in g.members if mb.role == "learner"]) for g in placement.groups]),
        hand_over=hand_over,
    )


def learner_data_parallel(cfg: DapoConfig) -> int:
    """DP of the learners on the cluster.* shape: their GPUs / (tp·pp·cp), at least 1."""
    c, m = cfg.cluster, cfg.megatron
    learner_nodes = c.num_nodes - c.engine_nodes if c.mode == "disaggregated" else c.num_nodes
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    return max(1, learner_nodes * c.gpus_per_node // model_parallel)


def _check_layout(cfg: DapoConfig, shape: ModelShape, world: int, warnings: List[str]) -> int:
    """DP of the learners; layout problems into `warnings`, the learner's refusals raised."""
    c, m, r = cfg.cluster, cfg.megatron, cfg.rollout
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if cp != 1:  # what the learner refuses, in its own words (imported only then: it brings torch)
        from dapo_mega.backends.megatron.layout import ParallelLayout
        from dapo_mega.backends.megatron.learner import check_learner_supports

        check_learner_supports(ParallelLayout.from_config(m, world))
    check_expert_layout(shape, m.expert_model_parallel_size, tp * learner_data_parallel(cfg))
    model_parallel = tp * pp * cp
    if world % model_parallel:
        warnings.append(f"learner GPUs {world} not divisible by tp*pp*cp = {model_parallel}")
    if tp > c.gpus_per_node:
        warnings.append(f"TP {tp} crosses nodes ({c.gpus_per_node} GPUs per node): TP all-reduces go over the network")
    if r.engine_tp_size > c.gpus_per_node:
        warnings.append(f"engine TP {r.engine_tp_size} crosses nodes ({c.gpus_per_node} GPUs per node)")
    if shape.num_attention_heads % tp or shape.num_key_value_heads % tp and tp % shape.num_key_value_heads:
        warnings.append(f"{shape.num_attention_heads} heads / {shape.num_key_value_heads} KV heads do not split over TP {tp}")
    if shape.num_layers % pp:
        warnings.append(f"{shape.num_layers} layers do not split evenly over PP {pp}")
    return learner_data_parallel(cfg)


def learner_stages(cfg: DapoConfig, shape: ModelShape, dp: int) -> List[StageMemory]:
    """Memory of one learner GPU of each pipeline stage (bytes; module docstring). bf16
    params: param 2 + main grad 4 + (master, m, v) 12 per parameter; fp32 params (CPU): 4 +
    4 + (m, v) 8; the optimizer's share divided by DP under the distributed optimizer."""
    m = cfg.megatron
    _, e = learner_spec_and_bytes(cfg)
    ep = m.expert_model_parallel_size
    edp = max(1, dp * m.tensor_model_parallel_size // ep)  # expert DP (expert TP 1): EP x EDP = TP x DP
    optimizer_share = (12 if e == 2 else 8) / (dp if m.use_distributed_optimizer else 1)
    expert_share = (12 if e == 2 else 8) / (edp if m.use_distributed_optimizer else 1)
    stages = []
    for stage in range(m.pipeline_model_parallel_size):
        dense, experts = stage_param_split(shape, m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                                           stage, ep)
        params = dense + experts
        state = params * (e + 4) + dense * optimizer_share + experts * expert_share
        optimizer_bytes = dense * optimizer_share + experts * expert_share
        acts = stage_activation_bytes(cfg, shape, stage)
        fp8 = fp8_cache_bytes(cfg, shape, stage)
        stages.append(StageMemory(stage=stage, params=params, param_bytes=params * e, grad_bytes=params * 4,
                                  optimizer_bytes=optimizer_bytes, model_state_bytes=state,
                                  fp8_cache_bytes=fp8, per_layer_activation_bytes=acts.per_layer,
                                  activation_kept_bytes=acts.kept, recompute_bytes=acts.recompute + acts.workspace,
                                  logits_bytes=acts.logits, activation_bytes=acts.peak,
                                  total_bytes=state + fp8 + acts.peak))
    return stages


def _engine_memory(cfg: DapoConfig, shape: ModelShape, phi: int, stages: List[StageMemory], dp: int,
                   warnings: List[str]) -> EngineMemory:
    """KV room of each engine by SGLang's formula and, colocated, the sum of learner and engine
    on one GPU in each phase (`colocated_fit`), warnings into `warnings`."""
    r, c, a = cfg.rollout, cfg.cluster, cfg.algo
    gpus = r.engine_tp_size * r.engine_dp_size
    gpu_bytes = c.gpu_memory_gib * GIB
    per_token = kv_bytes_per_token(shape, r.engine_tp_size) * r.engine_tp_size  # whole engine
    seq_tokens = a.max_prompt_length + a.max_response_length
    # SGLang on a CPU: the fleet's --max-total-tokens caps the pool, beside the learner or alone
    cap = cpu_pool_tokens(r, seq_tokens) if c.device == "cpu" and r.backend == EngineKind.SGLANG else 0
    kv_cap = cap * per_token / gpus if cap else math.inf
    colocated = [] if c.mode == "disaggregated" else [colocated_fit(cfg, phi, st, dp, kv_cap) for st in stages]
    room = engine_kv_room(cfg, phi, 0.0, kv_cap)
    kv_per_gpu = min(f.kv_resumed for f in colocated) if colocated else room.kv
    engine_room = gpus * kv_per_gpu
    kv_tokens = max(0, int(engine_room // per_token))
    if engine_room <= 0:
        warnings.append(f"engines have no KV-cache room: {gpus} GPUs x mem_fraction_static {r.mem_fraction_static} "
                        f"cannot hold {2 * phi / GIB:.1f} GiB of weights"
                        + (" next to the resident learner state" if colocated else ""))
    for fit in colocated:
        for phase, used in (("rollout", fit.rollout_bytes), ("training", fit.training_bytes)):
            if used > gpu_bytes:
                warnings.append(f"learner and engine do not fit together on a stage-{fit.stage} GPU during "
                                f"{phase}: {used / GIB:.1f} of {c.gpu_memory_gib:.0f} GiB (dapo-mega plan's "
                                "colocated lines); lower rollout.mem_fraction_static or micro_batch_tokens, "
                                "or raise TP/PP")
    groups = weight_update_groups_per_engine_gpu(cfg)
    outside = (1 - r.mem_fraction_static) * room.free_at_start if c.device != "cpu" else 0.0
    needed = (ENGINE_RUNTIME_GIB + groups * WEIGHT_UPDATE_GROUP_GIB) * GIB if c.device != "cpu" else 0.0
    if outside < needed:
        warnings.append(f"an engine GPU keeps {outside / GIB:.1f} GiB outside SGLang's pool ((1 - "
                        f"rollout.mem_fraction_static {r.mem_fraction_static}) x free memory at start) for CUDA graphs "
                        f"and activations (~{ENGINE_RUNTIME_GIB:.0f} GiB) and {groups} weight-update group(s)' NCCL "
                        f"buffers (~{WEIGHT_UPDATE_GROUP_GIB} GiB each, made after the pool): "
                        f"{needed / GIB:.1f} GiB; the first weight sync would run out of memory. Lower "
                        "rollout.mem_fraction_static")
    return EngineMemory(num_engines=r.num_engines, gpus_per_engine=gpus, kv_room_bytes=max(0.0, engine_room),
                        kv_bytes_per_token=per_token, kv_tokens=kv_tokens,
                        max_full_length_sequences=kv_tokens // seq_tokens if seq_tokens else 0,
                        mem_fraction_static=r.mem_fraction_static, kv_per_gpu_bytes=kv_per_gpu,
                        weights_per_gpu_bytes=room.weights, colocated=colocated, weight_update_groups=groups,
                        outside_pool_bytes=outside, outside_pool_needed_bytes=needed, cpu_pool_cap_tokens=cap)


def _node_layout(cfg: DapoConfig, placement: Placement) -> List[NodeRoles]:
    layout = []
    for node in range(cfg.cluster.num_nodes):
        roles = []
        ranks = [lp.rank for lp in placement.learners if lp.device.node == node]
        if ranks:
            roles.append(f"learner ranks {ranks[0]}-{ranks[-1]}")
        engines = placement.engines_on_node(node)
        if engines:
            roles.append(f"engines {engines[0].index}-{engines[-1].index} (TP {cfg.rollout.engine_tp_size})")
        layout.append(NodeRoles(node=node, roles=roles, engine_gpus={e.index: list(e.gpu_ids) for e in engines}))
    return layout


def format_plan(plan: Plan, sections: Sequence[str] = ()) -> str:
    """The plan as a fixed-width table; `sections` (e.g. the clock of `dapo_mega.plan.clock`) are
    printed before the warnings."""
    p, mdl, cl = plan.parallel, plan.model, plan.cluster
    moe = (f" ({plan.active_params / 1e9:.2f} B active: {mdl.shape.num_experts_per_tok} of "
           f"{mdl.shape.num_experts} experts per token)" if mdl.shape.is_moe else "")
    lines = [f"model {mdl.name} ({mdl.source}): {plan.total_params / 1e9:.2f} B params{moe}, "
             f"{mdl.shape.num_layers} layers, hidden {mdl.shape.hidden_size}",
             f"cluster {cl.mode}: {cl.num_nodes} nodes x {cl.gpus_per_node} GPUs ({cl.gpu_memory_gib:.0f} GiB)",
             f"learners: TP {p.tp} PP {p.pp} CP {p.cp} DP {p.dp} (world {p.world_size}), "
             f"SP {p.sequence_parallel}, recompute {p.recompute}, fp8 {p.fp8}", ""]
    lines += _memory_lines(plan)
    eff = plan.learner_efficiency
    assumed, conf, base = eff.assumption, eff.configured, eff.padded_contiguous
    lines += ["", f"learner efficiency, one mini-batch of {assumed.samples} samples (assumed: responses "
              f"log-normal, median {assumed.response_median:,}, sigma {assumed.response_sigma}, prompts "
              f"{assumed.prompt_tokens}; mean {assumed.mean_length:,.0f}, max {assumed.max_length:,} tokens)",
              f"  configured (packing {conf.sequence_packing}{' THD' if conf.thd else ''}, balanced DP "
              f"{conf.balance_data_parallel}, token multiple {conf.token_multiple}): padding efficiency "
              f"{conf.padding_efficiency:.2%}, DP imbalance {conf.dp_imbalance:.3f}, "
              f"<= {conf.max_micro_batches} micro-batches per rank",
              f"  padded, contiguous DP blocks: padding efficiency {base.padding_efficiency:.2%}, "
              f"DP imbalance {base.dp_imbalance:.3f}, <= {base.max_micro_batches} micro-batches per rank",
              "", "layout:"]
    lines += [f"  node {n.node:>3}: " + "; ".join(n.roles) for n in plan.layout]
    groups = plan.sync.groups
    if plan.sync.transport == "cuda_ipc":
        lines += [f"weight sync: CUDA IPC hand-over on each GPU ({len(groups)} engines, each fed by the learner "
                  "ranks on its GPUs; no NCCL group with an engine)"]
    else:
        lines += [f"weight sync: {plan.sync.transport}; " + ", ".join(
            f"{g.name} (source rank {g.learner_ranks[0]} + {g.world_size - 1} engine ranks)" for g in groups)]
    for section in sections:
        lines += ["", section]
    lines += [""] + [f"WARNING: {w}" for w in plan.warnings] if plan.warnings else ["", "no warnings"]
    return "\n".join(lines)


def _memory_lines(plan: Plan) -> List[str]:
    """The memory part of `format_plan`: learner stages, engines, one colocated GPU, checkpoints,
    conversion."""
    mem, eng, gpu = plan.learner_memory, plan.engines, plan.cluster.gpu_memory_gib
    lines = ["stage  params/GPU   params   grads    optim   fp8 w.  layers  recomp.  logits    total  (GiB)"]
    for st in mem.stages:
        lines.append(f"{st.stage:>5}  {st.params / 1e9:8.3f}B  " + "  ".join(
            f"{b / GIB:6.2f}" for b in (st.param_bytes, st.grad_bytes, st.optimizer_bytes, st.fp8_cache_bytes,
                                        st.activation_kept_bytes, st.recompute_bytes, st.logits_bytes,
                                        st.total_bytes)))
    factor = mem.per_layer_activation_s_h_over_t
    lines.append(f"  activations ({mem.layer_spec} spec, {mem.activation_element_bytes} bytes per element): "
                 f"{mem.stages[0].per_layer_activation_bytes / GIB:.3f} GiB per layer and micro-batch"
                 + (f" = {factor:.1f}*s*h/t" if factor else "") + "; layers = kept over the micro-batches in flight, "
                 "total = state + fp8 w. + layers + max(recomp., logits)")
    lines += ["", f"engines: {eng.num_engines} x {eng.gpus_per_engine} GPUs, KV room "
              f"{eng.kv_room_bytes / GIB:.1f} GiB per engine = {eng.kv_tokens:,} tokens "
              f"= {eng.max_full_length_sequences} full-length sequences (SGLang: mem_fraction_static "
              f"{eng.mem_fraction_static} x free memory at start - {eng.weights_per_gpu_bytes / GIB:.1f} GiB "
              "weights, per GPU)"]
    if eng.cpu_pool_cap_tokens:
        lines.append(f"  on a CPU each SGLang engine's pool is capped at {eng.cpu_pool_cap_tokens:,} tokens "
                     f"= {eng.cpu_pool_cap_tokens * eng.kv_bytes_per_token / 2**20:,.1f} MiB of host memory + "
                     f"{eng.weights_per_gpu_bytes * eng.gpus_per_engine / 2**20:,.1f} MiB of weights (--max-total-tokens: "
                     f"rollout.extra_server_args' value, else max_running_requests x (max_prompt_length + "
                     f"max_response_length) x {CPU_KV_MARGIN})")
    if eng.outside_pool_needed_bytes:
        lines.append(f"  outside the pool, per engine GPU: {eng.outside_pool_bytes / GIB:.1f} GiB for graphs and "
                     f"activations ~{ENGINE_RUNTIME_GIB:.0f} + {eng.weight_update_groups} weight-update group(s) x "
                     f"~{WEIGHT_UPDATE_GROUP_GIB} GiB of NCCL buffers = {eng.outside_pool_needed_bytes / GIB:.1f} GiB")
    for fit in eng.colocated:
        lines.append(f"  colocated stage-{fit.stage} GPU, rollout: learner {fit.learner_resident / GIB:.1f} + "
                     f"CUDA contexts {fit.contexts / GIB:.1f} + engine weights {fit.engine_weights / GIB:.1f} + "
                     f"KV {max(0.0, fit.kv_fresh) / GIB:.1f} (first job; {fit.kv_resumed / GIB:.1f} resumed) + "
                     f"graphs {fit.engine_runtime / GIB:.1f} + sync buckets {fit.sync_buffers / GIB:.1f} = "
                     f"{fit.rollout_bytes / GIB:.1f} of {gpu:.0f} GiB; "
                     "training: "
                     f"{fit.training_bytes / GIB:.1f} of {gpu:.0f} GiB")
    lines += hand_over_lines(plan.hand_over, plan.parallel.dp)
    lines.append(f"weight sync: {plan.weight_sync.gib_per_step:.1f} GiB per step "
                 f"(>= {plan.weight_sync.seconds_at_400gbps:.2f} s from one 400 Gb/s NIC)")
    ck, conv = plan.checkpoint, plan.conversion_host_ram
    lines += [f"checkpoints: {ck.bytes / 1e9:,.1f} GB each (model {ck.model_bytes / 1e9:,.1f} + fp32 optimizer "
              f"{ck.optimizer_bytes / 1e9:,.1f}); keep_last_k {ck.keep_last_k} + the one being written"
              + (f" + {ck.kept_for_good} kept by keep_every" if ck.kept_for_good else "")
              + (f" + {ck.hf_export_keep} HF exports of {ck.hf_export_bytes / 1e9:,.1f} GB"
                 if ck.hf_export_bytes else "") + f": {ck.disk_peak_bytes / 1e12:,.2f} TB on disk",
              "conversion host RAM (the shard once in bf16 + up to two copies of the embedding + 0.4 GB, "
              "per process): "
              f"import/export --tp {conv.import_export.tp}"
              + (f" --ep {conv.import_export.ep}" if conv.import_export.ep > 1 else "")
              + f" {conv.import_export.total_bytes / 1e9:,.0f} GB "
              f"({conv.import_export.per_process_bytes / 1e9:,.1f} per process), verify --tp 1 "
              f"{conv.verify.total_bytes / 1e9:,.0f} GB (in fp32, its default; --compute stored: "
              f"{conv.verify_stored.total_bytes / 1e9:,.0f} GB, judged on next-token KL)"]
    return lines
