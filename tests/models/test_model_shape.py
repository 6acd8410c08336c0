"""The one model-shape record against transformers' own configs and models.

`ModelShape` is read by the Megatron model provider, the weight mapping and `plan`; here
its numbers are checked against what transformers builds from the same config (tensor
shapes and parameter counts), for Qwen2, Qwen3 and Llama, tied and untied, GQA and MHA.
"""

from __future__ import annotations

import json

import pytest
import torch

from dapo_mega.config import ConfigError, ModelConfig
from dapo_mega.models.shape import ModelShape
from dapo_mega.models.tiny import tiny_hf_config
from dapo_mega.plan.memory import total_params
from dapo_mega.weights import mapping as M

CASES = [
    ("qwen2", dict(tiny_num_key_value_heads=2, tiny_tie_word_embeddings=False)),
    ("qwen2", dict(tiny_num_key_value_heads=4, tiny_tie_word_embeddings=True)),
    ("llama", dict(tiny_num_key_value_heads=1, tiny_tie_word_embeddings=False)),
    ("qwen3", dict(tiny_num_key_value_heads=2, tiny_tie_word_embeddings=False)),
    ("qwen3", dict(tiny_num_key_value_heads=4, tiny_tie_word_embeddings=True)),
]


def _hf(architecture: str, overrides: dict):
    mcfg = ModelConfig(tiny_num_layers=2, tiny_hidden_size=32, tiny_intermediate_size=48,
                       tiny_num_attention_heads=4, **overrides)
    return tiny_hf_config(mcfg, architecture=architecture)


@pytest.mark.parametrize("architecture, overrides", CASES)
def test_shape_matches_transformers_model(architecture, overrides):
    from transformers import AutoModelForCausalLM

    hf = _hf(architecture, overrides)
    shape = ModelShape.from_hf_config(hf)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf)
    state = model.state_dict()
    # every tensor of the real model has the shape the mapping expects of this record
    checked = 0
    for name, tensor in state.items():
        want = M.expected_hf_shape(name, shape)
        if want is not None:
            assert tuple(tensor.shape) == want, name
            checked += 1
    assert checked >= 2 + shape.num_layers * 9
    # the parameter count `plan` computes is the real model's (tied lm_head counted once)
    assert total_params(shape) == sum(p.numel() for p in model.parameters())
    assert shape.hf_architecture == type(model).__name__
    assert shape.num_key_value_heads == hf.num_key_value_heads
    assert shape.qkv_bias == ("model.layers.0.self_attn.q_proj.bias" in state)
    assert shape.qk_layernorm == ("model.layers.0.self_attn.q_norm.weight" in state)
    assert shape.head_dim == model.model.layers[0].self_attn.head_dim


def test_same_shape_from_config_object_dict_and_directory(tmp_path):
    hf = _hf("qwen2", {})
    (tmp_path / "config.json").write_text(json.dumps(hf.to_dict()))
    from_object = ModelShape.from_hf_config(hf)
    assert ModelShape.from_hf_config(hf.to_dict()) == from_object
    assert ModelShape.from_hf_config(tmp_path) == from_object
    assert ModelShape.from_hf_config(tmp_path / "config.json") == from_object


def test_padded_vocab_defaults_to_vocab_and_is_set_by_the_provider():
    shape = ModelShape.from_hf_config(_hf("qwen2", {}))
    assert shape.padded_vocab_size == shape.vocab_size
    padded = shape.with_padded_vocab(128)
    assert padded.padded_vocab_size == 128 and padded.vocab_size == shape.vocab_size
    assert padded.to_dict()["padded_vocab_size"] == 128
    with pytest.raises(ValueError, match="padded_vocab_size"):
        shape.with_padded_vocab(shape.vocab_size - 1)


def test_unsupported_model_type_is_a_config_error():
    with pytest.raises(ConfigError, match="model_type 'mistral'"):
        ModelShape.from_hf_config({"model_type": "mistral", "num_attention_heads": 4, "hidden_size": 8})
