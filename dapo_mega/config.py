"""Typed configuration for dapo-mega.

Every component owns a small dataclass; `DapoConfig` composes them. The dataclasses are
registered with Hydra's ConfigStore as the schema of `configs/config.yaml`, so YAML groups
under `configs/` and command-line overrides are type-checked against them. Each field is
documented by the docstring-style comment under it (`dapo-mega train --help` prints them).

Each config checks its own rules in `validate()`; `validate_config` composes them once and
adds the rules that span components (and the world size when known). They run before any
process group, model or engine is created (`dapo_mega.plan.preflight` adds the model's shape and
the data files), and every error names the field and the fix.

Fields that take one of a few values are typed `str`: OmegaConf 2.3 (Hydra's structured
configs) rejects `Literal[...]` annotations ("Unexpected type annotation"). Their value sets
are the `Literal` aliases below, which `validate()` checks (`_check_choice`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, get_args


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the field and the fix."""


LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
GroupFilterMetric = Literal["acc", "score"]
Verifier = Literal["dapo", "math_verify"]  # the built-in names; algo.verifier also takes a plugin's module:function
OnNonfinite = Literal["skip", "stop"]
OffPolicyCorrection = Literal["none", "tis", "mis", "geo_mask", "icepop", "geo_mask_tis"]
PromptTemplate = Literal["dapo", "raw"]
OnBadRow = Literal["error", "skip"]
ToolMessage = Literal["text", "chat"]
TurnReward = Literal["sum", "mean", "last", "max", "min"]
SyntheticTask = Literal["arithmetic", "chain", "sum", "sum_tool", "calc_tools"]
RolloutBackend = Literal["embedded", "sglang"]


class EngineKind(str, Enum):
    """What serves the rollouts (rollout.backend): the embedded engine (this project's
    SGLang-compatible server, CPU) or SGLang. The code compares the kind with these, never
    with strings; a str, so the config's value is one."""

    EMBEDDED = "embedded"
    SGLANG = "sglang"


assert {k.value for k in EngineKind} == set(get_args(RolloutBackend))
EngineDtype = Literal["auto", "float32", "bfloat16", "float16"]
HFExportDtype = Literal["bfloat16", "float32", "float16"]
Fp8Format = Literal["e4m3", "hybrid"]
Fp8Recipe = Literal["delayed", "tensorwise", "blockwise"]
ParamsDtype = Literal["auto", "float32", "bf16", "fp16"]
TransformerImpl = Literal["auto", "local", "transformer_engine"]
RecomputeGranularity = Literal["full", "selective"]
OptimizerSharding = Literal["dp_reshardable", "fully_reshardable"]
ClusterMode = Literal["colocated", "disaggregated"]
EvalOverlap = Literal["auto", "beside", "inline"]
Device = Literal["auto", "cpu", "cuda"]
WandbMode = Literal["offline", "online", "disabled"]
LedgerTextMode = Literal["full", "head_tail", "none"]
TinyArchitecture = Literal["qwen2", "qwen3", "llama", "qwen3_moe"]


@dataclass
class ModelConfig:
    name: str = "tiny-qwen2"
    """Human-readable model name, recorded in metrics and checkpoints."""
    hf_path: str = ""
    """Directory of a Hugging Face checkpoint (config.json, tokenizer, safetensors).
    Empty: build the tiny synthetic Qwen2 model below into `<run_dir>/base_model`."""
    megatron_path: str = ""
    """Megatron distributed checkpoint to start from (made by `convert_checkpoint.py
    import`). Empty: initialise from `hf_path` weights, or randomly for the tiny model."""
    # --- the tiny synthetic model (used only when hf_path is empty) ---
    tiny_hidden_size: int = 64
    """Hidden size of the tiny model."""
    tiny_num_layers: int = 2
    """Transformer layers of the tiny model."""
    tiny_num_attention_heads: int = 4
    """Query heads of the tiny model."""
    tiny_num_key_value_heads: int = 2
    """Key/value heads (GQA groups) of the tiny model."""
    tiny_intermediate_size: int = 256
    """SwiGLU FFN size of the tiny model."""
    tiny_tie_word_embeddings: bool = False
    """Tie input and output embeddings in the tiny model."""
    tiny_max_position_embeddings: int = 256
    """Context length of the tiny model."""
    tiny_architecture: str = "qwen2"
    """The tiny model's architecture: qwen2, qwen3, llama or qwen3_moe (8 experts, 2 per token,
    its first layer dense: `models/tiny.py` TINY_MOE)."""
    tiny_chat_template: bool = False
    """Give the tiny model's tokenizer Qwen's ChatML chat template (`models/tiny.py` CHATML_TEMPLATE),
    for recipes that render prompts with it (data.apply_chat_template: the twins of the Qwen recipes).
    Its markers are plain text to the character vocabulary."""
    tiny_moe_dense_layers: Optional[List[int]] = None
    """qwen3_moe only: the layers with a dense MLP (its `mlp_only_layers`); None: TINY_MOE's [0].
    [] makes every layer sparse, as Qwen3-30B-A3B and what SGLang 0.5.23 serves (the MoE twin)."""

    def validate(self) -> None:
        """The tiny model's shape (a real model's is checked against its config.json by `preflight`)."""
        if self.hf_path:
            return
        _check_choice("model.tiny_architecture", self.tiny_architecture, TinyArchitecture)
        for name in ("tiny_hidden_size", "tiny_num_layers", "tiny_num_attention_heads", "tiny_num_key_value_heads",
                     "tiny_intermediate_size", "tiny_max_position_embeddings"):
            if getattr(self, name) < 1:
                raise _field_error(f"model.{name}", f"must be >= 1, got {getattr(self, name)}", "use the default")
        if self.tiny_num_attention_heads % self.tiny_num_key_value_heads:
            raise _field_error("model.tiny_num_key_value_heads",
                               f"{self.tiny_num_key_value_heads} does not divide tiny_num_attention_heads "
                               f"{self.tiny_num_attention_heads}", "pick a divisor (GQA groups)")
        if self.tiny_hidden_size % self.tiny_num_attention_heads:
            raise _field_error("model.tiny_hidden_size", f"{self.tiny_hidden_size} is not a multiple of "
                               f"tiny_num_attention_heads {self.tiny_num_attention_heads}", "e.g. 64 with 4 heads")


@dataclass
class AlgoConfig:
    # --- objective (DAPO paper, Eq. 8 / 10) ---
    clip_ratio_low: float = 0.2
    """ε_low of the decoupled clip: ratios below 1-ε_low are clipped for A<0."""
    clip_ratio_high: float = 0.28
    """ε_high of the decoupled clip (Clip-Higher): ratios above 1+ε_high clipped for A>0."""
    clip_ratio_c: Optional[float] = 10.0
    """Dual-clip constant c for negative advantages (must be > 1); null disables it."""
    loss_agg_mode: str = "token-mean"
    """token-mean (DAPO), seq-mean-token-mean or seq-mean-token-sum (GRPO ablations)."""
    adv_eps: float = 1e-6
    """ε added to the group reward std before dividing."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group std (GRPO/DAPO); false = Dr.GRPO style."""
    off_policy_correction: Optional[str] = None
    """Correction of the engine/learner log-prob mismatch (ρ_t = π_old^learner / π_engine of
    each sampled token; algo/off_policy.py, docs/features.md "Off-policy correction"):
    none | tis (token weight min(ρ_t, tis_cap)) | mis (sequence weight ρ_seq = Π_t ρ_t, the
    sequence masked outside [mis_low, mis_high]) | geo_mask (the sequence masked when its
    geometric-mean ratio leaves [geo_mask_low, geo_mask_high]) | icepop (token weight ρ_t,
    masked outside [icepop_low, icepop_high]) | geo_mask_tis (geo_mask's sequence mask times
    tis's token weight: verl rollout_is=token + rollout_rs=geometric). null = tis when tis_cap is set, else none
    (the settings before this field). Needs engine log-probs and use_engine_logprobs=false."""
    tis_cap: Optional[float] = None
    """C of off_policy_correction=tis and geo_mask_tis: token weights min(ρ_t, C); setting it
    alone selects tis. null otherwise."""
    mis_low: float = 0.5
    """mis: sequences with ρ_seq below this are masked (verl Seq-MIS "0.5_2.0")."""
    mis_high: float = 2.0
    """mis: sequences with ρ_seq above this are masked."""
    geo_mask_low: float = 0.99
    """geo_mask: sequences whose geometric-mean ratio is below this are masked (SkyRL 0.99)."""
    geo_mask_high: float = 1.01
    """geo_mask: sequences whose geometric-mean ratio is above this are masked (SkyRL 1.01)."""
    icepop_low: float = 0.5
    """icepop: tokens with ρ_t below this get weight 0 (IcePop α = 0.5)."""
    icepop_high: float = 5.0
    """icepop: tokens with ρ_t above this get weight 0 (IcePop β = 5)."""
    masked_tokens_in_denominator: bool = True
    """Whether a token the off-policy correction masks (weight 0) keeps its place in the
    token-mean denominator: true (ours, IcePop's 1/|o| as written: the update shrinks by the
    kept fraction), false (verl's rollout_rs and slime: rejected tokens leave the loss mask,
    and the kept tokens' mean is the loss; done exactly by scaling the accumulated gradient by
    all/kept tokens of the mini-batch before clipping). false needs loss_agg_mode=token-mean."""
    use_engine_logprobs: bool = False
    """Take old log-probs from the engine instead of recomputing them on the learner."""
    routing_replay: bool = False
    """A mixture of experts: the learner routes each token to the experts the engine chose for
    it (R3; megatron-core's `moe_enable_routing_replay`), where the engine reported them
    (`return_routed_experts`); tokens without them keep the learner's own routing. Off until
    measured (issue #38); `moe/router_agreement` is logged either way."""
    # --- sampling ---
    n_samples_per_prompt: int = 16
    """G: responses sampled per prompt."""
    train_batch_size: int = 512
    """Prompts (groups) per rollout step that the learner trains on."""
    gen_batch_size: int = 1536
    """Prompts sent to the engines per dynamic-sampling round."""
    mini_batch_size: int = 32
    """Prompts per optimizer update: train_batch_size/mini_batch_size updates per step."""
    shuffle_mini_batches: bool = True
    """Shuffle the groups of a rollout batch (deterministically, seeded by the step) before
    splitting it into mini-batches, so consecutive updates do not see correlated prompts."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and refill the batch (DAPO §3.2)."""
    dynamic_sampling_metric: str = "acc"
    """What a group must vary in to be kept (verl's `algorithm.filter_groups.metric`): "acc",
    the verifier's verdicts (0 < correct < G, the reference recipe: a group all correct whose
    rewards differ only by the overlong penalty is dropped), or "score", the rewards (kept
    unless all G are equal: such a group still has nonzero advantages)."""
    max_num_gen_batches: int = 10
    """Give up after this many dynamic-sampling rounds in one step (0 = no limit)."""
    max_prompt_length: int = 2048
    """Prompts longer than this (tokens) are rejected by the data loader."""
    max_response_length: int = 20480
    """L_max: the engines stop generating here (tokens)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (also applied to learner logits)."""
    top_p: float = 1.0
    """Top-p of training rollouts."""
    top_k: int = -1
    """Top-k of training rollouts (-1 = off)."""
    # --- reward shaping (DAPO §3.4) ---
    overlong_buffer_enable: bool = True
    """Soft overlong punishment (Eq. 13) added to the correctness reward."""
    overlong_buffer_length: int = 4096
    """L_cache of Eq. 13."""
    overlong_penalty_factor: float = 1.0
    """Scale of the overlong penalty."""
    overlong_filter: bool = False
    """Mask the loss of truncated samples (overlong filtering, the paper's other option)."""
    verifier: str = "dapo"
    """Answer verifier: dapo (last 300 chars, `Answer:` line, Minerva), math_verify, a reward
    plugin's import path `package.module:function` or file `path/to/file.py[:function]` (written
    for dapo-mega, verl's compute_score or slime's custom reward; returning a float, a dict with
    `score` or a dapo_mega.reward.RewardResult), or a reward server's URL `http://host:port/path`
    (`slime+http://...` for slime's --rm-url protocol). docs/rewards.md says how each is called.
    A plugin runs in the verifier worker processes, bounded by verifier_timeout_s (a server's
    request too); `dapo-mega train` calls it once on a probe before anything is built."""
    verifier_timeout_s: float = 5.0
    """A verification taking longer than this is scored as failed (verifier_error)."""
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments a reward plugin gets on every call, beside the response (verl's
    `custom_reward_function.reward_kwargs`), e.g. `+algo.reward_kwargs.format_score=0.1`; each
    must be a parameter of the function (or it takes **kwargs). Built-in verifiers take none."""
    # --- optimiser ---
    lr: float = 1e-6
    """AdamW learning rate after warm-up."""
    lr_warmup_steps: int = 20
    """Linear warm-up, in ROLLOUT steps (the DAPO paper: 20), then constant. The scheduler
    converts it to optimizer updates: lr_warmup_steps x train_batch_size / mini_batch_size."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW β1."""
    adam_beta2: float = 0.999
    """AdamW β2."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    on_nonfinite: str = "skip"
    """A NaN/Inf loss or gradient: skip (drop the update, report it) or stop the run."""

    def validate(self) -> None:
        """This component's own rules; ConfigError names the field and the fix."""
        a, err = self, _field_error
        if a.clip_ratio_low < 0 or a.clip_ratio_low >= 1:
            raise err("algo.clip_ratio_low", f"must be in [0, 1), got {a.clip_ratio_low}", "use 0.2 (DAPO)")
        if a.clip_ratio_high < a.clip_ratio_low:
            raise err("algo.clip_ratio_high", f"{a.clip_ratio_high} < algo.clip_ratio_low {a.clip_ratio_low}",
                      "Clip-Higher needs clip_ratio_high >= clip_ratio_low (DAPO: 0.28 vs 0.2)")
        if a.clip_ratio_c is not None and a.clip_ratio_c <= 1.0:
            raise err("algo.clip_ratio_c", f"dual-clip constant must be > 1, got {a.clip_ratio_c}",
                      "use 3..10, or null to disable dual clip")
        _check_choice("algo.loss_agg_mode", a.loss_agg_mode, LossAggMode)
        if a.n_samples_per_prompt < 1:
            raise err("algo.n_samples_per_prompt", "must be >= 1", "use 16 (DAPO)")
        if a.dynamic_sampling and a.n_samples_per_prompt < 2:
            raise err("algo.n_samples_per_prompt", f"is {a.n_samples_per_prompt} with algo.dynamic_sampling on; "
                      "a group of one always has uniform rewards and would always be dropped",
                      "set n_samples_per_prompt >= 2 or algo.dynamic_sampling=false")
        _check_choice("algo.dynamic_sampling_metric", a.dynamic_sampling_metric, GroupFilterMetric)
        if a.train_batch_size < 1:
            raise err("algo.train_batch_size", "must be >= 1", "use 512 (DAPO)")
        if a.mini_batch_size < 1 or a.train_batch_size % a.mini_batch_size:
            raise err("algo.mini_batch_size", f"{a.mini_batch_size} does not divide algo.train_batch_size "
                      f"{a.train_batch_size}", "pick a divisor (DAPO: 512/32 = 16 updates per step)")
        if a.gen_batch_size < 1:
            raise err("algo.gen_batch_size", "must be >= 1", "use 3x train_batch_size (DAPO: 1536)")
        if not a.dynamic_sampling and a.gen_batch_size < a.train_batch_size:
            raise err("algo.gen_batch_size", f"{a.gen_batch_size} < algo.train_batch_size {a.train_batch_size} "
                      "without dynamic sampling", "set gen_batch_size >= train_batch_size")
        if a.max_num_gen_batches < 0:
            raise err("algo.max_num_gen_batches", "must be >= 0", "use 10, or 0 for no limit")
        if a.max_response_length < 1 or a.max_prompt_length < 1:
            raise err("algo.max_response_length", "lengths must be >= 1", "use 20480 / 2048 (DAPO)")
        if a.overlong_buffer_enable and a.max_response_length <= a.overlong_buffer_length:
            raise err("algo.overlong_buffer_length", f"{a.overlong_buffer_length} >= algo.max_response_length "
                      f"{a.max_response_length}; every response would be penalised",
                      "make overlong_buffer_length smaller than max_response_length (DAPO: 4096 of 20480)")
        if a.overlong_buffer_length < 0:
            raise err("algo.overlong_buffer_length", "must be >= 0", "use 4096 (DAPO)")
        if a.temperature <= 0:
            raise err("algo.temperature", "must be > 0 (greedy RL has no exploration)", "use 1.0")
        if not 0 < a.top_p <= 1:
            raise err("algo.top_p", f"must be in (0, 1], got {a.top_p}", "use 1.0")
        a._validate_off_policy_correction()
        if a.reward_kwargs and (a.verifier in get_args(Verifier) or a.verifier.startswith(("http://", "https://",
                                                                                               "slime+http"))):
            raise err("algo.reward_kwargs", f"{sorted(a.reward_kwargs)} given, but algo.verifier={a.verifier} is not a "
                      "reward plugin", "drop algo.reward_kwargs, or point algo.verifier at your reward function")
        if ":" not in a.verifier and not a.verifier.endswith(".py"):  # a plugin's path or a server's URL is
            # imported / reached and probed by preflight (reward.check_verifier)
            _check_choice("algo.verifier", a.verifier, Verifier,
                          "use dapo, math_verify, or a reward plugin's package.module:function (docs/rewards.md)")
        if a.lr <= 0:
            raise err("algo.lr", "must be > 0", "use 1e-6 (DAPO)")
        if a.lr_warmup_steps < 0:
            raise err("algo.lr_warmup_steps", "must be >= 0", "use 20")
        if a.grad_clip < 0:
            raise err("algo.grad_clip", "must be >= 0", "use 1.0 (0 disables clipping)")
        _check_choice("algo.on_nonfinite", a.on_nonfinite, OnNonfinite)

    def correction_mode(self) -> str:
        """The off-policy correction in effect: `off_policy_correction`, or (null) tis when
        `tis_cap` is set, else none."""
        if self.off_policy_correction is not None:
            return self.off_policy_correction
        return "tis" if self.tis_cap is not None else "none"

    def _validate_off_policy_correction(self) -> None:
        a, err = self, _field_error
        if a.off_policy_correction is not None:
            _check_choice("algo.off_policy_correction", a.off_policy_correction, OffPolicyCorrection)
        if a.tis_cap is not None and a.tis_cap <= 0:
            raise err("algo.tis_cap", "must be > 0", "use 2.0, or null to disable")
        mode = a.correction_mode()
        if a.tis_cap is not None and mode not in ("tis", "geo_mask_tis"):
            raise err("algo.tis_cap", f"is {a.tis_cap} but algo.off_policy_correction={mode} does not use it",
                      f"set algo.tis_cap=null to use {mode}, or algo.off_policy_correction=tis")
        if mode in ("tis", "geo_mask_tis") and a.tis_cap is None:
            raise err("algo.off_policy_correction", f"is {mode} but algo.tis_cap is null", "set algo.tis_cap=2.0")
        if not a.masked_tokens_in_denominator and a.loss_agg_mode != "token-mean":
            raise err("algo.masked_tokens_in_denominator", f"is false but algo.loss_agg_mode={a.loss_agg_mode}: "
                      "the masked tokens leave a token-mean denominator only",
                      "set algo.loss_agg_mode=token-mean, or algo.masked_tokens_in_denominator=true")
        if mode != "none" and a.use_engine_logprobs:
            raise err("algo.off_policy_correction", f"is {mode} but algo.use_engine_logprobs=true makes the "
                      "engine's log-probs π_old, so the ratio it corrects is 1 by construction",
                      "set algo.use_engine_logprobs=false, or algo.off_policy_correction=none "
                      "(and algo.tis_cap=null)")
        for name in ("mis", "geo_mask", "icepop"):
            low, high = getattr(a, f"{name}_low"), getattr(a, f"{name}_high")
            if not 0 < low <= 1.0 <= high:
                raise err(f"algo.{name}_low", f"bounds [{low}, {high}] (algo.{name}_low, algo.{name}_high) must "
                          "satisfy 0 < low <= 1 <= high, or samples the engine and learner agree on are masked",
                          f"e.g. [{AlgoConfig.__dataclass_fields__[name + '_low'].default}, "
                          f"{AlgoConfig.__dataclass_fields__[name + '_high'].default}]")


@dataclass
class DataConfig:
    train_path: str = ""
    """Training prompts: a .parquet (DAPO-Math-17k schema) or .jsonl file.
    Empty: the synthetic arithmetic task."""
    eval_path: str = ""
    """Held-out prompts (AIME 2024 schema); empty: a synthetic held-out split."""
    prompt_template: str = "dapo"
    """How a problem becomes a prompt: dapo (the paper's template), raw (as stored)."""
    apply_chat_template: bool = False
    """Render the chat-list prompt with the tokenizer's chat template."""
    dedup: bool = True
    """Drop prompts that repeat (DAPO-Math-17k repeats many)."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (deterministically from `seed`)."""
    seed: int = 1234
    """Seed of the shuffle and of the synthetic task."""
    on_bad_row: str = "error"
    """A malformed row: error (stop naming file/row/field) or skip (count it)."""
    synthetic_num_train: int = 4000
    """Synthetic task: training problems."""
    synthetic_num_eval: int = 200
    """Synthetic task: held-out problems."""
    synthetic_min_digits: int = 1
    """Synthetic task: fewest digits per operand."""
    synthetic_max_digits: int = 2
    """Synthetic task: most digits per operand (difficulty)."""
    synthetic_ops: str = "+-"
    """Synthetic task: operators to draw from (subset of +-*)."""
    synthetic_num_operands: int = 2
    """Synthetic task: operands per problem (chain: the most; each problem draws 2..this)."""
    synthetic_task: str = "arithmetic"
    """Synthetic task: arithmetic (the answer only, ~4 tokens) or chain (a worked solution,
    one line per operation with the intermediate result, then `Answer:`; its length grows
    with the number of operands, so truncation and length shaping matter), or sum / sum_tool
    (long additions answered directly, or through the python tool: rollout.environment=python;
    data/synthetic.py), or calc_tools (a*b+c*d through the calculator tools mul and add, two
    calls at once in the hermes format: rollout.environment=tools)."""

    def validate(self) -> None:
        """This component's own rules (data files are checked by `preflight`)."""
        d, err = self, _field_error
        _check_choice("data.prompt_template", d.prompt_template, PromptTemplate)
        _check_choice("data.on_bad_row", d.on_bad_row, OnBadRow)
        if not d.train_path:
            if not 1 <= d.synthetic_min_digits <= d.synthetic_max_digits:
                raise err("data.synthetic_max_digits", "need 1 <= synthetic_min_digits <= synthetic_max_digits",
                          "e.g. synthetic_min_digits=1 synthetic_max_digits=2")
            if not d.synthetic_ops or set(d.synthetic_ops) - set("+-*"):
                raise err("data.synthetic_ops", f"{d.synthetic_ops!r} must be a non-empty subset of '+-*'", "use '+-'")
            if d.synthetic_num_operands < 2:
                raise err("data.synthetic_num_operands", "must be >= 2", "use 2")
            _check_choice("data.synthetic_task", d.synthetic_task, SyntheticTask)


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1): reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a hostname: it may resolve to any interface
        return False


def require_api_key(host: str, api_key: str, field: str, fix: str = "") -> None:
    """The rule for engines and routers: anything but loopback requires an API key (without
    one, anyone who reaches the port could replace the weights). ConfigError names `field`."""
    if not api_key and not is_loopback(host):
        raise _field_error(field, f"engines bind to {host} without an API key, so anyone who reaches them "
                                  "could replace the weights", fix or f"set {field} (or bind 127.0.0.1)")


@dataclass
class RolloutConfig:
    backend: str = "embedded"
    """embedded (CPU engine of this package) or sglang."""
    num_engines: int = 1
    """Engine processes (each a server)."""
    engine_tp_size: int = 1
    """Tensor parallelism inside each engine (SGLang --tp-size)."""
    engine_dp_size: int = 1
    """Data parallelism inside each engine (SGLang --dp-size)."""
    host: str = "127.0.0.1"
    """Address engines bind to. Anything but loopback requires `api_key`."""
    base_port: int = 0
    """First engine port; 0 picks free ports."""
    api_key: str = ""
    """API key engines require (SGLang --api-key); required when host is not loopback."""
    dtype: str = "auto"
    """Engine weight dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16."""
    mem_fraction_static: float = 0.7
    """SGLang --mem-fraction-static."""
    max_running_requests: int = 256
    """Most sequences an engine decodes at once."""
    request_timeout_s: float = 0.0
    """Hard bound on one /generate request's total time (0 = none, the default). A long
    request is not a failure: a 20k-token answer decodes for minutes. Liveness decides
    instead (`liveness_timeout_s`); a positive value here marks the engine failed when one
    request outlasts it and retries its prompts elsewhere."""
    liveness_timeout_s: float = 300.0
    """Bounds how long a hung engine (stopped, deadlocked, partitioned) holds its prompts: an
    engine with requests in flight that answers no /health probe for this long is marked
    dead and its prompts go to the others. A slow engine still answers its probes."""
    liveness_probe_interval_s: float = 10.0
    """Seconds between /health probes of an engine with requests in flight (each probe waits
    at most this long); a dead engine is probed before each weight sync and rejoins when it answers."""
    health_timeout_s: float = 0.0
    """Bounds an engine's start (load weights, capture graphs) until its first healthy answer.
    0 = derived from the model's bytes and the engine count (`dapo_mega.plan.clock.engine_start_timeout_s`)."""
    max_retries: int = 3
    """Times a prompt group is retried on another engine before the step fails."""
    engine_restarts: int = 3
    """Times the Slurm engines role (`python -m dapo_mega.launch engines`) restarts one engine
    that exited, at its port, within one job (or within rollout.engine_restart_window_s);
    the trainer finds it answering again and syncs the current weights into it before it
    serves. One more exit ends the role non-zero (and with it the job). 0: the first exit
    ends the job."""
    engine_restart_window_s: float = 0.0
    """Count an engine's restarts over this many seconds only (0: over the whole job): with
    3600 a crash loop still ends the job, while an engine lost once every few hours of a
    days-long job does not use up its restarts."""
    prompts_per_request: int = 4
    """Prompts (groups of n samples) per /generate request. A request is the unit the rollout
    manager streams, retries and aborts: smaller is finer, larger costs fewer round trips."""
    requests_per_engine: int = 8
    """Requests in flight per engine. prompts_per_request x this x n samples should fill an
    engine's batch (max_running_requests)."""
    weight_sync_bucket_mb: int = 512
    """Bucket size of the weight broadcast (MiB); bounds extra memory during a sync."""
    use_router: bool = False
    """Put sglang-router in front of the engines."""
    extra_server_args: List[str] = field(default_factory=list)
    """Extra flags passed verbatim to the engine command line."""
    model_path: str = ""
    """Path engines load at start; empty: the run's HF export of the initial weights."""
    engine_urls: List[str] = field(default_factory=list)
    """Engines started by someone else (e.g. the Slurm launcher), as http://host:port.
    Empty: the trainer starts `num_engines` engine processes itself."""
    engine_registry: str = ""
    """Directory where externally launched engines announce themselves (one
    `engine-<i>.json` with `url` each); the trainer waits for `num_engines` of them."""
    engine_python: str = ""
    """Python interpreter that runs the engine servers (`-m sglang.launch_server` or the
    embedded `-m dapo_mega.engines.embedded.server`), e.g. the bin/python of a separate SGLang venv;
    empty: the trainer's own interpreter."""
    partial_rollout: Optional[bool] = None
    """Partial rollouts (rollout/partial.py): when a streamed step's batch is full, the requests
    still in flight are aborted and their samples so far (tokens, engine log-probs, weight
    versions) kept with their prompts, in the checkpoint too; the next step resumes them under
    its weights (prompt + partial response as the input, the budget left), so the long tail is
    not generated twice. Resumed tokens are one version old or more, and a sample's age counts
    its oldest token: null (default) turns it on where that is allowed, the synchronous modes
    (cluster.max_staleness=0) with cluster.max_sample_age >= 1, and off elsewhere: at age
    limit 0 every resumed sample would be dropped as stale, and the asynchronous modes abort
    nothing when a batch fills (whole rounds; weight syncs pause with retract). It also makes
    what a step trains on depend on timing (how far each aborted request got), so two seeded
    runs may differ. true outside the synchronous modes with an age limit >= 1 is refused."""
    environment: str = ""
    """Multi-turn rollouts (rollout/turns.py): the environment each sample's turns talk to, a
    class path as reward plugins take (`package.module:Class` or `path/to/file.py:Class`), or
    `python` (the built-in sandboxed Python tool, dapo_mega/environments/python_tool.py:
    ReTool's `<code>` / `<interpreter>`). Empty: one turn per sample."""
    environment_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (verl's tool config `config:`), e.g.
    `+rollout.environment_kwargs.timeout_s=10` for the python tool."""
    agent: str = ""
    """Agent rollouts (dapo_mega/environments/agent.py): a class path whose `async run(problem,
    base_url)` runs one episode with an OpenAI-style client against the OpenAI-compatible
    endpoint at base_url (rollout/openai_endpoint.py), made with rollout.agent_kwargs; each
    sample is its episode's calls as the engine gave them. Empty: the trainer's own requests.
    Not with rollout.environment."""
    agent_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the agent's constructor."""
    tool_message: str = "text"
    """With an environment: how its answer goes into the context. text: as the environment
    wrote it (ReTool's `<interpreter>` block inside the assistant's turn); chat: as the
    tokenizer's chat template renders a tool message after the assistant's turn (Qwen:
    `<|im_end|>`, a user turn holding `<tool_response>...</tool_response>`, then a new
    assistant turn), for models trained on their template's tool turns; needs
    data.apply_chat_template=true."""
    max_turns: int = 8
    """With an environment: the model's turns per sample at most (ReTool, SimpleTIR: 5-16);
    the response-length budget (algo.max_response_length) bounds them too, the environment's
    tokens included."""
    turn_reward: str = "sum"
    """With an environment that rewards its answers (`StepResult.reward_parts`, a tool's reward):
    how the rewards of an episode's answers fold into the one added to the verifier's: sum, mean
    (over the answers, 0.0 for one without reward), last, max or min (rollout/turns.py
    `fold_turn_rewards`)."""
    mask_offpolicy_in_partial_rollout: bool = False
    """slime's --mask-offpolicy-in-partial-rollout: a resumed sample's tokens sampled under a
    weight version older than its newest (the prefix carried from an earlier step) carry no
    loss; only the tokens of the policy that finished it train (rollout/partial.py
    `offpolicy_prefix_mask`). Needs partial rollouts on."""

    def validate(self) -> None:
        """This component's own rules; ConfigError names the field and the fix."""
        r, err = self, _field_error
        _check_choice("rollout.backend", r.backend, RolloutBackend, "use embedded (CPU) or sglang (GPU)")
        if r.num_engines < 1:
            raise err("rollout.num_engines", "must be >= 1", "use 1 or more")
        require_api_key(r.host, r.api_key, "rollout.api_key", "set rollout.api_key (or bind rollout.host=127.0.0.1)")
        for name in ("liveness_timeout_s", "liveness_probe_interval_s"):
            if getattr(r, name) <= 0:
                raise err(f"rollout.{name}", f"must be > 0, got {getattr(r, name)}", "use 300 and 10 (seconds)")
        if r.liveness_probe_interval_s > r.liveness_timeout_s:
            raise err("rollout.liveness_probe_interval_s", f"{r.liveness_probe_interval_s} s is longer than "
                      f"rollout.liveness_timeout_s={r.liveness_timeout_s} s: a hung engine would be found late",
                      "probe several times per liveness timeout, e.g. 10 and 300")
        for name in ("request_timeout_s", "health_timeout_s"):
            if getattr(r, name) < 0:
                raise err(f"rollout.{name}", f"must be >= 0, got {getattr(r, name)}", "use 0 (derived / no limit)")
        if r.weight_sync_bucket_mb < 1:
            raise err("rollout.weight_sync_bucket_mb", "must be >= 1", "use 512")
        if r.engine_restarts < 0:
            raise err("rollout.engine_restarts", f"must be >= 0, got {r.engine_restarts}", "use 3 (0: no restarts)")
        if r.engine_restart_window_s < 0:
            raise err("rollout.engine_restart_window_s", f"must be >= 0, got {r.engine_restart_window_s}",
                      "use 3600, or 0 to count restarts over the whole job")
        for name in ("prompts_per_request", "requests_per_engine"):
            if getattr(r, name) < 1:
                raise err(f"rollout.{name}", f"must be >= 1, got {getattr(r, name)}", "use 4 and 8 (SGLang)")
        if r.engine_tp_size < 1:
            raise err("rollout.engine_tp_size", "must be >= 1", "use 1 (or the GPUs one engine spans)")
        if r.engine_dp_size != 1:
            # sglang 0.5.23 asserts dp_size == 1 in init_weights_update_group and every
            # update_weights_* call (tokenizer_control_mixin.py): the first sync would fail
            raise err("rollout.engine_dp_size", f"is {r.engine_dp_size}, but SGLang refuses weight updates into an "
                      "engine with data-parallel replicas (it asserts dp_size == 1)",
                      f"set rollout.engine_dp_size=1 and rollout.num_engines={r.num_engines * r.engine_dp_size} "
                      "(one engine per replica)")
        _check_choice("rollout.dtype", r.dtype, EngineDtype)
        if r.max_turns < 1:
            raise err("rollout.max_turns", f"must be >= 1, got {r.max_turns}", "use 8 (the model's turns per sample)")
        _check_choice("rollout.tool_message", r.tool_message, ToolMessage)
        _check_choice("rollout.turn_reward", r.turn_reward, TurnReward)
        if r.environment_kwargs and not r.environment:
            raise err("rollout.environment_kwargs", f"{sorted(r.environment_kwargs)} given, but rollout.environment "
                      "is empty", "set rollout.environment=python (or your class), or drop the kwargs")


@dataclass
class Fp8Config:
    enabled: bool = False
    """Train with FP8 GEMMs through Transformer Engine (GPU only)."""
    format: str = "e4m3"
    """e4m3 or hybrid (e4m3 forward, e5m2 backward)."""
    recipe: str = "delayed"
    """delayed, tensorwise or blockwise scaling."""
    amax_history_len: int = 1024
    """Delayed scaling: length of the amax history."""
    amax_compute_algo: str = "max"
    """Delayed scaling: max or most_recent."""
    num_layers_at_start_in_bf16: int = 1
    """First transformer layers kept in bf16."""
    num_layers_at_end_in_bf16: int = 1
    """Last transformer layers kept in bf16."""


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    """TP size."""
    pipeline_model_parallel_size: int = 1
    """PP size."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Virtual stages per PP rank (interleaved 1F1B); null = off."""
    context_parallel_size: int = 1
    """CP size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1)."""
    expert_model_parallel_size: int = 1
    """EP size (dense models: 1)."""
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch (prompt + response tokens after padding): with
    sequence packing, the length of one packed (THD) row on the Transformer Engine spec, or
    rows × row width on the local spec."""
    sequence_packing: bool = True
    """Pack several samples into one row (THD / cu_seqlens on Transformer Engine; a
    per-sample causal mask on the local spec) instead of padding each sample to the longest
    of its micro-batch. Results are equal either way; packing computes fewer pad tokens."""
    balance_data_parallel: bool = True
    """Split each mini-batch over data-parallel ranks by token count (Karmarkar–Karp)
    instead of contiguous blocks; the loss denominator stays the whole mini-batch's."""
    params_dtype: str = "auto"
    """auto (float32 on CPU, bf16 on GPU), float32, bf16."""
    transformer_impl: str = "auto"
    """auto (transformer_engine when importable on GPU, else local), local, transformer_engine."""
    fp8: Fp8Config = field(default_factory=Fp8Config)
    """FP8 recipe (Transformer Engine only)."""
    recompute_granularity: Optional[str] = None
    """Activation recomputation: null, full or selective."""
    recompute_method: Optional[str] = None
    """With full recompute: uniform or block."""
    recompute_num_layers: Optional[int] = None
    """With full recompute: layers per chunk (uniform) or recomputed layers (block)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP ranks (ZeRO-1 as Megatron does it)."""
    optimizer_sharding: str = "dp_reshardable"
    """How a checkpoint stores the distributed optimizer's state. dp_reshardable: each DP rank
    writes its own shard, in parallel; a resume must keep TP, PP and VPP (DP may change).
    fully_reshardable: each model-parallel shard's state is gathered on its DP rank 0 (slower
    saves, more host memory there); a resume may change TP, PP, VPP and DP."""
    overlap_grad_reduce: bool = False
    """Overlap DP gradient reduce-scatter with backward."""
    seed: int = 1234
    """Model init and dropout seed."""

    def validate(self) -> None:
        """This component's own rules (the world size: `check_world_size`)."""
        m, err = self, _field_error
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            if getattr(m, name) < 1:
                raise err(f"megatron.{name}", "must be >= 1", "use 1")
        if m.sequence_parallel and m.tensor_model_parallel_size == 1:
            raise err("megatron.sequence_parallel", "needs tensor_model_parallel_size > 1",
                      "set megatron.sequence_parallel=false or raise TP")
        if m.virtual_pipeline_model_parallel_size is not None and m.pipeline_model_parallel_size == 1:
            raise err("megatron.virtual_pipeline_model_parallel_size", "needs pipeline_model_parallel_size > 1",
                      "set it to null or raise PP")
        if m.virtual_pipeline_model_parallel_size is not None and m.virtual_pipeline_model_parallel_size < 1:
            raise err("megatron.virtual_pipeline_model_parallel_size",
                      f"must be >= 1, got {m.virtual_pipeline_model_parallel_size}", "use 2 or more, or null")
        if m.fp8.enabled and m.transformer_impl == "local":
            raise err("megatron.fp8.enabled", "FP8 needs the Transformer Engine layer spec",
                      "set megatron.transformer_impl=transformer_engine (GPU) or fp8.enabled=false")
        _check_choice("megatron.fp8.format", m.fp8.format, Fp8Format)
        _check_choice("megatron.fp8.recipe", m.fp8.recipe, Fp8Recipe)
        if m.recompute_granularity is not None:
            _check_choice("megatron.recompute_granularity", m.recompute_granularity, RecomputeGranularity,
                          "use null, full or selective")
        if m.recompute_granularity == "full" and m.recompute_method not in ("uniform", "block"):
            raise err("megatron.recompute_method", "full recompute needs a method",
                      "set megatron.recompute_method=uniform (or block) and recompute_num_layers")
        _check_choice("megatron.params_dtype", m.params_dtype, ParamsDtype)
        _check_choice("megatron.transformer_impl", m.transformer_impl, TransformerImpl)
        _check_choice("megatron.optimizer_sharding", m.optimizer_sharding, OptimizerSharding)

    def check_world_size(self, world_size: int) -> int:
        """DP for `world_size` learner processes, or ConfigError when TP·PP·CP does not divide it.
        The one place this rule lives (`ParallelLayout.validate` calls it too)."""
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        if world_size % (tp * pp * cp):
            multiple = tp * pp * cp
            raise _field_error("megatron.tensor_model_parallel_size",
                               f"tp*pp*cp = {tp}*{pp}*{cp} = {multiple} does not divide the world size {world_size} "
                               "(tp*pp*cp*dp must equal the number of learner processes)",
                               f"run a multiple of {multiple} learner processes (cluster.num_learner_processes="
                               f"{multiple} here; under torchrun/Slurm, more ranks), or choose tp, pp and cp "
                               f"whose product divides {world_size}")
        return world_size // (tp * pp * cp)


@dataclass
class ClusterConfig:
    mode: str = "colocated"
    """colocated (learners and engines share devices) or disaggregated."""
    max_staleness: int = 0
    """Disaggregated only: versions generation may run ahead of the learner (the queue; 0 =
    synchronous)."""
    max_sample_age: Optional[int] = None
    """The oldest sample kept, in versions behind the learner that trains on it (null: equal
    to max_staleness). Groups older are dropped as `stale` and refilled by fresh ones, so that
    with the queue fixed (max_staleness) the age alone can vary (configs/ablation/max_age.yaml)."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    num_learner_processes: int = 1
    """Learner ranks when launched outside Slurm/torchrun (the CPU default spawns them)."""
    num_nodes: int = 1
    """Nodes of the job (for `plan` and the Slurm launcher)."""
    gpus_per_node: int = 8
    """Accelerators per node (for `plan` and the Slurm launcher)."""
    engine_nodes: int = 0
    """Disaggregated: nodes given to engines (the rest are learners)."""
    gpu_memory_gib: float = 80.0
    """Memory per accelerator, for `plan`."""
    dist_timeout_s: int = 1800
    """Bounds one collective of the learner ranks (a training step's all-reduce, a weight
    sync's broadcast). Waiting for the driver's rollout or evaluation is not a collective:
    those waits are bounded by the driver's progress (`driver_stall_timeout_s`)."""
    driver_stall_timeout_s: float = 1800.0
    """Learner ranks waiting for the driver (rollout, evaluation) stop when the driver's
    progress counter (finished requests, phases) has not moved for this long."""

    @property
    def age_limit(self) -> int:
        """The oldest sample kept (max_sample_age, or max_staleness when it is null)."""
        return self.max_staleness if self.max_sample_age is None else self.max_sample_age

    def validate(self) -> None:
        """This component's own rules; ConfigError names the field and the fix."""
        c, err = self, _field_error
        _check_choice("cluster.mode", c.mode, ClusterMode)
        if c.max_staleness < 0:
            raise err("cluster.max_staleness", "must be >= 0", "use 0 (synchronous) or 1 (one-step off-policy)")
        if c.max_sample_age is not None and c.max_sample_age < 0:
            raise err("cluster.max_sample_age", f"must be >= 0 or null, got {c.max_sample_age}",
                      "use null (= cluster.max_staleness)")
        if c.mode == "colocated" and c.max_staleness > 0:
            raise err("cluster.max_staleness", f"is {c.max_staleness} in colocated mode, where engines and learners "
                      "take turns on the same devices", "set cluster.mode=disaggregated or max_staleness=0")
        _check_choice("cluster.device", c.device, Device)
        if c.dist_timeout_s <= 0 or c.driver_stall_timeout_s <= 0:
            raise err("cluster.dist_timeout_s", f"{c.dist_timeout_s} / driver_stall_timeout_s "
                      f"{c.driver_stall_timeout_s} must be > 0", "use 1800 for both (seconds)")
        if c.num_learner_processes < 1:
            raise err("cluster.num_learner_processes", "must be >= 1", "use 1")
        if c.mode == "disaggregated" and c.num_nodes > 1 and not 0 < c.engine_nodes < c.num_nodes:
            raise err("cluster.engine_nodes", f"{c.engine_nodes} of {c.num_nodes} nodes",
                      "give engines between 1 and num_nodes-1 nodes in disaggregated mode")


@dataclass
class TrainerConfig:
    run_name: str = "tiny_cpu"
    """Run directory name under output_dir; also the wandb run name."""
    output_dir: str = "outputs"
    """Parent of run directories."""
    total_steps: int = 20
    """Rollout steps to train (each: generate, filter, train, sync)."""
    save_interval: int = 5
    """Save a training checkpoint every this many steps (0 = only at the end)."""
    keep_last_k: int = 2
    """Checkpoints kept; older ones are deleted after a new one is complete."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0 = none): checkpoints
    to compare later on the same hold-out."""
    hf_export_interval: int = 0
    """Write the learner's weights as a Hugging Face checkpoint every this many RL steps, and
    after the run's last step (0 = off): `<run_dir>/hf/step_<N>/` with sharded safetensors +
    index, config.json, generation_config.json and the model's tokenizer files, loadable by
    `from_pretrained` and SGLang. Written into a `.tmp-` directory by the learner ranks (each
    pipeline stage's TP-0 rank writes its own shards; no rank gathers the model) and renamed
    when complete. Its seconds and bytes are in metrics.jsonl (`hf_export/seconds`,
    `hf_export/bytes`, `mem/hf_export/rss_peak_gib`). A run stopped early by
    wall_time_minutes exports only on the interval."""
    hf_export_keep: int = 2
    """HF exports kept; older complete ones (only those) are deleted after a new one is complete."""
    hf_export_dtype: str = "bfloat16"
    """dtype of the exported weights: bfloat16, float32 or float16."""
    resume_step: int = 0
    """Resume from exactly this step's checkpoint (0 = the latest). Later checkpoints, ledger
    shards and eval files move to <run_dir>/set_aside/ (nothing is lost); later starts with
    the same setting go on from the restarted run's own latest checkpoint."""
    eval_interval: int = 10
    """Evaluate on the held-out set every this many steps (0 = off); also before step 1
    and after the last."""
    resume: bool = True
    """Resume from the latest complete checkpoint of the run directory when there is one."""
    allow_changes: List[str] = field(default_factory=list)
    """Fields (dotted, or a group such as `data`) a resume may change although they shape the
    data or the update (`dapo_mega.run_files.identity.GUARDED_FIELDS`: algo, data, model, seed, ...),
    e.g. `[algo.verifier]`. A resume that changes any other such field stops before anything
    is built, naming each field and its two values; an allowed change is kept in
    `<run_dir>/config_history.jsonl` with the step it took effect."""
    seed: int = 1
    """Seed of sampling and data order."""
    sft_warmup_steps: int = 0
    """Supervised warm-start steps on reference answers before RL step 1 (0 = none: RL starts
    from the model as loaded). The tiny model's group (configs/model/tiny_qwen2.yaml) sets
    1200, because random weights answer nothing; the recipe configs start from the base model."""
    sft_lr: float = 1e-3
    """Learning rate of the supervised warm start."""
    sft_batch_size: int = 64
    """Examples per supervised warm-start step."""
    sft_on_pretrained: bool = False
    """Allow the warm start on a pretrained model (model.hf_path or model.megatron_path set).
    Off, such a run stops before it starts (`check_warm_start`): supervised steps on bare
    answers at sft_lr rewrite a base model before RL has seen it, so it must be asked for."""
    wandb_mode: str = "offline"
    """wandb mode: offline (default), online (needs WANDB_API_KEY) or disabled."""
    wandb_project: str = "dapo-mega"
    """wandb project."""
    plot: bool = True
    """Write curves.png into the run directory."""
    plot_interval_s: float = 60.0
    """Redraw curves.png at a step only when this many seconds have passed since the last
    drawing; the first step and the end of the run always draw (0 = every step). A drawing
    costs about a second of a core: nothing beside a 32B step of minutes, most of a tiny
    CPU step."""
    wall_time_minutes: float = 0.0
    """Stop cleanly, with a checkpoint, after the last step that leaves time for one more and
    its save within this many minutes of the trainer's start (0 = no limit). The next step is
    estimated as the longest so far, plus the last save's duration and stop_margin_minutes.
    The Slurm launcher sets it from the job's time left when it is not set."""
    stop_margin_minutes: float = 2.0
    """Slack kept before wall_time_minutes for the final save and shutdown."""
    ledger_text: str = "head_tail"
    """What the ledger keeps of each prompt and response text (`records.ledger.LedgerText`):
    full (all of it), head_tail (a text over ledger_text_max_chars keeps its first and last
    halves of that many characters around a marker naming how many were left out) or none.
    Each row records the text's length in characters and whether it was elided. The tiny
    default's responses are far shorter than the bound, so head_tail keeps them whole; the
    32B recipe writes up to 24,576 responses of up to ~75,000 characters per round."""
    ledger_text_max_chars: int = 2048
    """Characters of a text that head_tail keeps (half head, half tail; the marker adds ~30)."""
    ledger_routed_experts: bool = False
    """A mixture of experts: the ledger keeps each reported sample's routed experts (column
    `routed_experts`, compact: a byte per token, layer and choice, base64). Off by default:
    Qwen3-30B-A3B's are 512 bytes a token, so with routing replay (every sample reported) a
    step of the 32B-scale recipe writes gigabytes; `dapo-mega plan` prints the ledger's size."""

    def validate(self) -> None:
        """This component's own rules; ConfigError names the field and the fix."""
        t, err = self, _field_error
        if t.wall_time_minutes < 0 or t.stop_margin_minutes < 0:
            raise err("trainer.wall_time_minutes", f"{t.wall_time_minutes} / stop_margin_minutes "
                      f"{t.stop_margin_minutes} must be >= 0", "use 0 for no limit")
        if t.total_steps < 0:
            raise err("trainer.total_steps", "must be >= 0", "use a positive number of rollout steps")
        for name in ("keep_every", "resume_step"):
            if getattr(t, name) < 0:
                raise err(f"trainer.{name}", f"must be >= 0, got {getattr(t, name)}", "use 0 (off)")
        if t.keep_last_k < 1:
            raise err("trainer.keep_last_k", "must be >= 1 (the latest checkpoint is always kept)", "use 2")
        if t.hf_export_interval < 0:
            raise err("trainer.hf_export_interval", f"must be >= 0, got {t.hf_export_interval}",
                      "use 0 (off) or a number of RL steps")
        if t.hf_export_keep < 1:
            raise err("trainer.hf_export_keep", f"must be >= 1 (the newest export is always kept), got "
                      f"{t.hf_export_keep}", "use 2")
        _check_choice("trainer.hf_export_dtype", t.hf_export_dtype, HFExportDtype)
        _check_choice("trainer.wandb_mode", t.wandb_mode, WandbMode)
        if t.wandb_mode == "online" and not os.environ.get("WANDB_API_KEY"):
            raise err("trainer.wandb_mode", "online needs WANDB_API_KEY in the environment",
                      "export WANDB_API_KEY or use trainer.wandb_mode=offline")
        if "/" in t.run_name or not t.run_name:
            raise err("trainer.run_name", f"{t.run_name!r} must be a non-empty name without '/'", "e.g. my_run")
        if t.sft_warmup_steps < 0:
            raise err("trainer.sft_warmup_steps", f"must be >= 0, got {t.sft_warmup_steps}", "use 0 (no warm start)")
        if t.sft_warmup_steps > 0 and (t.sft_lr <= 0 or t.sft_batch_size < 1):
            raise err("trainer.sft_lr", f"{t.sft_lr} / sft_batch_size {t.sft_batch_size} must be > 0 for a warm "
                      f"start of {t.sft_warmup_steps} steps", "use sft_lr=1e-3 and sft_batch_size=64, or "
                      "trainer.sft_warmup_steps=0")
        _check_choice("trainer.ledger_text", t.ledger_text, LedgerTextMode)
        if t.ledger_text == "head_tail" and t.ledger_text_max_chars < 64:
            raise err("trainer.ledger_text_max_chars", f"{t.ledger_text_max_chars} < 64 leaves too little of each "
                      "text to read (the answer is in the last characters of a response)",
                      "use 2048, or trainer.ledger_text=none to leave the texts out")


@dataclass
class EvalSetConfig:
    """One named held-out set of `eval.sets`; its metrics are `eval/<name>/avg_at_k`."""

    path: str = ""
    """The set's .parquet / .jsonl file (tools/prepare_data.py writes AIME 2025 and MATH-500)."""
    n_samples: Optional[int] = None
    """k of this set's avg@k (null: eval.n_samples)."""
    max_response_length: Optional[int] = None
    """This set's length limit (null: eval.max_response_length, else the training limit)."""
    max_problems: Optional[int] = None
    """Evaluate only the first N problems (null: eval.max_problems; 0 = all)."""

    def validate(self, name: str) -> None:
        """The set's own rules; ConfigError names `eval.sets.<name>.<field>` and the fix."""
        err, where = _field_error, f"eval.sets.{name}"
        if not name.isidentifier():
            raise err(where, f"the set name {name!r} is not a plain identifier (it becomes the metric key "
                      f"eval/{name}/avg_at_k)", "use letters, digits and _, e.g. eval.sets.aime_2025")
        if name == "eval":
            raise err(where, "the name 'eval' is the unnamed held-out set's label in tables and reports",
                      "give this set its own name, e.g. eval.sets.aime_2024")
        if not self.path:
            raise err(f"{where}.path", "empty", "point it at the set's .parquet / .jsonl file")
        if self.n_samples is not None and self.n_samples < 1:
            raise err(f"{where}.n_samples", f"must be >= 1, got {self.n_samples}", "use 32 (AIME protocol), "
                      "or null for eval.n_samples")
        if self.max_response_length is not None and self.max_response_length < 1:
            raise err(f"{where}.max_response_length", f"must be >= 1, got {self.max_response_length}",
                      "use null for the eval / training limit")
        if self.max_problems is not None and self.max_problems < 0:
            raise err(f"{where}.max_problems", f"must be >= 0, got {self.max_problems}", "use 0 for all problems")


@dataclass
class EvalConfig:
    n_samples: int = 32
    """k of avg@k."""
    temperature: float = 1.0
    """Sampling temperature (AIME protocol: 1.0)."""
    top_p: float = 0.7
    """Top-p (AIME protocol: 0.7)."""
    max_response_length: Optional[int] = None
    """Null: the training max_response_length, so scores compare."""
    max_problems: int = 0
    """Evaluate only the first N problems (0 = all)."""
    seed: Optional[int] = 0
    """Sampling seed: each problem's request carries a seed from (seed, problem id), so the
    same checkpoint and settings give the same avg@k, and two checkpoints are compared on the
    same random numbers (null: unseeded; SGLang honours it only with
    --enable-deterministic-inference)."""
    checkpoint: str = ""
    """`dapo-mega eval`: the model to evaluate (HF dir, Megatron checkpoint or run dir)."""
    compare_checkpoint: str = ""
    """`dapo-mega eval`: a second model compared on the same problems."""
    output: str = ""
    """`dapo-mega eval`: where to write per-problem pass rates (default <run_dir>/eval/)."""
    sets: Dict[str, EvalSetConfig] = field(default_factory=dict)
    """Named held-out sets besides data.eval_path (which stays the unnamed set, `eval/avg_at_k`):
    name -> {path, n_samples, max_response_length, max_problems}, each evaluated every
    trainer.eval_interval steps and by `dapo-mega eval`, reported as `eval/<name>/avg_at_k`."""
    overlap: str = "auto"
    """Where the training run's evaluation spends its time (driver/eval_beside.py): `beside`
    starts it right after the eval step's weight sync, in a thread, while the next step's
    rollout and training go on; the next sync waits for it (`time/eval_s` is that wait) and the
    eval step's metrics row is written when it ends. `inline` stops the loop while it runs.
    `auto`: beside when cluster.mode=disaggregated (the engines idle while the learner
    trains), inline when colocated (the engines give their memory to the learner meanwhile)."""

    def validate(self) -> None:
        """This component's own rules; ConfigError names the field and the fix."""
        e, err = self, _field_error
        _check_choice("eval.overlap", e.overlap, EvalOverlap)
        if e.n_samples < 1:
            raise err("eval.n_samples", "must be >= 1", "use 32 (AIME protocol)")
        if not 0 < e.top_p <= 1:
            raise err("eval.top_p", f"must be in (0, 1], got {e.top_p}", "use 0.7 (AIME protocol)")
        for name, eval_set in e.sets.items():
            eval_set.validate(str(name))


@dataclass
class ChecksConfig:
    """The alarms that say whether the engines serve the learner's weights (driver/weight_probe.py):
    the per-step log-prob mismatch (always logged as `mismatch/...`) and a probe after every
    weight sync (`probe/...`), each with a threshold that stops the run."""

    mismatch_age_buckets: int = 3
    """Age buckets of the per-step mismatch metrics: `mismatch/age_0/...`, `age_1`, ...; the
    last holds every older age (`age_2plus` with 3)."""
    step_max_abs_mean: Optional[float] = None
    """Stop the run when the age-0 tokens of a step have a mean |log p_learner - log p_engine|
    above this (nats). null: derived from the dtypes, FP32_MAX_ABS_MEAN (0.01) when the learner
    and the engines compute in float32 (a correct CPU run: ~1e-7), BF16_MAX_ABS_MEAN (0.5)
    otherwise (a correct bf16 run: a few hundredths; weights that did not arrive or were
    converted wrongly: nats)."""
    checksum: bool = True
    """After every weight sync, compare a checksum of every tensor each engine holds (SGLang's
    /weights_checker, action checksum) with the learner's of what it sent: exact, at any
    learning rate, naming the tensors that differ. Embedded engines and SGLang engines of TP 1
    (on a CPU or a GPU: SGLang hashes each with its own kernel, and so does the learner); the
    probe judges the rest (driver/policy_sync.py `held_as` says which)."""
    router_agreement_every: int = 8
    """A mixture of experts without routing replay: one request in this many asks its engine for
    each token's experts (`return_routed_experts`), which `moe/router_agreement` compares with
    the learner's router (every request with algo.routing_replay; 0: none). A report is a byte
    per token, layer and chosen expert: 384 B a token for Qwen3-30B-A3B."""
    probe: bool = True
    """After every weight sync, compare each engine's log-probs of a fixed token sequence
    (/generate with input_ids and logprob_start_len=0) with the learner's, and the weight
    version each engine reports with the one sent."""
    probe_tokens: int = 64
    """Length of the probe's token sequence: a fixed text in the model's tokenizer, then fixed
    pseudo-random ids of its vocabulary."""
    probe_max_abs_mean: Optional[float] = None
    """Stop the run when an engine's mean |log p_learner - log p_engine| over the probe exceeds
    this (nats). null: derived from the dtypes, as step_max_abs_mean."""
    stop: bool = True
    """Stop the run when a check fails (the message names the check, the engine and the likely
    cause); false: log the message as a warning and go on."""

    def validate(self) -> None:
        c, err = self, _field_error
        if c.router_agreement_every < 0:
            raise err("checks.router_agreement_every", f"must be >= 0, got {c.router_agreement_every}", "use 8")
        if c.mismatch_age_buckets < 1:
            raise err("checks.mismatch_age_buckets", f"must be >= 1, got {c.mismatch_age_buckets}", "use 3")
        for name in ("step_max_abs_mean", "probe_max_abs_mean"):
            value = getattr(c, name)
            if value is not None and not value > 0:
                raise err(f"checks.{name}", f"must be > 0, got {value}", "use null (derived from the dtypes)")
        if c.probe_tokens < 2:
            raise err("checks.probe_tokens", f"must be >= 2, got {c.probe_tokens}", "use 64")


@dataclass
class DapoConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checks: ChecksConfig = field(default_factory=ChecksConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.output_dir) / self.trainer.run_name


CONFIG_DIR_ENV = "DAPO_MEGA_CONFIG_DIR"


def config_dir() -> Path:
    """The `configs/` directory (next to the package, or $DAPO_MEGA_CONFIG_DIR)."""
    if os.environ.get(CONFIG_DIR_ENV):
        return Path(os.environ[CONFIG_DIR_ENV]).resolve()
    return (Path(__file__).resolve().parent.parent / "configs").resolve()


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="dapo_mega_schema", node=DapoConfig)


def _field_error(path: str, message: str, fix: str) -> ConfigError:
    return ConfigError(f"{path}: {message}. Fix: {fix}")


def _check_choice(path: str, value: Any, choices: Any, fix: str = "") -> None:
    """`value` must be one of the `Literal` alias `choices` (see the module docstring)."""
    allowed = get_args(choices)
    if value not in allowed:
        raise _field_error(path, f"unknown {value!r}", fix or "use " + ", ".join(map(str, allowed)))


def compose_config(config_name: str, overrides: List[str]) -> Any:
    """Compose `configs/<config_name>.yaml` with Hydra overrides into its structured object.

    The schema of the config must be registered in Hydra's ConfigStore first. A bad override
    (unknown key, wrong type, missing group option, bad syntax) raises ConfigError naming it.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = compose(config_name=config_name, overrides=list(overrides))
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        raise ConfigError(f"{key or 'override'}: {exc}".strip()) from exc
    except Exception as exc:  # hydra's own errors (missing group option, bad syntax)
        if type(exc).__module__.startswith("hydra"):
            raise ConfigError(f"override: {exc}") from exc
        raise
    finally:
        GlobalHydra.instance().clear()


def load_config(overrides: Optional[List[str]] = None, config_name: str = "config") -> DapoConfig:
    """Compose `configs/<config_name>.yaml` with Hydra overrides into a validated DapoConfig.

    A bad override (unknown key, wrong type) raises ConfigError naming the key.
    """
    register_configs()
    obj = compose_config(config_name, list(overrides or []))
    assert isinstance(obj, DapoConfig)
    validate_config(obj)
    return obj


_UNQUOTED_STRING = re.compile(r"[A-Za-z0-9_./:@+-]+")
"""Characters Hydra's override lexer (OverrideLexer.g4, VALUE_MODE) reads as a plain string."""
_NOT_A_STRING = re.compile(r"[+-]?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)([eE][+-]?\d[\d_]*)?|[+-]?(inf|nan)|true|false|null",
                           re.IGNORECASE)
"""Values the lexer turns into a number, bool or null when unquoted (a superset: quoting is never wrong)."""


def hydra_value(value: str) -> str:
    """`value` as the right-hand side of a Hydra override (`key=<this>`) that reads back as
    exactly `value`: bare when that is unambiguous (`/lustre/run-1`), else single-quoted.

    Inside quotes Hydra unescapes only backslashes that precede a quote (or the closing one),
    so only those are doubled; `${` is escaped for OmegaConf, which would otherwise
    interpolate it once the override is applied."""
    if _UNQUOTED_STRING.fullmatch(value) and not _NOT_A_STRING.fullmatch(value):
        return value
    body = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", body)
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)
    return "'" + body + "'"


def to_yaml(cfg: DapoConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml(text: str) -> DapoConfig:
    """Parse a saved `config.yaml` (as written into a run directory)."""
    from omegaconf import OmegaConf

    base = OmegaConf.structured(DapoConfig)
    obj = OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.create(text)))
    assert isinstance(obj, DapoConfig)
    return obj


def routed_experts_every(cfg: DapoConfig) -> int:
    """One request in this many asks a mixture's engine for its routed experts: every one with
    routing replay, else checks.router_agreement_every (0: none)."""
    return 1 if cfg.algo.routing_replay else cfg.checks.router_agreement_every


def describe_fields(cls: type = DapoConfig, prefix: str = "") -> List[str]:
    """`name: type = default  # doc` lines for every field (for `--help`)."""
    import ast
    import inspect
    import textwrap

    docs: dict = {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
                if isinstance(getattr(nxt, "value", None), ast.Constant):
                    docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore
    except (OSError, TypeError):
        pass
    lines: List[str] = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        default: Any = f.default
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            lines.extend(describe_fields(type(default), prefix=f"{name}."))
            continue
        doc = docs.get(f.name, "")
        lines.append(f"{name} = {default!r}    # {doc}")
    return lines


def check_warm_start(cfg: DapoConfig) -> None:
    """A warm start (trainer.sft_warmup_steps > 0) on a pretrained model (model.hf_path or
    model.megatron_path set) needs trainer.sft_on_pretrained=true; ConfigError otherwise.

    `dapo-mega train` checks it before anything starts. It is not part of `validate_config`:
    a config that is only planned, evaluated or inspected runs no warm start.
    """
    t, m = cfg.trainer, cfg.model
    pretrained = [f"model.{name}={getattr(m, name)}" for name in ("hf_path", "megatron_path") if getattr(m, name)]
    if t.sft_warmup_steps > 0 and pretrained and not t.sft_on_pretrained:
        raise _field_error("trainer.sft_on_pretrained", f"false, but trainer.sft_warmup_steps={t.sft_warmup_steps} "
                           f"would run supervised steps at sft_lr={t.sft_lr:g} on the pretrained model "
                           f"({', '.join(pretrained)}) before RL step 1",
                           "set trainer.sft_warmup_steps=0 to start RL from the model as is, or "
                           "trainer.sft_on_pretrained=true to warm-start it on purpose")


def partial_rollout_enabled(cfg: DapoConfig) -> bool:
    """rollout.partial_rollout resolved: as set, or (null) on in the synchronous modes whose age
    limit lets a sample resumed one step later be trained (cluster.max_sample_age >= 1)."""
    if cfg.rollout.partial_rollout is not None:
        return cfg.rollout.partial_rollout
    return cfg.cluster.max_staleness == 0 and cfg.cluster.age_limit >= 1


def _check_partial_rollout(cfg: DapoConfig) -> None:
    c, err = cfg.cluster, _field_error
    if cfg.rollout.mask_offpolicy_in_partial_rollout and not partial_rollout_enabled(cfg):
        raise err("rollout.mask_offpolicy_in_partial_rollout", "is true but partial rollouts are off (rollout."
                  f"partial_rollout={cfg.rollout.partial_rollout}, cluster.max_staleness={c.max_staleness}): no "
                  "sample is resumed", "set rollout.partial_rollout=true in a synchronous mode, or this to false")
    if not cfg.rollout.partial_rollout:
        return
    if c.max_staleness > 0:
        raise err("rollout.partial_rollout", f"is true with cluster.max_staleness={c.max_staleness}: asynchronous "
                  "rounds are generated whole and weight syncs retract requests in flight, so nothing is aborted "
                  "to keep", "set rollout.partial_rollout=null (or false), or cluster.max_staleness=0")
    if c.age_limit < 1:
        raise err("rollout.partial_rollout", "is true with an age limit of 0 (cluster.max_sample_age, null = "
                  "max_staleness): a sample resumed by the next step has tokens one version old, and every one "
                  "would be dropped as stale", "set cluster.max_sample_age=1, or rollout.partial_rollout=null")


def eval_beside(cfg: DapoConfig) -> bool:
    """Whether the run evaluates beside the next step (`eval.overlap`; auto: disaggregated)."""
    if cfg.eval.overlap == "auto":
        return cfg.cluster.mode == "disaggregated"
    return cfg.eval.overlap == "beside"


def validate_config(cfg: DapoConfig, world_size: Optional[int] = None) -> None:
    """Every config rule, composed once: each component's own `validate()`, then the rules
    that span components; raises ConfigError naming the field and the fix.

    `world_size` (learner processes) is checked against the parallel layout when given.
    """
    for component in (cfg.model, cfg.algo, cfg.data, cfg.rollout, cfg.megatron, cfg.cluster, cfg.trainer, cfg.eval,
                      cfg.checks):
        component.validate()
    a, m, err = cfg.algo, cfg.megatron, _field_error
    _check_partial_rollout(cfg)
    if cfg.rollout.tool_message == "chat" and cfg.rollout.environment and not cfg.data.apply_chat_template:
        raise err("rollout.tool_message", "is chat, but data.apply_chat_template is false: the prompt has no chat "
                  "turns for the tool's answer to continue", "set data.apply_chat_template=true, or "
                  "rollout.tool_message=text")
    if cfg.rollout.agent and cfg.rollout.environment:
        raise err("rollout.agent", f"is {cfg.rollout.agent!r} with rollout.environment={cfg.rollout.environment!r}: an "
                  "agent runs its own loop (its tools included)", "set one of them")
    if cfg.rollout.agent_kwargs and not cfg.rollout.agent:
        raise err("rollout.agent_kwargs", f"{sorted(cfg.rollout.agent_kwargs)} given, but rollout.agent is empty",
                  "set rollout.agent, or drop the keyword arguments")
    if cfg.data.synthetic_task == "sum_tool" and not cfg.data.train_path and cfg.rollout.environment != "python":
        raise err("data.synthetic_task", "is sum_tool: its warm start teaches the model to call the python tool, but "
                  f"rollout.environment={cfg.rollout.environment!r} runs none", "set rollout.environment=python, "
                  "or data.synthetic_task=sum (the same problems answered directly)")
    if cfg.data.synthetic_task == "calc_tools" and not cfg.data.train_path and (
            cfg.rollout.environment != "tools" or cfg.rollout.environment_kwargs.get("format", "hermes") != "hermes"):
        raise err("data.synthetic_task", "is calc_tools: its warm start calls the calculator tools in the hermes format, "
                  f"but rollout.environment={cfg.rollout.environment!r} with environment_kwargs "
                  f"{dict(cfg.rollout.environment_kwargs)} does not run them", "set rollout.environment=tools and "
                  "+rollout.environment_kwargs.tools=[dapo_mega.environments.calculator:Mul,"
                  "dapo_mega.environments.calculator:Add]")
    if cfg.eval.overlap == "beside" and cfg.cluster.mode == "colocated":
        raise err("eval.overlap", "is beside with cluster.mode=colocated: the engines release their memory to "
                  "the learner while it trains, so an evaluation cannot run beside the next step",
                  "set eval.overlap=auto (inline when colocated) or cluster.mode=disaggregated")
    if m.micro_batch_tokens < a.max_prompt_length + a.max_response_length:
        raise err("megatron.micro_batch_tokens", f"{m.micro_batch_tokens} cannot hold one sample of "
                  f"max_prompt_length + max_response_length = {a.max_prompt_length + a.max_response_length} tokens",
                  "raise megatron.micro_batch_tokens (or shorten the lengths)")
    if world_size is not None:
        dp = m.check_world_size(world_size)
        if a.mini_batch_size * a.n_samples_per_prompt % dp:
            raise err("algo.mini_batch_size", f"{a.mini_batch_size} prompts x {a.n_samples_per_prompt} samples "
                      f"do not split over {dp} data-parallel ranks", "make mini_batch_size*G divisible by DP")
