"""The records `dapo_mega.plan.memory` hands out: a `Plan` of typed sections, each number named with its unit.

`compute_plan` builds a `Plan`; `format_plan` prints it; `Plan.to_dict()` is its JSON
(`dapo-mega plan --json`, the launcher's plan.json), keyed by the field names below.
The formulas behind each number are in `dapo_mega.plan.memory`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from dapo_mega.models.shape import ModelShape


# ---------------------------------------------------------------------- model, cluster, layout
@dataclass(frozen=True)
class ModelSummary:
    """The model the plan is for and where its shape was read."""

    name: str
    """model.name."""
    source: str
    """Where the shape came from: "hf_config" (model.hf_path), "table" (KNOWN_MODELS) or "tiny"."""
    shape: ModelShape


@dataclass(frozen=True)
class ClusterSummary:
    """The cluster.* shape the plan lays the run out on."""

    mode: str
    """colocated or disaggregated."""
    num_nodes: int
    gpus_per_node: int
    learner_nodes: int
    engine_nodes: int
    gpu_memory_gib: float
    """Memory of one GPU (GiB)."""


@dataclass(frozen=True)
class LearnerParallel:
    """The learner's parallel layout as configured, with the DP it leaves."""

    tp: int
    pp: int
    cp: int
    dp: int
    """Learner GPUs / (tp·pp·cp), at least 1."""
    world_size: int
    """Learner GPUs."""
    sequence_parallel: bool
    recompute: Optional[str]
    """megatron.recompute_granularity (None, "selective" or "full")."""
    distributed_optimizer: bool
    fp8: bool


@dataclass(frozen=True)
class NodeRoles:
    """What runs on one node."""

    node: int
    roles: List[str]
    """e.g. "learner ranks 0-7", "engines 0-1 (TP 4)"."""
    engine_gpus: Dict[int, List[int]]
    """Engine index -> the node's GPU ids it uses."""


@dataclass(frozen=True)
class SyncGroup:
    """One process group the weight sync forms (`backends.placement.ProcessGroupPlan`)."""

    name: str
    kind: str
    """weight_update (NCCL/gloo broadcast into engines) or ipc_handover (CUDA IPC gather)."""
    stage: int
    """Pipeline stage whose weights travel through it (-1: every stage)."""
    world_size: int
    learner_ranks: List[int]
    """The learner ranks among its members (the first is the source of a broadcast)."""


@dataclass(frozen=True)
class SyncTopology:
    """How the weights reach the engines."""

    transport: str
    """cuda_ipc, shared_memory or distributed (`backends.placement`)."""
    groups: List[SyncGroup]


# ---------------------------------------------------------------------- learner memory
@dataclass(frozen=True)
class LogitsPeak:
    """What the last stage holds for the logits of one micro-batch (bytes; `plan.logits_peak_bytes`)."""

    logits: float
    """The output layer's [n, V/t] logits in the model dtype."""
    fp32_chunk: float
    """One fp32 [chunk, V/t] block of `ChunkedVocabParallelLogProbs`."""
    forward: float
    """Logits + 3 fp32 chunks."""
    backward: float
    """Logits + their gradient + two fp32 chunks (+ one cast with bf16 logits)."""
    peak: float
    """max(forward, backward) + the per-token fp32 log p, logsumexp and entropy."""


@dataclass(frozen=True)
class StageActivations:
    """Activation memory of one pipeline stage for the learner's step (bytes; `plan.stage_activation_bytes`)."""

    per_layer: float
    """What one layer keeps for backward for one micro-batch."""
    kept: float
    """Kept over the micro-batches in flight (+ the final norm's tensors on the last stage)."""
    recompute: float
    """The layers being recomputed, one at a time."""
    workspace: float
    """Temporaries of one layer's backward."""
    logits: float
    """The last stage's logits peak (0 elsewhere)."""
    peak: float
    """kept + max(recompute + workspace, logits)."""


@dataclass(frozen=True)
class StageMemory:
    """Memory of one learner GPU of one pipeline stage (bytes; `plan.learner_stages`)."""

    stage: int
    params: int
    """Φ_s: parameters this GPU holds."""
    param_bytes: float
    """The params in their dtype."""
    grad_bytes: float
    """fp32 main grads."""
    optimizer_bytes: float
    """fp32 master params, Adam m and v (only m and v with fp32 params); under the distributed
    optimizer this GPU's DP share."""
    model_state_bytes: float
    """param + grad + optimizer."""
    fp8_cache_bytes: float
    """Transformer Engine's FP8 weight copies and transposes."""
    per_layer_activation_bytes: float
    """What one layer keeps for backward for one micro-batch."""
    activation_kept_bytes: float
    recompute_bytes: float
    """Recomputed layers + backward temporaries."""
    logits_bytes: float
    activation_bytes: float
    """The activation peak: kept + max(recompute, logits)."""
    total_bytes: float
    """model state + FP8 caches + activation peak."""


@dataclass(frozen=True)
class LearnerMemory:
    """Memory of the learner's GPUs, stage by stage."""

    stages: List[StageMemory]
    worst_stage: int
    """The stage with the largest total."""
    worst_total_gib: float
    layer_spec: str
    """transformer_engine or local."""
    activation_element_bytes: int
    """2 (bf16) or 4 (fp32)."""
    per_layer_activation_s_h_over_t: Optional[float]
    """One layer's activations in units of s·h/t (with sequence parallelism; else None)."""


# ---------------------------------------------------------------------- engines, sync, disk, RAM
@dataclass(frozen=True)
class KvRoom:
    """SGLang's KV budget on one engine GPU (bytes; `plan.engine_kv_room`)."""

    free_at_start: float
    """Free memory B when the engine starts."""
    weights: float
    """The engine's weights on this GPU (2·Φ / engine TP)."""
    contexts: float
    """CUDA contexts on the GPU (the engine's, and colocated the learner's)."""
    kv: float
    """f·B − weights (negative: no room)."""


@dataclass(frozen=True)
class ColocatedFit:
    """One colocated GPU of a learner stage beside its engine, in both phases (bytes; `plan.colocated_fit`)."""

    stage: int
    kv_fresh: float
    """The engine's KV pool on a fresh run (sized before Adam state and FP8 caches exist)."""
    kv_resumed: float
    """The KV pool on a resumed run (the learner's whole model state resident)."""
    learner_resident: float
    """Learner model state + FP8 caches during rollout."""
    engine_weights: float
    contexts: float
    engine_runtime: float
    """SGLang's CUDA graphs and activations."""
    sync_buffers: float
    """Two weight-sync buckets."""
    rollout_bytes: float
    """The GPU during rollout (the fresh run's pool)."""
    training_bytes: float
    """The GPU during training: the learner's total + the contexts."""


@dataclass(frozen=True)
class EngineMemory:
    """KV room of the engines and, colocated, the fit of each learner stage's GPU."""

    num_engines: int
    gpus_per_engine: int
    kv_room_bytes: float
    """KV pool of one engine (all its GPUs)."""
    kv_bytes_per_token: int
    """K and V of every layer for one token, whole engine."""
    kv_tokens: int
    """Tokens the pool holds."""
    max_full_length_sequences: int
    """kv_tokens // (max_prompt_length + max_response_length)."""
    mem_fraction_static: float
    kv_per_gpu_bytes: float
    weights_per_gpu_bytes: float
    colocated: List[ColocatedFit]
    """One per learner stage; empty when disaggregated."""
    weight_update_groups: int = 0
    """NCCL weight-update communicators each engine GPU joins (one per learner PP stage,
    disaggregated on GPUs; none colocated: the hand-over uses no group)."""
    outside_pool_bytes: float = 0.0
    """What one engine GPU keeps outside its static pool, (1 − mem_fraction_static)·B: CUDA
    graphs, activations and the weight-update groups' NCCL buffers, all made after the pool."""
    outside_pool_needed_bytes: float = 0.0
    """ENGINE_RUNTIME_GIB + weight_update_groups × WEIGHT_UPDATE_GROUP_GIB."""
    cpu_pool_cap_tokens: int = 0
    """SGLang on a CPU: the pool's cap, `--max-total-tokens` (`engines.sglang.commands.cpu_kv_tokens`
    of max_running_requests and the longest request); 0 where mem_fraction_static sizes it."""


@dataclass(frozen=True)
class WeightSync:
    """What one weight sync moves to every engine."""

    bytes_per_step: int
    """2·Φ (bf16)."""
    gib_per_step: float
    seconds_at_400gbps: float
    """The lower bound through one 400 Gb/s NIC."""


@dataclass(frozen=True)
class CheckpointDisk:
    """Disk of one training checkpoint and of the run's kept ones (bytes; `plan.checkpoint_bytes`)."""

    model_bytes: float
    """The model in its dtype."""
    optimizer_bytes: float
    """fp32 optimizer state."""
    bytes: float
    """One checkpoint: model + optimizer."""
    keep_last_k: int
    hf_export_bytes: float
    """One HF export (0: the run exports none)."""
    hf_export_keep: int
    """HF exports kept (0 when none are written)."""
    kept_for_good: int
    """Checkpoints `trainer.keep_every` keeps beside the newest keep_last_k (`plan.checkpoints_kept_for_good`)."""
    disk_peak_bytes: float
    """(keep_last_k + 1 + kept_for_good) checkpoints + the kept exports."""


@dataclass(frozen=True)
class ConversionRam:
    """Host RAM of one `tools/convert_checkpoint.py` run at `--tp tp` (bytes; `plan.conversion_host_ram_bytes`)."""

    tp: int
    per_process_bytes: float
    total_bytes: float
    """Over the conversion's processes (tp; a mixture's --ep may add data-parallel copies)."""
    ep: int = 1


@dataclass(frozen=True)
class ConversionHostRam:
    """Host RAM of the conversion commands for this model."""

    import_export: ConversionRam
    """import / export at the learner's TP."""
    verify: ConversionRam
    """verify (TP 1) as it runs by default: both models in fp32 (`weights/verify.py`), one at a time."""
    verify_stored: ConversionRam
    """verify --compute stored (TP 1): in the checkpoint's bf16, judged on next-token distributions."""


# ---------------------------------------------------------------------- learner efficiency
@dataclass(frozen=True)
class AssumedBatch:
    """The mini-batch the efficiency figures are measured on (`plan.LengthAssumption`, resolved and drawn)."""

    response_median: int
    """Tokens."""
    response_sigma: float
    prompt_tokens: int
    samples: int
    mean_length: float
    """Mean prompt + response tokens of the drawn samples."""
    max_length: int


@dataclass(frozen=True)
class LayoutEfficiency:
    """Tokens the learner computes for the mini-batch under one layout (`packing.LayoutStats`, per-rank lists summarised)."""

    useful_tokens: int
    computed_tokens: int
    """Rows × columns of every micro-batch, padding included."""
    padding_efficiency: float
    """useful / computed."""
    dp_imbalance: float
    """Tokens of the busiest DP rank / the mean."""
    max_micro_batches: int
    """Micro-batches of the rank with the most."""


@dataclass(frozen=True)
class ConfiguredLayout(LayoutEfficiency):
    """The layout as configured: its efficiency and the settings that produce it."""

    sequence_packing: bool
    balance_data_parallel: bool
    token_multiple: int
    """Every packed sequence's length rounds up to a multiple of this (SP, FP8)."""
    thd: bool
    """One packed THD row per micro-batch (Transformer Engine with packing)."""


@dataclass(frozen=True)
class LearnerEfficiency:
    """Padding efficiency and DP imbalance of one mini-batch, as configured and without packing or balancing."""

    assumption: AssumedBatch
    configured: ConfiguredLayout
    padded_contiguous: LayoutEfficiency
    """No packing, contiguous DP blocks: the baseline."""


# ---------------------------------------------------------------------- what the driver hands over
@dataclass(frozen=True)
class HandOver:
    """What the driver hands the learner ranks each step, in bytes (`plan.hand_over`), at the
    assumed mean lengths unless named "max": the samples every rank receives (pickled, over gloo,
    on the host) and, for a mixture, the routed-expert reports each DP rank receives of its own
    samples (one packed integer shard, on the host; a micro-batch's reach the GPU one router at a
    time). Nothing of it goes through a GPU on the way."""

    samples_per_step: int
    mean_positions: float
    """Fed positions of a sample (prompt + response - 1): what a report covers."""
    max_positions: int
    sample_pickle_bytes: float
    """The step's samples as pickled for the broadcast (ids, engine log-probs, masks): on every rank."""
    reporting_samples: float
    """Samples whose engines report experts: all with routing replay, one request in
    checks.router_agreement_every otherwise, none for a dense model."""
    expert_id_bytes: int
    """1 up to 256 experts, 2 beyond (`expert_shards.expert_id_dtype`)."""
    report_bytes_per_position: int
    """num_layers x top_k x expert_id_bytes."""
    reports_bytes: float
    """The step's reports, packed: what the driver hands over in all."""
    reports_base64_bytes: float
    """The same as the samples carry them (base64): what a pickled broadcast of the samples with
    their reports would copy to every rank (through the GPU under NCCL)."""
    shard_bytes: float
    """One DP rank's share, on the host of each of its ranks."""
    shard_max_bytes: float
    """... when its samples are all of the longest length."""
    driver_bytes: float
    """The driver's host memory for it: the reports as the samples carry them and one shard packed."""
    device_bytes_per_router: float
    """GPU bytes, one sparse layer at a time in a micro-batch: the engine's experts [tokens, k]
    int64, which tokens are known and their ages, the router's fp32 logits again and its own top-k
    (`routing.RouterWatch`)."""


# ---------------------------------------------------------------------- the plan
BLOCKING_WARNINGS = (r"^learner does not fit", r"^learner and engine do not fit", r"^engines have no KV-cache room",
                     r"engines x \d+ GPUs need", r"^placement: ", r"^clock: ", r"not divisible by tp\*pp\*cp",
                     r"do not split over TP", r"layers do not split evenly")
"""The plan's warnings that stop (or silently break) the run: a launcher refuses to submit on
these; the others (idle GPUs, TP across nodes, uneven data-parallel ranks) are advice."""


def blocking_warnings(warnings: List[str], engines_take_gpus: bool = True) -> List[str]:
    """The warnings among `warnings` that a run cannot start with (`BLOCKING_WARNINGS`); on CPU
    engines (`engines_take_gpus` False) the engines' GPU count is no limit."""
    patterns = [p for p in BLOCKING_WARNINGS if engines_take_gpus or "GPUs need" not in p]
    return [w for w in warnings if any(re.search(p, w) for p in patterns)]


@dataclass(frozen=True)
class Plan:
    """Layout, memory, learner efficiency and warnings of a config on its cluster shape (`plan.compute_plan`)."""

    model: ModelSummary
    total_params: int
    """Φ."""
    active_params: int
    """Parameters one token computes with (a MoE's routed experts counted top-k of them; Φ when dense)."""
    cluster: ClusterSummary
    parallel: LearnerParallel
    learner_memory: LearnerMemory
    engines: EngineMemory
    weight_sync: WeightSync
    checkpoint: CheckpointDisk
    conversion_host_ram: ConversionHostRam
    learner_efficiency: LearnerEfficiency
    layout: List[NodeRoles]
    """One per node."""
    warnings: List[str]
    """Problems of the layout, the memory and (added by the command) the clock."""
    sync: SyncTopology
    hand_over: HandOver
    """What the driver hands the learner ranks each step (samples, a mixture's routed experts)."""

    @property
    def blocking(self) -> List[str]:
        """The warnings the run cannot start with (`blocking_warnings`)."""
        return blocking_warnings(self.warnings)

    def to_dict(self) -> Dict[str, Any]:
        """The plan as plain JSON-ready values; the model's shape fields sit beside its name and source."""
        out = asdict(self)
        out["model"].update(out["model"].pop("shape"))
        out["blocking"] = self.blocking
        return out
