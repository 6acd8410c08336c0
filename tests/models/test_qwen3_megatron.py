"""Qwen3 dense and Llama-3 RoPE scaling on the Megatron learner, against transformers.

A tiny random Qwen3 (q_norm / k_norm over a head_dim of twice hidden / heads, random norm
weights: `tests/qwen3_dirs.py`) is converted HF -> Megatron -> HF at TP 2 and at PP 2 and
must come back bit for bit; the Megatron model's logits (the conversion's `verify`, which
runs the GPTModel the learner builds) equal transformers' Qwen3ForCausalLM's at TP 1 and TP 2.
A tiny Llama with rope_type "llama3" scaling (an original context of 64, so all three bands
of the rescaling fall inside the tiny head_dim's frequencies) gets transformers' logits too.
The default lane runs both models in one spawned learner rank (weights loaded through the
live mapping); the conversion round trips and `verify` at TP 1 / 2 are in the slow lane.
"""

from __future__ import annotations

import pytest
import torch
from qwen3_dirs import build_qwen3_dir

from dapo_mega.config import ConfigError, ModelConfig
from dapo_mega.models.shape import ModelShape
from dapo_mega.models.tiny import build_tiny_model_dir, tiny_hf_config
from dapo_mega.weights import convert, verify
from dapo_mega.weights import mapping as M
from dapo_mega.weights.hf_io import HFCheckpointReader

LOGITS_ATOL = 1e-4
"""fp32 on both sides; a missing or misplaced q/k norm moves logits by ~1e-1 here."""


def _assert_same_tensors(src, dst) -> None:
    a, b = HFCheckpointReader(src), HFCheckpointReader(dst)
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        assert torch.equal(a(name), b(name)), name


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_qwen3_dir(tmp_path_factory.mktemp("qwen3"), seed=0)


def test_qwen3_shape_reads_head_dim_and_qk_norm(qwen3_dir):
    shape = ModelShape.from_hf_config(qwen3_dir)
    assert shape.hf_architecture == "Qwen3ForCausalLM" and shape.qk_layernorm and not shape.qkv_bias
    assert shape.head_dim == 32 != shape.hidden_size // shape.num_attention_heads
    names = HFCheckpointReader(qwen3_dir).keys()
    q_norm, k_norm = (HFCheckpointReader(qwen3_dir)(f"model.layers.1.self_attn.{p}_norm.weight") for p in "qk")
    assert not torch.equal(q_norm, k_norm) and "model.layers.0.self_attn.q_proj.bias" not in names
    assert M.hf_names_of("decoder.layers.1.self_attention.k_layernorm.weight") == (
        "model.layers.1.self_attn.k_norm.weight",)


def _learner_logits_vs_transformers(rank, world, model_dirs):
    """max |Megatron - transformers| logits of each dir: the learner's GPTModel, loaded from the HF
    checkpoint through the live mapping (`load_hf_into_megatron`), on 32 tokens."""
    import warnings

    warnings.filterwarnings("ignore")
    from transformers import AutoModelForCausalLM

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.model import build_model
    from dapo_mega.config import MegatronConfig
    from dapo_mega.weights.stream import load_hf_into_megatron

    mcfg = MegatronConfig(transformer_impl="local")
    layout = ParallelLayout.from_config(mcfg, world, model_dirs[0]).initialize()
    ids = torch.randint(3, 99, (2, 32), generator=torch.Generator().manual_seed(0))
    diffs = []
    for model_dir in model_dirs:
        chunks, info = build_model(model_dir, mcfg, layout, initialize=False)
        load_hf_into_megatron(chunks, info, layout, HFCheckpointReader(model_dir))
        with torch.no_grad():
            got = verify.megatron_logits(chunks, info, ids)
            want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(ids).logits
        diffs.append(float((got - want).abs().max()))
    return diffs


def test_learner_logits_equal_transformers_qwen3_and_llama3_scaling(qwen3_dir, tmp_path):
    """One spawned learner rank: a Qwen3 and a Llama-3-scaled Llama, each within LOGITS_ATOL."""
    from dist_helpers import run_distributed

    llama = build_tiny_model_dir(tmp_path / "llama3", seed=2, architecture="llama", rope_scaling=LLAMA3_SCALING[0])
    diffs = run_distributed(_learner_logits_vs_transformers, 1, args=([str(qwen3_dir), str(llama)],))[0]
    assert max(diffs) < LOGITS_ATOL, diffs


@pytest.mark.slow  # four spawned conversions
def test_qwen3_import_tp2_export_tp1_exact_and_logits_equal_transformers_at_tp2(qwen3_dir, tmp_path):
    meg, out = tmp_path / "meg", tmp_path / "hf"
    imported = convert.import_hf_checkpoint(qwen3_dir, meg, tp=2, progress=False)
    assert imported.num_tensors == 3 + 2 * 11  # embed, norm, lm_head; 9 + q_norm, k_norm per layer
    convert.export_megatron_checkpoint(meg, out, tp=1, progress=False)
    _assert_same_tensors(qwen3_dir, out)
    verified = verify.verify_conversion(qwen3_dir, meg, tp=2, tolerance=LOGITS_ATOL)
    assert verified.passed and verified.max_abs_diff < LOGITS_ATOL, verified.lines()


@pytest.mark.slow
def test_qwen3_tied_import_pp2_export_pp2_exact(tmp_path):
    src = build_qwen3_dir(tmp_path / "tied", seed=4, tie_word_embeddings=True)
    assert "lm_head.weight" not in HFCheckpointReader(src).keys()
    meg, out = tmp_path / "meg", tmp_path / "hf"
    convert.import_hf_checkpoint(src, meg, pp=2, progress=False)
    convert.export_megatron_checkpoint(meg, out, pp=2, progress=False)
    _assert_same_tensors(src, out)


def test_qwen3_plan_sets_kv_channels_and_qk_layernorm_on_both_specs():
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.identity_op import IdentityOp

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.model import LOCAL_SPEC, NO_GPU, _layer_spec, plan_transformer_config
    from dapo_mega.config import MegatronConfig

    shape = ModelShape.from_hf_config(tiny_hf_config(ModelConfig(), architecture="qwen3"))
    plan = plan_transformer_config(shape, MegatronConfig(), ParallelLayout(world_size=1), has_gpu=False,
                                   te_error=NO_GPU)
    kw = plan.config_kwargs
    assert (kw["kv_channels"], kw["qk_layernorm"], kw["add_qkv_bias"]) == (32, True, False)
    assert TransformerConfig(activation_func=F.silu, **kw).kv_channels == 32
    attention = _layer_spec(LOCAL_SPEC, qk_layernorm=True).submodules.self_attention.submodules
    assert attention.q_layernorm is not IdentityOp and attention.k_layernorm is not IdentityOp
    assert _layer_spec(LOCAL_SPEC).submodules.self_attention.submodules.q_layernorm is IdentityOp


def test_qwen3_options_the_learner_does_not_compute_are_named():
    base = tiny_hf_config(ModelConfig(), architecture="qwen3").to_dict()
    with pytest.raises(ConfigError, match="model.hf_path: Qwen3 with attention_bias"):
        ModelShape.from_hf_config({**base, "attention_bias": True})
    with pytest.raises(ConfigError, match="use_sliding_window"):
        ModelShape.from_hf_config({**base, "use_sliding_window": True})
    from transformers import Qwen3Config

    with pytest.raises(M.UnsupportedArchitectureError, match="Qwen3ForCausalLM with attention_bias"):
        M.check_architecture(Qwen3Config(attention_bias=True, architectures=["Qwen3ForCausalLM"]))


LLAMA3_SCALING = [
    {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 128},
]


def test_llama3_rope_scaling_read_from_both_config_forms():
    scaling = LLAMA3_SCALING[1]
    shape = ModelShape.from_hf_config(tiny_hf_config(ModelConfig(), architecture="llama", rope_scaling=scaling))
    legacy = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 5e5,
              "rope_scaling": {"rope_type": "llama3", **scaling}}
    for got in (shape, ModelShape.from_hf_config(legacy)):
        assert (got.rope_scaling_factor, got.rope_scaling_low_freq_factor, got.rope_scaling_high_freq_factor,
                got.rope_scaling_original_max_position_embeddings) == (32.0, 2.0, 8.0, 128)


@pytest.mark.slow  # spawned conversions; the fast learner test covers LLAMA3_SCALING[0]
@pytest.mark.parametrize("scaling", LLAMA3_SCALING[1:], ids=["factor32_low2_high8"])
def test_llama3_rope_scaling_logits_equal_transformers(tmp_path, scaling):
    from transformers import AutoModelForCausalLM

    src = build_tiny_model_dir(tmp_path / "llama", seed=2, architecture="llama", rope_scaling=scaling)
    model = AutoModelForCausalLM.from_pretrained(src)
    plain = build_tiny_model_dir(tmp_path / "plain", seed=2, architecture="llama")
    ids = torch.arange(3, 35).unsqueeze(0)
    with torch.no_grad():
        scaling_effect = (model(ids).logits - AutoModelForCausalLM.from_pretrained(plain)(ids).logits).abs().max()
    meg, out = tmp_path / "meg", tmp_path / "hf"
    convert.import_hf_checkpoint(src, meg, progress=False)
    verified = verify.verify_conversion(src, meg, tp=1, tolerance=LOGITS_ATOL)
    assert verified.passed and verified.max_abs_diff < LOGITS_ATOL, verified.lines()
    # Megatron is 100x closer to transformers than the scaling moves the logits: plain RoPE would fail
    assert verified.max_abs_diff < scaling_effect / 100, (verified.max_abs_diff, float(scaling_effect))
    # the way back keeps every tensor and the scaling: transformers reads the export as the source
    convert.export_megatron_checkpoint(meg, out, progress=False)
    _assert_same_tensors(src, out)
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.config.rope_parameters == model.config.rope_parameters
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, model(ids).logits)
