"""The one record of a model's shape, read from a Hugging Face config (Qwen2 / Qwen2.5 / Qwen3 / Llama,
and Qwen3-MoE: sized by `dapo-mega plan`, refused by the learner until it builds MoE layers).

    shape = ModelShape.from_hf_config("/models/Qwen2.5-32B")   # or a config object or dict

Every part of the project that needs a number of the architecture reads it here: the
Megatron model provider (`backends/megatron/model.py`), the HF ⇄ Megatron weight mapping
and streaming (`weights/mapping.py`, `weights/stream.py`), conversion and `dapo-mega plan`.
Field names follow megatron-core where HF and Megatron disagree on a size
(`ffn_hidden_size` for HF's `intermediate_size`, `num_layers` for `num_hidden_layers`) and
HF's `num_key_value_heads` for Megatron's `num_query_groups`.

Accepts a transformers `PretrainedConfig`, a dict (the parsed config.json) or a path to a
checkpoint directory / config.json. Nothing here imports torch or megatron.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple, Union

from dapo_mega.config import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe")
HF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM"}
"""HF `config.architectures[0]` of each supported `model_type`."""

HfConfigDict = Dict[str, Any]
"""A parsed Hugging Face config.json (nested JSON: `rope_scaling`, `rope_parameters`, ...)."""

HfConfigSource = Union["PretrainedConfig", HfConfigDict, str, Path]
"""Where an HF config is read from: a transformers config object, the parsed config.json,
or a checkpoint directory / config.json path (`hf_config_to_dict`)."""


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of a decoder-only transformer (Qwen2 / Qwen3 / Llama family)."""

    model_type: str
    """HF `model_type`: "qwen2", "qwen3" or "llama"."""
    vocab_size: int
    """HF vocabulary size: rows of embed_tokens / lm_head."""
    hidden_size: int
    ffn_hidden_size: int
    """SwiGLU inner size (HF `intermediate_size`); gate, up and down projections."""
    num_layers: int
    """Transformer layers (HF `num_hidden_layers`)."""
    num_attention_heads: int
    num_key_value_heads: int
    """KV heads (GQA); megatron-core calls them `num_query_groups`."""
    head_dim: int
    """Channels of one attention head: HF `head_dim` when the config has it (Qwen3-8B: 128
    with hidden 4096 / 32 heads; tiny Qwen3s differ), else hidden_size / num_attention_heads."""
    tie_word_embeddings: bool
    """HF stores only embed_tokens; lm_head is the same tensor."""
    qkv_bias: bool
    """Qwen2 always has a bias on q/k/v; Llama follows `attention_bias`; Qwen3 has none."""
    qk_layernorm: bool = False
    """RMSNorm over head_dim on every query and key head before RoPE (Qwen3's `q_norm` /
    `k_norm`; megatron-core's `qk_layernorm`)."""
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling_factor: Optional[float] = None
    """Llama-3.1 style RoPE scaling factor (rope_type "llama3"); None = plain RoPE."""
    rope_scaling_low_freq_factor: float = 1.0
    """Llama-3 scaling: wavelengths above original_max / low_freq_factor are divided by the factor."""
    rope_scaling_high_freq_factor: float = 4.0
    """Llama-3 scaling: wavelengths below original_max / high_freq_factor are kept; between the
    two bounds the frequency is interpolated."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """Llama-3 scaling: the context length the model was pre-trained at."""
    max_position_embeddings: int = 4096
    padded_vocab_size: int = 0
    """Megatron's vocabulary: `vocab_size` rounded up for the tensor-parallel split (rows
    [vocab_size, padded_vocab_size) are padding, zero at init, masked out of log-probs and
    never written to HF). Equal to `vocab_size` until `with_padded_vocab` sets it."""
    # --- mixture of experts (Qwen3-MoE: transformers' Qwen3MoeConfig); 0 experts = dense ---
    num_experts: int = 0
    """Routed experts of each sparse layer (HF `num_experts`); 0: a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_ffn_hidden_size: int = 0
    """SwiGLU inner size of one expert (HF `moe_intermediate_size`); `ffn_hidden_size` is the
    dense MLP of the layers that have one (`mlp_only_layers`)."""
    norm_topk_prob: bool = False
    """The top-k routing weights are renormalised to sum to 1."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: Tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    """Weight of the router's load-balancing loss (HF `router_aux_loss_coef`)."""

    def __post_init__(self) -> None:
        if not self.padded_vocab_size:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size {self.padded_vocab_size} < vocab_size {self.vocab_size}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has routed experts instead of a dense MLP
        (transformers' Qwen3MoeDecoderLayer rule)."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % max(self.decoder_sparse_step, 1) == 0)

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.is_sparse_layer(i) for i in range(self.num_layers))

    @property
    def hf_architecture(self) -> str:
        """`Qwen2ForCausalLM` or `LlamaForCausalLM`."""
        return HF_ARCHITECTURES[self.model_type]

    def with_padded_vocab(self, padded_vocab_size: int) -> "ModelShape":
        """The same shape with Megatron's padded vocabulary (set by the model provider)."""
        return replace(self, padded_vocab_size=padded_vocab_size)

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, hf_config: HfConfigSource) -> "ModelShape":
        """Parse a Qwen2/Qwen2.5/Qwen3/Llama config; raises ConfigError for other model types
        and for variants the learner would compute differently from transformers."""
        cfg = hf_config_to_dict(hf_config)
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model.hf_path: model_type {model_type!r} is not supported; "
                              f"use one of {SUPPORTED_MODEL_TYPES}")
        if model_type in ("qwen3", "qwen3_moe"):
            _check_qwen3(cfg)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = _rope(cfg)
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            ffn_hidden_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has QKV bias (there is no config switch); Llama follows attention_bias;
            # Qwen3 with attention_bias is refused above (it would bias o_proj too).
            qkv_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            **rope,
            **_moe(cfg) if model_type == "qwen3_moe" else {},
        )


def _moe(cfg: HfConfigDict) -> Dict[str, Any]:
    """Qwen3-MoE's routing fields, as ModelShape keyword arguments (transformers' defaults)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 writes the latter
    top_k = int(cfg.get("num_experts_per_tok", 0))
    if experts < 1 or not 1 <= top_k <= experts:
        raise ConfigError(f"model.hf_path: a Qwen3-MoE config with num_experts={experts} and "
                          f"num_experts_per_tok={top_k}; a MoE routes each token to 1 <= k <= num_experts experts")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_ffn_hidden_size": int(cfg.get("moe_intermediate_size", 0)),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(cfg.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.0))}


def _check_qwen3(cfg: Mapping[str, object]) -> None:
    """Qwen3 options the Megatron learner does not compute: a bias on q/k/v/o, sliding windows."""
    if cfg.get("attention_bias"):
        raise ConfigError("model.hf_path: Qwen3 with attention_bias=true (a bias on q/k/v and o_proj) is not "
                          "supported by the Megatron learner. Fix: use a checkpoint with attention_bias=false")
    if cfg.get("use_sliding_window"):
        raise ConfigError("model.hf_path: Qwen3 with use_sliding_window=true is not supported (the learner's "
                          "attention is full causal). Fix: set use_sliding_window=false in config.json")


def hf_config_to_dict(hf_config: HfConfigSource) -> HfConfigDict:
    """A config object, dict, directory or config.json path -> the config.json dict."""
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if isinstance(hf_config, (str, Path)):
        path = Path(hf_config)
        if path.is_dir():
            path = path / "config.json"
        return json.loads(path.read_text())
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"cannot read a Hugging Face config from {type(hf_config).__name__}")


def _rope(cfg: HfConfigDict) -> Dict[str, Optional[float]]:
    """RoPE θ and the Llama-3 scaling fields, as ModelShape keyword arguments.

    transformers 5 stores RoPE as `rope_parameters = {"rope_theta": θ, "rope_type": ...,
    (scaling fields)}`; transformers 4 config.json files have top-level `rope_theta` and an
    optional `rope_scaling` dict with `rope_type` (or the older key `type`). Llama-3 scaling
    defaults (factor 8, low 1, high 4, original context 8192) are Llama-3.1's.
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return {"rope_theta": float(theta), "rope_scaling_factor": None}
    if rope_type == "llama3":
        def field(name: str, default: float) -> float:
            return params.get(name, scaling.get(name, default))

        return {"rope_theta": float(theta), "rope_scaling_factor": float(field("factor", 8.0)),
                "rope_scaling_low_freq_factor": float(field("low_freq_factor", 1.0)),
                "rope_scaling_high_freq_factor": float(field("high_freq_factor", 4.0)),
                "rope_scaling_original_max_position_embeddings": int(field("original_max_position_embeddings", 8192))}
    raise ConfigError(f"model.hf_path: rope_type {rope_type!r} is not supported by the Megatron learner; "
                      "supported: default, llama3")
