"""The run's clock: how long its phases take, estimated from the config, beside the timeouts.

    dapo-mega plan +experiment=dapo_qwen2.5_32b                       prints it (with the plan)
    dapo-mega plan +experiment=dapo_qwen2.5_32b clock.learner_mfu=0.3  with another assumption

Every estimate is a pure function of the config, the model's size (`dapo_mega.plan.memory`), the
response lengths (`plan.LengthAssumption`, the same distribution the plan's learner figures
use) and throughput assumptions (`ClockAssumptions`), each formula written in its docstring.
`clock_warnings` names each timeout of the config that is shorter than what it bounds, and
`resolve_health_timeout_s` is the engine start bound the fleet waits for when
`rollout.health_timeout_s` is 0.

Calibration. The defaults describe H100 GPUs and reproduce NeMo-RL's published GRPO step of
Qwen3-32B, 376-393 s on 32 H100 (v0.4 performance summary: 393 s for 2,048 responses,
average sequence 3,206 tokens under a 4,096 cap, generation TP 4 = 8 engines, training TP 4
/ PP 4): 8 reference engines decoding 4,000 tokens/s each generate the 6.2 M response tokens
in ~195 s; the 2,048 x 3.2k tokens train in ~175 s at 40% MFU (10 passes of 2 FLOPs per
parameter per token: forward + backward, full recompute, the log-prob pass); the weights
sync in ~7 s (a 13.3 GB/s link at the measured 0.75 of it): 378 s in all (`tests/plan/test_clock.py` checks it against the published range). A
run on other GPUs, or with measured rates, sets the assumptions (`clock.<field>=<value>`);
`dapo-mega train` logs the measured `time/*_s` of every phase to compare with.

Symbols: E engines, c prompts per request, G samples per prompt, L̄ the mean response length
and p the prompt length (tokens), R / s / F an engine's full-batch decode, per-sequence decode
and prefill rates (tokens/s), Φ the model's parameters.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from dapo_mega.config import ConfigError, DapoConfig, EngineKind
from dapo_mega.node import node_cpus
from dapo_mega.plan.memory import (
    LengthAssumption,
    compute_plan,
    learner_data_parallel,
    resolve_model_shape,
    total_params,
)
from dapo_mega.plan.types import Plan
from dapo_mega.rollout.settings import tool_slots

GB = 1e9
GIB = 1024 ** 3

REFERENCE_PARAMS = 32_763_876_352
"""Parameters of the reference engine's model: Qwen2.5-32B (`plan.total_params`; Qwen3-32B: 32.8 B)."""
REFERENCE_ENGINE_GPUS = 4
"""GPUs of the reference engine (SGLang / vLLM TP 4 on H100, as in NeMo-RL's Qwen3-32B run)."""
REFERENCE_DECODE = 4000.0
"""R of the reference engine (tokens/s at full batch): NeMo-RL's 6.2 M response tokens on 8
engines in ~195 s of its 393-s step."""
REFERENCE_SEQUENCE = 50.0
"""s of the reference engine (tokens/s of one sequence): 20,480 tokens in ~410 s, the slow end
of 52-102 tokens/s (200-390 s per full-length answer) for one 32B engine at TP 4 on H100s."""
REFERENCE_PREFILL = 20000.0
"""F of the reference engine (prompt tokens/s): 2Φ FLOPs per token on 4 H100 at a third of peak."""


@dataclass
class ClockAssumptions:
    """Throughput assumptions of the clock. Set any with `clock.<field>=<value>` on the
    `dapo-mega plan` command line; the engine rates left at null follow the engine's size."""

    decode_tokens_per_s_engine: Optional[float] = None
    """R: tokens/s one engine decodes with all its sequence slots busy (its full batch).
    Null: REFERENCE_DECODE (4,000: a 32.8B model on 4 H100, calibrated on NeMo-RL) x engine_scale."""
    decode_tokens_per_s_sequence: Optional[float] = None
    """s: tokens/s of one sequence once the engine has admitted it (a long answer spends most
    of its life in a batch that thins out as the short ones finish). Null: REFERENCE_SEQUENCE
    (50: 20,480 tokens in ~410 s) x engine_scale."""
    prefill_tokens_per_s_engine: Optional[float] = None
    """F: prompt tokens/s one engine prefills (compute bound). Null: REFERENCE_PREFILL (20,000)
    x engine_scale."""
    learner_tokens_per_s_per_gpu: Optional[float] = None
    """Tokens (prompt + response) one learner GPU trains per second in a rollout step, every
    pass included. Null: from the model's FLOPs at learner_mfu (`train_flops_per_step`)."""
    learner_mfu: float = 0.4
    """Model FLOPs utilisation of the learners (of gpu_peak_tflops), when
    learner_tokens_per_s_per_gpu is null."""
    gpu_peak_tflops: float = 989.0
    """Dense bf16 peak of one GPU (H100 SXM: 989 TFLOP/s). FP8 learners are not credited with
    more: the estimate stays on the long side."""
    weight_sync_link_gb_per_s: float = 13.3
    """GB/s a raw broadcast of the weights' bytes reaches from a learner to every engine (2
    bytes per parameter): published syncs of ~30B models take 2-7 s for ~65 GB; with the
    measured efficiency below this sits at their slow end (10 GB/s of sync) and keeps the
    calibration's step."""
    weight_sync_efficiency: float = 0.75
    """The share of that rate a weight sync reaches: measured by bench/bench_weight_sync.py,
    0.71-0.79 of a raw broadcast of the same bytes in the same buckets (two engines, CPU;
    bench/README.md). The sync's estimate is link x efficiency."""
    storage_read_gb_per_s: float = 10.0
    """GB/s the shared file system gives this job in all, split among every loader of the
    model at the same time (`estimate_engine_start_s`)."""
    engine_init_s: float = 60.0
    """Seconds an engine spends starting besides reading weights (imports, NCCL, tokenizer)."""
    cuda_graph_capture_s: float = 60.0
    """Seconds SGLang captures CUDA graphs for (batch sizes up to its max running requests);
    0 for the embedded CPU engine."""
    start_timeout_factor: float = 3.0
    """The derived engine start timeout is this many estimated starts (shared storage is
    shared with other jobs too)..."""
    start_timeout_floor_s: float = 300.0
    """... and never less than this."""
    eval_problems: Optional[int] = None
    """Problems of the held-out set. Null: data.synthetic_num_eval for the synthetic task,
    else 30 (AIME 2024); eval.max_problems > 0 caps it."""
    conversion_gb_per_s_per_rank: float = 0.03
    """GB/s of model bytes one rank of a conversion on the CPU (import, export, verify's load)
    maps and writes, besides reading them from storage, on a core of its own (launch/pipeline.py
    gives a conversion stage --cpus-per-task = tp·pp). Measured on a loaded 2-core x86
    machine: a 0.57 GB checkpoint imports in 35 s, exports in 33 s at TP 1, of which the
    start-up (a tiny model: 14-21 s) is counted in stage_overhead_s."""
    cpu_tflops: float = 0.1
    """FLOP rate of `verify`'s two forwards on the CPU (one process)."""
    stage_overhead_s: float = 600.0
    """Seconds every launch pipeline stage spends besides its work (start-up, imports, the
    container), and the least time limit a stage gets."""
    stage_time_factor: float = 2.0
    """A pipeline stage's time limit is stage_overhead_s + this many times its estimated work."""
    training_time_spare: float = 1.25
    """A training link's time limit when the launcher is given none: stage_overhead_s + an
    engine start + this many times its share of the run's steps (rounds beyond the first,
    evaluations, a restart)."""
    checkpoint_write_gb_per_s: float = 2.0
    """GB/s the learners write one training checkpoint at, all ranks together (model +
    optimizer: `plan.checkpoint_bytes`, ~460 GB for 32B); the slow end of a shared file system."""
    stop_signal_spare: float = 1.5
    """The training jobs' stop signal (`--signal=B:USR1@lead`, `stop_signal_lead_s`) comes this
    many times (a step, its evaluation when the run evaluates, and a checkpoint save) before
    the time limit: a second round of dynamic sampling, a slow save."""
    tool_calls_per_sample: Optional[float] = None
    """With an environment (rollout.environment): the tool calls of one sample, on average.
    Null: (rollout.max_turns - 1) / 2, half the turns the budget allows after the first."""
    tool_call_s: float = 1.0
    """Seconds one tool call takes (the python tool: a sandboxed interpreter's start, ~0.1-0.3 s
    on a server CPU, and the model's code); each call waits for its slot on the driver."""
    lengths: LengthAssumption = field(default_factory=LengthAssumption)
    """Response and prompt lengths (`dapo_mega.plan.memory.LengthAssumption`, shared with the plan's
    learner-efficiency figures): log-normal, median max_response_length / 8, σ 1."""


@dataclass
class EngineRates:
    """The rates an engine of this config is assumed to reach (tokens/s)."""

    decode: float
    """R: full-batch decode of one engine."""
    sequence: float
    """s: decode of one admitted sequence."""
    prefill: float
    """F: prefill of one engine."""
    scale: float
    """engine_scale (1 for the reference engine; `engine_rates`)."""


@dataclass
class GenerationEstimate:
    """One generation phase (a rollout round or an evaluation) over the engines."""

    prompts: int
    samples_per_prompt: int
    max_response_length: int
    engines_used: int
    """min(E, requests): engines that get a request."""
    requests: int
    """ceil(prompts / c'), with c' = chunk_size(prompts, E, prompts_per_request) (the manager's)."""
    samples_per_request: int
    """m = c' · G."""
    samples_per_engine: int
    """N_e = ceil(requests / engines_used) · m."""
    in_flight_per_engine: int
    """Q = min(requests per engine, requests_per_engine) · m: samples an engine holds at once."""
    slots_per_engine: int
    """S: sequences one engine decodes at once (`engine_slots`)."""
    engine_tokens_per_s: float
    """R' = min(R, min(Q, S) · s): an engine with fewer sequences than slots runs below R."""
    mean_response: float
    """L̄ (tokens)."""
    longest_response: float
    """L_m: the longest of a request's m responses (`LengthAssumption.longest_of`)."""
    throughput_s: float
    """T_tp = N_e · L̄ / R' + N_e · p / F: an engine's share of the work."""
    admission_wait_s: float
    """W = max(0, Q − S) · L̄ / R': a request's wait for free slots."""
    slowest_request_s: float
    """T_req = W + m · p / F + L_m / s: admission, prefill, then its longest answer."""
    last_dispatch_s: float
    """T_ld = max(0, T_tp − Q · L̄ / R'): when an engine is handed its last request."""
    duration_s: float
    """T = max(T_tp, T_ld + T_req, T_tool): the engines' share, the last request's end, or the tools'."""
    tool_calls_per_sample: float = 0.0
    """k: tool calls of one sample (multi-turn samples; 0 without an environment)."""
    tool_wait_s: float = 0.0
    """k · t: what one sample waits for its tools, turn after turn (in T_req)."""
    tool_throughput_s: float = 0.0
    """T_tool = N · k · t / slots: every sample's tool calls, `slots` (the environment's
    max_concurrent) at a time on the driver, N the phase's samples."""


@dataclass
class ClockEstimate:
    """The clock of one config (every duration in seconds); `clock_warnings` reads it."""

    assumptions: ClockAssumptions
    rates: EngineRates
    params: int
    """Φ."""
    rollout_round: GenerationEstimate
    """One dynamic-sampling round: gen_batch_size prompts x n samples."""
    evaluation: GenerationEstimate
    """One evaluation: eval problems x eval.n_samples."""
    train_tokens: float
    """Tokens of one rollout step's training batch: train_batch_size · G · (p + L̄)."""
    train_flops: float
    """FLOPs of that batch (`train_flops_per_step`)."""
    learner_gpus: int
    train_step_s: float
    weight_sync_bytes: float
    weight_sync_s: float
    engine_start_readers: int
    """Loaders of the model at once (`engine_start_readers`)."""
    engine_capture_s: float
    """CUDA graph capture of one engine (0 for the embedded engine)."""
    engine_start_s: float
    engine_start_timeout_s: float
    """The derived bound (`engine_start_timeout_s`), used when rollout.health_timeout_s = 0."""
    health_timeout_s: float
    """The bound in force (`resolve_health_timeout_s`)."""
    driver_gap_s: float
    """Longest expected gap between two progress events of the driver (`driver_gap_s`)."""
    step_s: float
    """One rollout step with one round: rollout_round + train_step + weight_sync (+ an
    evaluation every eval_interval steps, not included)."""
    stage_limits_s: Dict[str, float] = field(default_factory=dict)
    """Time limit of each one-node stage of launch/pipeline.py (data, import, verify, export,
    eval), from its estimated work (`estimate_stage_limits_s`)."""
    checkpoint_save_s: float = 0.0
    """One training checkpoint written (`plan.checkpoint_bytes` / checkpoint_write_gb_per_s)."""
    stop_signal_lead_s: float = 0.0
    """How long before a training job's time limit its stop signal must come for the learners
    to finish their step and save (`stop_signal_lead_s`)."""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------ the estimates (pure)
def engine_scale(params: float, engine_gpus: int) -> float:
    """How an engine's rates compare with the reference engine's: decode and prefill are bound
    by bytes moved and FLOPs per token, both ∝ Φ, over the engine's GPUs:

        engine_scale = (engine GPUs / 4) · (32.76e9 / Φ)
    """
    return (engine_gpus / REFERENCE_ENGINE_GPUS) * (REFERENCE_PARAMS / max(1.0, float(params)))


def engine_rates(a: ClockAssumptions, params: float, engine_gpus: int) -> EngineRates:
    """R, s, F: the assumptions' rates, or the reference engine's (REFERENCE_DECODE, _SEQUENCE,
    _PREFILL) times `engine_scale` where they are null."""
    k = engine_scale(params, engine_gpus)
    return EngineRates(decode=a.decode_tokens_per_s_engine or REFERENCE_DECODE * k,
                       sequence=a.decode_tokens_per_s_sequence or REFERENCE_SEQUENCE * k,
                       prefill=a.prefill_tokens_per_s_engine or REFERENCE_PREFILL * k, scale=k)


def engine_slots(max_running_requests: int, kv_tokens: int, sequence_tokens: float) -> int:
    """S = min(max_running_requests, ⌊kv_tokens / (p + L̄)⌋), at least 1: an engine decodes as
    many sequences as its KV cache holds at their mean full length (SGLang admits more while
    they are short and retracts them when the cache fills)."""
    return max(1, min(max_running_requests, int(kv_tokens // max(1.0, sequence_tokens))))


def estimate_generation(prompts: int, samples_per_prompt: int, max_response_length: int, *, num_engines: int,
                        prompts_per_request: int, requests_per_engine: int, slots_per_engine: int,
                        rates: EngineRates, lengths: LengthAssumption, tool_calls: float = 0.0,
                        tool_call_s: float = 0.0, tool_slots: int = 1) -> GenerationEstimate:
    """A generation phase of `prompts` x `samples_per_prompt` samples over `num_engines` engines,
    dispatched the way `rollout.manager` dispatches (chunks, least-loaded engines, at most
    requests_per_engine requests in flight each). Formulas: the fields of GenerationEstimate.
    `lengths` must be resolved (`LengthAssumption.resolved`). Multi-turn samples: `tool_calls`
    per sample of `tool_call_s` each, `tool_slots` at a time (rollout/turns.py); a sample's turns
    continue on its engine, whose prefix cache holds the context, so no prefill is counted again."""
    from dapo_mega.rollout.manager import chunk_size

    chunk = chunk_size(prompts, num_engines, prompts_per_request)
    requests = math.ceil(max(0, prompts) / chunk)
    if requests == 0:  # nothing to generate (an empty held-out set)
        return GenerationEstimate(0, samples_per_prompt, max_response_length, 0, 0, 0, 0, 0, slots_per_engine,
                                  rates.decode, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    used = max(1, min(num_engines, requests))
    per_engine = math.ceil(requests / used)
    m = chunk * samples_per_prompt
    in_flight = min(per_engine, requests_per_engine) * m
    rate = min(rates.decode, min(in_flight, slots_per_engine) * rates.sequence)
    mean = lengths.response_moment(1, max_response_length)
    longest = lengths.longest_of(m, max_response_length)
    p = int(lengths.prompt_tokens)
    n_e = per_engine * m
    throughput = n_e * mean / rate + n_e * p / rates.prefill
    wait = max(0, in_flight - slots_per_engine) * mean / rate
    tool_wait = tool_calls * tool_call_s
    slowest = wait + m * p / rates.prefill + longest / rates.sequence + tool_wait
    last_dispatch = max(0.0, throughput - in_flight * mean / rate)
    tools = prompts * samples_per_prompt * tool_wait / max(1, tool_slots)
    return GenerationEstimate(prompts=prompts, samples_per_prompt=samples_per_prompt,
                              max_response_length=max_response_length, engines_used=used, requests=requests,
                              samples_per_request=m, samples_per_engine=n_e, in_flight_per_engine=in_flight,
                              slots_per_engine=slots_per_engine, engine_tokens_per_s=rate, mean_response=mean,
                              longest_response=longest, throughput_s=throughput, admission_wait_s=wait,
                              slowest_request_s=slowest, last_dispatch_s=last_dispatch,
                              duration_s=max(throughput, last_dispatch + slowest, tools),
                              tool_calls_per_sample=tool_calls, tool_wait_s=tool_wait, tool_throughput_s=tools)


def tool_load(cfg: DapoConfig, a: ClockAssumptions) -> Dict[str, float]:
    """The tool figures of `estimate_generation` for `cfg`: none without an environment; else
    tool_calls_per_sample (null: (max_turns - 1) / 2), tool_call_s, and the environment's
    `max_concurrent` as its slots (`rollout.settings.tool_slots`: the threads the rollout's tool
    executor has)."""
    r = cfg.rollout
    if not r.environment:
        return {}
    calls = a.tool_calls_per_sample if a.tool_calls_per_sample is not None else (r.max_turns - 1) / 2
    return {"tool_calls": float(calls), "tool_call_s": float(a.tool_call_s),
            "tool_slots": tool_slots(r.environment_kwargs)}


def train_flops_per_step(samples: int, lengths: LengthAssumption, max_response_length: int, params: float,
                         num_layers: int, attention_width: int, passes: int) -> float:
    """FLOPs of training N = `samples` samples (prompt p + response X each):

        passes · (2Φ · N · E[s] + 2 · layers · (heads · head_dim) · N · E[s²]),  s = p + X

    2 FLOPs per parameter per token (the embedding lookup counted too: 2.4% of the 32B), plus
    causal attention, 2 · (heads · head_dim) · s FLOPs per token and layer on average; passes
    of the forward's cost: 3 for forward + backward, +1 with full recompute, +1 for the
    learner's log-prob pass (unless algo.use_engine_logprobs). E[s²] = p² + 2p·E[X] + E[X²]."""
    p = float(lengths.prompt_tokens)
    mean_x, mean_x2 = lengths.response_moment(1, max_response_length), lengths.response_moment(2, max_response_length)
    tokens = samples * (p + mean_x)
    square = samples * (p * p + 2 * p * mean_x + mean_x2)
    return passes * (2 * params * tokens + 2 * num_layers * attention_width * square)


def learner_passes(recompute_full: bool, engine_logprobs: bool) -> int:
    """Forward-equivalent passes per trained token: 3 (forward + backward) + 1 (full
    recompute) + 1 (log-prob pass of the policy that sampled, recomputed on the learner)."""
    return 3 + (1 if recompute_full else 0) + (0 if engine_logprobs else 1)


def estimate_train_step_s(train_flops: float, train_tokens: float, learner_gpus: int, a: ClockAssumptions) -> float:
    """One rollout step's training: tokens / (GPUs · learner_tokens_per_s_per_gpu) when that is
    set, else FLOPs / (GPUs · gpu_peak_tflops · 1e12 · learner_mfu)."""
    if a.learner_tokens_per_s_per_gpu:
        return train_tokens / (learner_gpus * a.learner_tokens_per_s_per_gpu)
    return train_flops / (learner_gpus * a.gpu_peak_tflops * 1e12 * a.learner_mfu)


def estimate_weight_sync_s(params: float, a: ClockAssumptions) -> float:
    """2Φ bytes (bf16) / (weight_sync_link_gb_per_s · weight_sync_efficiency · 1e9)."""
    return 2 * params / (a.weight_sync_link_gb_per_s * a.weight_sync_efficiency * GB)


def estimate_engine_start_s(model_bytes: float, readers: int, a: ClockAssumptions, capture_s: float) -> float:
    """engine_init_s + model bytes / (storage_read_gb_per_s · 1e9 / readers) + capture_s (the
    CUDA graphs; 0 for the embedded engine): each of `readers` loaders reads the whole model
    from the shared file system at the same time."""
    return a.engine_init_s + model_bytes / (a.storage_read_gb_per_s * GB / max(1, readers)) + capture_s


def engine_start_readers(cfg: DapoConfig, data_parallel: int) -> int:
    """Loaders of the model at engine start: every engine; disaggregated, also the learners'
    data-parallel replicas, which load at the same time (colocated jobs start the engines
    after the learners are initialised)."""
    return cfg.rollout.num_engines + (data_parallel if cfg.cluster.mode == "disaggregated" else 0)


def derive_start_timeout_s(start_s: float, a: ClockAssumptions) -> float:
    """max(start_timeout_floor_s, start_timeout_factor · engine start)."""
    return max(a.start_timeout_floor_s, a.start_timeout_factor * start_s)


def driver_gap_s(rollout_round: GenerationEstimate, evaluation: Optional[GenerationEstimate]) -> float:
    """The longest expected wait between two progress events of the driver (a request
    finished): the slowest request of a round or of an evaluation (None: the run evaluates
    never), which is what is left when few requests are in flight (an evaluation of 30
    problems, the end of a round)."""
    return max(rollout_round.slowest_request_s, evaluation.slowest_request_s if evaluation else 0.0)


def eval_problems(cfg: DapoConfig, a: ClockAssumptions) -> int:
    """The held-out set's size (ClockAssumptions.eval_problems), capped by eval.max_problems."""
    n = a.eval_problems or (cfg.data.synthetic_num_eval if not cfg.data.train_path else 30)
    return min(n, cfg.eval.max_problems) if cfg.eval.max_problems > 0 else n


# ------------------------------------------------------------------ the whole clock
def _resolved(cfg: DapoConfig, a: ClockAssumptions) -> LengthAssumption:
    return a.lengths.resolved(cfg.algo.max_prompt_length, cfg.algo.max_response_length)


def _engine_start(cfg: DapoConfig, a: ClockAssumptions, data_parallel: int, params: float) -> tuple:
    """(readers, capture seconds, estimated start) of this config's engines."""
    readers = engine_start_readers(cfg, data_parallel)
    capture = a.cuda_graph_capture_s if cfg.rollout.backend == EngineKind.SGLANG else 0.0
    return readers, capture, estimate_engine_start_s(2 * params, readers, a, capture)


def engine_start_timeout_s(cfg: DapoConfig, assumptions: Optional[ClockAssumptions] = None) -> float:
    """The derived bound on one engine's start (used when rollout.health_timeout_s = 0):
    `derive_start_timeout_s` of `estimate_engine_start_s` for 2Φ bytes and every loader.
    An engine start reads it: the model's size and the learners' DP, not the whole plan."""
    a = assumptions or ClockAssumptions()
    params = total_params(resolve_model_shape(cfg)[0])
    return derive_start_timeout_s(_engine_start(cfg, a, learner_data_parallel(cfg), params)[2], a)


def resolve_health_timeout_s(cfg: DapoConfig) -> float:
    """rollout.health_timeout_s when > 0, else `engine_start_timeout_s(cfg)`: what the fleet
    (and the ranks waiting for its engines) wait for an engine's first healthy answer."""
    return float(cfg.rollout.health_timeout_s) if cfg.rollout.health_timeout_s > 0 else engine_start_timeout_s(cfg)


def estimate_clock(cfg: DapoConfig, assumptions: Optional[ClockAssumptions] = None,
                   plan: Optional[Plan] = None) -> ClockEstimate:
    """Every estimate of `cfg` under `assumptions`; `plan` is `compute_plan(cfg, lengths)` when
    the caller has it (the KV cache of an engine, the learner layout)."""
    a = assumptions or ClockAssumptions()
    plan = plan or compute_plan(cfg, a.lengths)
    algo, r = cfg.algo, cfg.rollout
    lengths = _resolved(cfg, a)
    shape, _ = resolve_model_shape(cfg)
    params = total_params(shape)
    rates = engine_rates(a, params, r.engine_tp_size * r.engine_dp_size)
    p = int(lengths.prompt_tokens)
    mean = lengths.response_moment(1, algo.max_response_length)
    slots = engine_slots(r.max_running_requests, plan.engines.kv_tokens, p + mean)
    common = dict(num_engines=r.num_engines, prompts_per_request=r.prompts_per_request,
                  requests_per_engine=r.requests_per_engine, slots_per_engine=slots, rates=rates,
                  **tool_load(cfg, a))
    rollout_round = estimate_generation(algo.gen_batch_size, algo.n_samples_per_prompt, algo.max_response_length,
                                        lengths=lengths, **common)
    eval_length = cfg.eval.max_response_length or algo.max_response_length
    eval_lengths = a.lengths.resolved(algo.max_prompt_length, eval_length)
    evaluation = estimate_generation(eval_problems(cfg, a), cfg.eval.n_samples, eval_length, lengths=eval_lengths,
                                     **common)

    samples = algo.train_batch_size * algo.n_samples_per_prompt
    passes = learner_passes(cfg.megatron.recompute_granularity == "full", algo.use_engine_logprobs)
    flops = train_flops_per_step(samples, lengths, algo.max_response_length, params, shape.num_layers,
                                 shape.num_attention_heads * shape.head_dim, passes)
    tokens = samples * (p + mean)
    learner_gpus = plan.parallel.world_size
    train_s = estimate_train_step_s(flops, tokens, learner_gpus, a)
    sync_s = estimate_weight_sync_s(params, a)
    readers, capture_s, start_s = _engine_start(cfg, a, plan.parallel.dp, params)
    derived = derive_start_timeout_s(start_s, a)
    save_s = plan.checkpoint.bytes / (a.checkpoint_write_gb_per_s * GB)
    return ClockEstimate(assumptions=a, rates=rates, params=params, rollout_round=rollout_round,
                         evaluation=evaluation, train_tokens=tokens, train_flops=flops, learner_gpus=learner_gpus,
                         train_step_s=train_s,
                         weight_sync_bytes=2.0 * params, weight_sync_s=sync_s, engine_start_readers=readers,
                         engine_capture_s=capture_s, engine_start_s=start_s, engine_start_timeout_s=derived,
                         health_timeout_s=float(r.health_timeout_s) if r.health_timeout_s > 0 else derived,
                         driver_gap_s=driver_gap_s(rollout_round,
                                                   evaluation if cfg.trainer.eval_interval > 0 else None),
                         step_s=rollout_round.duration_s + train_s + sync_s,
                         stage_limits_s=estimate_stage_limits_s(cfg, a, params, rates, common, eval_lengths),
                         checkpoint_save_s=save_s,
                         stop_signal_lead_s=stop_signal_lead_s(rollout_round.duration_s + train_s + sync_s,
                                                               evaluation.duration_s if cfg.trainer.eval_interval > 0
                                                               else 0.0, save_s, a))


# ------------------------------------------------------------------ the launch pipeline's stages
def stage_limit_s(work_s: float, a: ClockAssumptions) -> float:
    """A pipeline stage's time limit: stage_overhead_s + stage_time_factor · its work."""
    return a.stage_overhead_s + a.stage_time_factor * work_s


def estimate_conversion_s(model_bytes: float, ranks: int, a: ClockAssumptions) -> float:
    """import / export on the CPU at `ranks` = tp·pp ranks, each converting its share:
    model bytes / storage_read_gb_per_s + model bytes / (ranks · conversion_gb_per_s_per_rank)."""
    return model_bytes / (a.storage_read_gb_per_s * GB) + model_bytes / (max(1, ranks) * a.conversion_gb_per_s_per_rank * GB)


def estimate_verify_s(model_bytes: float, params: float, tokens: int, a: ClockAssumptions) -> float:
    """verify on the CPU (one rank, the tool's default --tp 1): the Megatron checkpoint loaded
    (`estimate_conversion_s`), the HF model read (model bytes / storage_read_gb_per_s), and a
    forward of each over `tokens` tokens, in fp32 (verify's default): 2 · 2Φ · tokens / cpu_tflops."""
    forwards = 2 * 2 * params * tokens / (a.cpu_tflops * 1e12)
    return estimate_conversion_s(model_bytes, 1, a) + model_bytes / (a.storage_read_gb_per_s * GB) + forwards


def eval_stage_engines(cfg: DapoConfig) -> int:
    """Engines of the pipeline's final evaluation (one node): as many as the node's GPUs hold
    (`placement.engines_fitting_node`), rollout.num_engines on a CPU run."""
    from dapo_mega.backends.placement import engines_fitting_node

    if cfg.cluster.device == "cpu":
        return cfg.rollout.num_engines
    return engines_fitting_node(cfg.rollout, cfg.cluster.gpus_per_node)


VERIFY_TOKENS = 4 * 100
"""Tokens of `convert_checkpoint.py verify`'s default forward: `weights.verify.PROBE_ROWS` (4)
worked problems in the model's chat template, each cut to the shortest (SmolLM2's: 77-121
tokens; a longer system prompt makes more)."""


def estimate_stage_limits_s(cfg: DapoConfig, a: ClockAssumptions, params: float, rates: EngineRates,
                            common: Dict[str, Any], eval_lengths: LengthAssumption) -> Dict[str, float]:
    """`stage_limit_s` of each one-node stage of launch/pipeline.py: data (its start-up only),
    import and export (`estimate_conversion_s`), verify (`estimate_verify_s`), eval (its
    engines' start, each reading the model, + the held-out set's generation on
    `eval_stage_engines` engines). `common`: estimate_generation's engine arguments."""
    model_bytes = 2.0 * params
    ranks = cfg.megatron.tensor_model_parallel_size * cfg.megatron.pipeline_model_parallel_size
    engines = eval_stage_engines(cfg)
    eval_length = cfg.eval.max_response_length or cfg.algo.max_response_length
    evaluation = estimate_generation(eval_problems(cfg, a), cfg.eval.n_samples, eval_length, lengths=eval_lengths,
                                     **{**common, "num_engines": engines})
    capture = a.cuda_graph_capture_s if cfg.rollout.backend == EngineKind.SGLANG else 0.0
    work = {"data": 0.0, "import": estimate_conversion_s(model_bytes, ranks, a),
            "verify": estimate_verify_s(model_bytes, params, VERIFY_TOKENS, a),
            "export": estimate_conversion_s(model_bytes, ranks, a),
            "eval": estimate_engine_start_s(model_bytes, engines, a, capture) + evaluation.duration_s}
    return {stage: stage_limit_s(seconds, a) for stage, seconds in work.items()}


STOP_SIGNAL_FLOOR_S = 600.0
"""The least stop-signal lead: slurm/*.sbatch's own `#SBATCH --signal=B:USR1@600` (jobs
submitted by hand)."""
STOP_SIGNAL_MAX_S = 65535.0
"""Slurm's largest --signal lead (its field is 16 bits)."""


def stop_signal_lead_s(step_s: float, evaluation_s: float, save_s: float, a: ClockAssumptions) -> float:
    """Seconds before a training job's time limit its stop signal must arrive: the learners
    finish the step in progress (its evaluation too, when the run evaluates) and save a
    checkpoint, times stop_signal_spare; never less than STOP_SIGNAL_FLOOR_S."""
    return max(STOP_SIGNAL_FLOOR_S, a.stop_signal_spare * (step_s + evaluation_s + save_s))


def training_link_limit_s(clock: Dict[str, Any], total_steps: int, chain: int) -> float:
    """A training link's time limit when the launcher is given none, from the clock's dict
    (`ClockEstimate.to_dict`, as `dapo-mega plan --json` prints it): stage_overhead_s + an
    engine start + training_time_spare · its share of the run's steps (total_steps / chain) · step_s
    + the stop signal's lead (`stop_signal_lead_s`: the learners stop that long before the limit,
    so without it a link would train its share short by the lead, and the chain would end short)."""
    a = clock["assumptions"]
    steps = math.ceil(total_steps / max(1, chain))
    return (a["stage_overhead_s"] + clock["engine_start_s"] + a["training_time_spare"] * steps * clock["step_s"]
            + (clock.get("stop_signal_lead_s") or 0.0))


# ------------------------------------------------------------------ warnings and the table
def clock_warnings(cfg: DapoConfig, estimates: ClockEstimate) -> List[str]:
    """Every timeout of `cfg` shorter than the estimated work it bounds, naming the field,
    the estimate and the fix: request_timeout_s (when set) against the slowest request,
    health_timeout_s (when set) against an engine's start, dist_timeout_s against a whole
    training step (one collective waits at most that long: on the safe side) and a weight
    sync, driver_stall_timeout_s against the longest gap between the driver's progress
    events, liveness_timeout_s against a weight sync, wall_time_minutes against a start and
    one step."""
    r, c, e = cfg.rollout, cfg.cluster, estimates
    warnings: List[str] = []
    slowest = max(e.rollout_round, e.evaluation, key=lambda g: g.slowest_request_s)
    if 0 < r.request_timeout_s < slowest.slowest_request_s:
        warnings.append(f"rollout.request_timeout_s={r.request_timeout_s:g} s is shorter than the slowest request "
                        f"(~{slowest.slowest_request_s:,.0f} s: {_request_words(slowest)}): its engine would be "
                        "marked dead mid-answer; set 0 (liveness decides) or more than "
                        f"{2 * slowest.slowest_request_s:,.0f} s")
    if 0 < r.health_timeout_s < e.engine_start_s:
        warnings.append(f"rollout.health_timeout_s={r.health_timeout_s:g} s is shorter than an engine's start "
                        f"(~{e.engine_start_s:,.0f} s: {_start_words(e)}); set 0 (derived: "
                        f"{e.engine_start_timeout_s:,.0f} s)")
    for what, seconds in (("a training step", e.train_step_s), ("a weight sync", e.weight_sync_s)):
        if c.dist_timeout_s < seconds:
            warnings.append(f"cluster.dist_timeout_s={c.dist_timeout_s:g} s is shorter than {what} "
                            f"(~{seconds:,.0f} s); raise it above {2 * seconds:,.0f} s")
    if c.driver_stall_timeout_s < e.driver_gap_s:
        warnings.append(f"cluster.driver_stall_timeout_s={c.driver_stall_timeout_s:g} s is shorter than the "
                        f"longest wait between two finished requests (~{e.driver_gap_s:,.0f} s, the slowest "
                        f"request): waiting learner ranks would stop a healthy run; raise it above "
                        f"{2 * e.driver_gap_s:,.0f} s")
    if r.liveness_timeout_s < e.weight_sync_s:
        warnings.append(f"rollout.liveness_timeout_s={r.liveness_timeout_s:g} s is shorter than a weight sync "
                        f"(~{e.weight_sync_s:,.0f} s)")
    ro = e.rollout_round
    if ro.tool_throughput_s > max(ro.throughput_s, ro.last_dispatch_s + ro.slowest_request_s):
        slots = tool_load(cfg, e.assumptions)["tool_slots"]
        warnings.append(f"the tools bound a rollout round (~{ro.tool_throughput_s:,.0f} s of tool calls, "
                        f"{slots} at a time on the driver, against ~{ro.throughput_s:,.0f} s of decoding): the engines "
                        f"wait for the sandbox; raise rollout.environment_kwargs.max_concurrent above "
                        f"{math.ceil(slots * ro.tool_throughput_s / max(1.0, ro.throughput_s))}, within the driver "
                        f"node's cores ({node_cpus()} where this plan runs: dapo_mega/node.py)")
    wall = cfg.trainer.wall_time_minutes * 60
    if 0 < wall < e.health_timeout_s + e.step_s:
        warnings.append(f"trainer.wall_time_minutes={cfg.trainer.wall_time_minutes:g} leaves no room for one step "
                        f"(engine start ~{e.engine_start_s:,.0f} s + a step ~{e.step_s:,.0f} s)")
    return warnings


def _request_words(g: GenerationEstimate) -> str:
    wait = f"~{g.admission_wait_s:,.0f} s waiting for a slot, then " if g.admission_wait_s >= 1 else ""
    return (f"{g.samples_per_request // g.samples_per_prompt} prompts x {g.samples_per_prompt} samples: {wait}its "
            f"longest answer (~{g.longest_response:,.0f} tokens)")


def _start_words(e: ClockEstimate) -> str:
    a = e.assumptions
    return (f"{e.weight_sync_bytes / GB:,.1f} GB x {e.engine_start_readers} loaders over {a.storage_read_gb_per_s:g} "
            f"GB/s of shared storage + {a.engine_init_s:g} s init + {e.engine_capture_s:g} s CUDA graphs")


def _engines(n: int) -> str:
    return f"{n} engine" + ("s" if n != 1 else "")


def _s(seconds: float) -> str:
    return f"{seconds:,.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def format_clock(cfg: DapoConfig, estimates: ClockEstimate) -> str:
    """The clock as a table: each phase's estimate beside the timeout that bounds it (and
    under it, what it is made of), then the assumptions."""
    r, c, e, algo = cfg.rollout, cfg.cluster, estimates, cfg.algo
    ro, ev, a, rates = e.rollout_round, e.evaluation, e.assumptions, e.rates
    stall = f"cluster.driver_stall_timeout_s={c.driver_stall_timeout_s:g} s"
    request = (f"rollout.request_timeout_s={r.request_timeout_s:g} s" if r.request_timeout_s > 0 else
               "rollout.request_timeout_s=0 (none: liveness decides)")
    health = (f"rollout.health_timeout_s={r.health_timeout_s:g} s" if r.health_timeout_s > 0 else
              f"rollout.health_timeout_s=0: derived {e.engine_start_timeout_s:,.0f} s "
              f"({a.start_timeout_factor:g} x the estimate)")
    dist = f"cluster.dist_timeout_s={c.dist_timeout_s:g} s"
    rows = [
        ("rollout round", ro.duration_s, f"no time limit: progress ({stall} between finished requests)",
         f"{ro.prompts} prompts x {ro.samples_per_prompt} = {ro.prompts * ro.samples_per_prompt:,} samples on "
         f"{_engines(ro.engines_used)}, {ro.in_flight_per_engine} in flight per engine"),
        *([("tools of a round", ro.tool_throughput_s, "the environment's slots on the driver "
             f"(rollout.environment_kwargs.max_concurrent={tool_load(cfg, a)['tool_slots']})",
             f"{ro.tool_calls_per_sample:g} calls per sample x {a.tool_call_s:g} s (clock.tool_calls_per_sample, "
             f"clock.tool_call_s); one sample waits {_s(ro.tool_wait_s)} for its tools")] if r.environment else []),
        ("slowest request", ro.slowest_request_s, f"{request}; a hung engine: rollout.liveness_timeout_s="
         f"{r.liveness_timeout_s:g} s without a probe answer",
         f"{_request_words(ro)} at {rates.sequence:,.0f} tokens/s"),
        ("longest gap between finished requests", e.driver_gap_s, stall,
         "the slowest request (round or evaluation), when few are in flight"),
        ("evaluation", ev.duration_s, f"no time limit: progress ({stall})",
         f"{ev.prompts} problems x {ev.samples_per_prompt} = {ev.prompts * ev.samples_per_prompt:,} samples on "
         f"{_engines(ev.engines_used)}; its slowest request {_s(ev.slowest_request_s)}"),
        ("training step", e.train_step_s, f"{dist} (one collective)",
         f"{algo.train_batch_size * algo.n_samples_per_prompt:,} samples, {e.train_tokens / 1e6:,.1f} M tokens"),
        ("weight sync", e.weight_sync_s, dist,
         f"{e.weight_sync_bytes / GIB:,.1f} GiB at {a.weight_sync_link_gb_per_s:g} GB/s x "
         f"{a.weight_sync_efficiency:g} (measured share of a raw broadcast)"),
        ("engine start", e.engine_start_s, health, _start_words(e)),
        ("one step: round + training + sync", e.step_s,
         f"up to algo.max_num_gen_batches={algo.max_num_gen_batches} rounds" if algo.dynamic_sampling else "", ""),
        ("checkpoint save", e.checkpoint_save_s, f"the stop signal, {_s(e.stop_signal_lead_s)} before a training "
         "job's time limit (launch/pipeline.py --signal)",
         f"at {a.checkpoint_write_gb_per_s:g} GB/s; the lead is {a.stop_signal_spare:g} x (a step, its evaluation, "
         "a save)"),
    ]
    width = max(len(row[0]) for row in rows)
    lines = [f"clock (estimates, assumptions below){' ' * max(0, width - 34)}  {'estimate':>9}  bounded by"]
    for what, seconds, bound, detail in rows:
        lines.append(f"  {what:<{width}}  {_s(seconds):>9}  {bound}".rstrip())
        if detail:
            lines.append(f"      {detail}")
    lengths = _resolved(cfg, a)
    learner = (f"{a.learner_tokens_per_s_per_gpu:,.0f} tokens/s per GPU" if a.learner_tokens_per_s_per_gpu else
               f"MFU {a.learner_mfu:g} of {a.gpu_peak_tflops:g} TFLOP/s x {e.learner_gpus} GPUs, "
               f"{e.train_flops / e.train_tokens / e.params:.1f} x Φ FLOPs per token")
    if e.stage_limits_s:
        lines.append("  launch/pipeline.py stage time limits: " + ", ".join(
            f"{stage} {_s(seconds)}" for stage, seconds in e.stage_limits_s.items()))
    lines += ["assumptions (set one with clock.<field>=<value>; `dapo-mega plan --help` lists them):",
              f"  engine: decode {rates.decode:,.0f} tokens/s at full batch, {rates.sequence:,.0f} tokens/s per "
              f"sequence, prefill {rates.prefill:,.0f} tokens/s (x{rates.scale:.3g} of the 32.8B TP-4 H100 "
              "reference where not set)",
              f"  engine slots: {ro.slots_per_engine} sequences (max_running_requests {r.max_running_requests}, "
              f"or the KV cache over {lengths.prompt_tokens + ro.mean_response:,.0f} tokens per sample)",
              f"  learner: {learner}",
              f"  lengths: responses log-normal, median {lengths.response_median:,}, sigma {lengths.response_sigma:g}, "
              f"capped at {algo.max_response_length:,} (mean {ro.mean_response:,.0f}); prompts "
              f"{lengths.prompt_tokens} tokens; {ev.prompts} eval problems",
              f"  storage {a.storage_read_gb_per_s:g} GB/s shared; weight sync {a.weight_sync_link_gb_per_s:g} GB/s "
              f"x {a.weight_sync_efficiency:g}"]
    if cfg.cluster.device == "cpu" or cfg.rollout.backend == EngineKind.EMBEDDED:
        lines.append("  (a CPU run: these are GPU figures; the CPU lane's clock is measured by its tests)")
    return "\n".join(lines)


def assumptions_from_overrides(overrides: Sequence[str]) -> ClockAssumptions:
    """ClockAssumptions from `clock.<field>=<value>` arguments (`clock.lengths.response_median=4096`
    too), type-checked; ConfigError names a bad one."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    dotlist = [item[len("clock."):] for item in overrides]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ClockAssumptions), OmegaConf.from_dotlist(dotlist))
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"clock.{getattr(exc, 'full_key', '') or ''}: {exc}. Fix: see `dapo-mega plan --help` "
                          "for the clock.* fields") from exc
    assert isinstance(obj, ClockAssumptions)
    return obj
