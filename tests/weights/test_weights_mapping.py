"""Pure Megatron ⇄ HF mapping: fused QKV layout, gate/up, TP split/merge, vocab padding."""

import pytest
import torch

from dapo_mega.models.shape import ModelShape
from dapo_mega.weights import mapping as M


def _dims(**kw):
    base = dict(model_type="qwen2", num_layers=2, hidden_size=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=2, ffn_hidden_size=6, vocab_size=10, padded_vocab_size=12,
                tie_word_embeddings=False, qkv_bias=True)
    base.update(kw)
    return ModelShape(**base)


def test_fuse_qkv_matches_megatron_group_layout_by_hand():
    # nh=4 query heads, ng=2 groups, head_dim=1: rows q0 q1 k0 v0 | q2 q3 k1 v1.
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = M.fuse_qkv(q, k, v, num_attention_heads=4, num_query_groups=2, head_dim=1)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    q2, k2, v2 = M.split_qkv(fused, 4, 2, 1)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_fuse_qkv_head_dim_2_bias_and_mha():
    # head_dim 2, MHA (ng = nh = 2): rows q0a q0b k0a k0b v0a v0b | q1a q1b k1a k1b v1a v1b
    q = torch.tensor([1.0, 2.0, 3.0, 4.0])
    k = torch.tensor([5.0, 6.0, 7.0, 8.0])
    v = torch.tensor([9.0, 10.0, 11.0, 12.0])
    fused = M.fuse_qkv(q, k, v, 2, 2, 2)
    assert fused.tolist() == [1, 2, 5, 6, 9, 10, 3, 4, 7, 8, 11, 12]
    assert all(torch.equal(a, b) for a, b in zip(M.split_qkv(fused, 2, 2, 2), (q, k, v)))


def test_gate_up_tp_shards_are_gate_slice_then_up_slice():
    gate = torch.arange(4.0).reshape(4, 1)       # g0..g3
    up = torch.arange(10.0, 14.0).reshape(4, 1)  # u0..u3
    spec, _ = M.lookup("decoder.layers.0.mlp.linear_fc1.weight")
    fused = M.fuse_gate_up(gate, up)
    shards = [M.split_for_tp(fused, spec, 2, r) for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 10, 11]
    assert shards[1].flatten().tolist() == [2, 3, 12, 13]
    assert torch.equal(M.merge_tp_shards(shards, spec), fused)


@pytest.mark.parametrize("name,shape", [
    ("decoder.layers.3.self_attention.linear_qkv.weight", (16, 8)),
    ("decoder.layers.3.self_attention.linear_proj.weight", (8, 8)),
    ("decoder.layers.3.mlp.linear_fc2.weight", (8, 6)),
    ("embedding.word_embeddings.weight", (12, 8)),
    ("decoder.final_layernorm.weight", (8,)),
])
def test_tp_split_merge_round_trip(name, shape):
    spec, _ = M.lookup(name)
    full = torch.randn(shape)
    shards = [M.split_for_tp(full, spec, 2, r) for r in range(2)]
    if spec.tp_split == M.ROW:
        assert shards[0].shape[1] == shape[1] // 2
    assert torch.equal(M.merge_tp_shards(shards, spec), full)


def test_te_and_local_names_map_to_the_same_hf_name():
    assert M.hf_names_of("decoder.layers.5.self_attention.linear_qkv.layer_norm_weight") == \
        M.hf_names_of("decoder.layers.5.input_layernorm.weight") == ("model.layers.5.input_layernorm.weight",)
    assert M.hf_names_of("module.decoder.layers.1.mlp.linear_fc1.layer_norm_weight") == \
        ("model.layers.1.post_attention_layernorm.weight",)
    with pytest.raises(M.WeightMappingError, match="decoder.layers.0.foo.weight"):
        M.lookup("decoder.layers.0.foo.weight")


def test_hf_round_trip_with_vocab_padding_and_named_errors():
    dims = _dims()
    hf = {
        "model.embed_tokens.weight": torch.randn(10, 8),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 8),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(4, 8),
    }
    emb = M.hf_to_megatron_tensor("embedding.word_embeddings.weight", hf.__getitem__, dims)
    assert emb.shape == (12, 8) and torch.equal(emb[10:], torch.zeros(2, 8))
    back = dict(M.megatron_to_hf_tensors("embedding.word_embeddings.weight", emb, dims))
    assert torch.equal(back["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    qkv = M.hf_to_megatron_tensor("decoder.layers.0.self_attention.linear_qkv.weight", hf.__getitem__, dims)
    back = dict(M.megatron_to_hf_tensors("decoder.layers.0.self_attention.linear_qkv.weight", qkv, dims))
    assert all(torch.equal(back[k], hf[k]) for k in back)
    with pytest.raises(M.MissingHFTensorError, match="model.layers.0.self_attn.q_proj.bias"):
        M.hf_to_megatron_tensor("decoder.layers.0.self_attention.linear_qkv.bias", hf.__getitem__, dims)
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.randn(6, 8)
    with pytest.raises(M.WeightMappingError, match=r"k_proj.weight.*\(6, 8\).*\(4, 8\)"):
        M.hf_to_megatron_tensor("decoder.layers.0.self_attention.linear_qkv.weight", hf.__getitem__, dims)


def test_unsupported_architecture_is_named():
    with pytest.raises(M.UnsupportedArchitectureError, match="MistralForCausalLM"):
        M.check_architecture({"architectures": ["MistralForCausalLM"]})
    assert M.check_architecture("LlamaForCausalLM") == "LlamaForCausalLM"


def test_expert_names_map_by_global_index_in_both_spellings():
    """A Qwen3-MoE sparse layer: the router is replicated, each expert's fc1 holds its gate and
    up projections, and TE's grouped-GEMM spelling (`linear_fc1.weightK`) is the same tensor as
    the local spec's `local_experts.K.linear_fc1.weight`."""
    local = "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    assert M.canonical_megatron_name("module.decoder.layers.3.mlp.experts.linear_fc1.weight5") == local
    assert M.hf_names_of(local) == ("model.layers.3.mlp.experts.5.gate_proj.weight",
                                    "model.layers.3.mlp.experts.5.up_proj.weight")
    assert M.hf_names_of("decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight") == (
        "model.layers.3.mlp.experts.5.down_proj.weight",)
    assert M.hf_names_of("decoder.layers.3.mlp.router.weight") == ("model.layers.3.mlp.gate.weight",)
    assert M.expert_of(local) == (5, "linear_fc1.weight") and M.expert_of("decoder.layers.3.mlp.linear_fc1.weight") is None
    assert M.with_expert(local, 13) == "decoder.layers.3.mlp.experts.local_experts.13.linear_fc1.weight"
    spec, layer = M.lookup(local)
    assert (spec.tp_split, spec.fuse, layer) == (M.EXPERT, M.GATE_UP, 3)
    full = torch.arange(12.0).reshape(4, 3)
    assert M.split_for_tp(full, spec, 2, 1) is full  # expert TP 1: an expert is never cut over TP
