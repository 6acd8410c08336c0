"""Reading a Hugging Face causal-LM config (Qwen2 / Qwen2.5 / Llama) into plain numbers.

Accepts a transformers `PretrainedConfig`, a dict (the parsed config.json) or a path to a
checkpoint directory / config.json. Nothing here imports megatron.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from dapo_mega.config import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


@dataclass(frozen=True)
class HFArch:
    """The architecture numbers the Megatron model provider needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: Optional[float]
    """Llama-3.1 style RoPE scaling factor (rope_type "llama3"); None = plain RoPE."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool


def hf_config_to_dict(hf_config: Any) -> Dict[str, Any]:
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


def _rope(cfg: Dict[str, Any]) -> tuple[float, Optional[float]]:
    """RoPE θ and Llama-3 scaling factor.

    transformers 5 stores RoPE as `rope_parameters = {"rope_theta": θ, "rope_type": ...,
    (scaling fields)}`; transformers 4 config.json files have top-level `rope_theta` and an
    optional `rope_scaling` dict with `rope_type` (or the older key `type`).
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        factor = params.get("factor", scaling.get("factor", 8.0))
        return float(theta), float(factor)
    raise ConfigError(f"model.hf_path: rope_type {rope_type!r} is not supported by the Megatron learner; "
                      "supported: default, llama3")


def read_hf_arch(hf_config: Any) -> HFArch:
    """Parse a Qwen2/Qwen2.5/Llama config; raises ConfigError for other model types."""
    cfg = hf_config_to_dict(hf_config)
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model.hf_path: model_type {model_type!r} is not supported; "
                          f"use one of {SUPPORTED_MODEL_TYPES}")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, factor = _rope(cfg)
    return HFArch(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling_factor=factor,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has QKV bias (there is no config switch); Llama follows attention_bias.
        qkv_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )
