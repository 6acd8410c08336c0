"""Layout validation and the TransformerConfig/FP8 plan: pure functions, no process groups, no TE."""

from __future__ import annotations

import pytest
import torch

from dapo_mega.backends.megatron.layout import ParallelLayout
from dapo_mega.backends.megatron.model import (
    LOCAL_SPEC,
    NO_GPU,
    TE_SPEC,
    choose_layer_spec,
    pad_vocab_size,
    plan_transformer_config,
    probe_transformer_engine,
)
from dapo_mega.config import ConfigError, MegatronConfig, ModelConfig
from dapo_mega.models.shape import ModelShape
from dapo_mega.models.tiny import tiny_hf_config


def _hf(**overrides):
    model = ModelConfig(**overrides)
    return tiny_hf_config(model)


def test_heads_not_divisible_by_tp_fails_before_process_groups():
    hf = _hf(tiny_num_attention_heads=6, tiny_num_key_value_heads=6, tiny_hidden_size=48)
    layout = ParallelLayout.from_config(MegatronConfig(tensor_model_parallel_size=4), 4, hf)
    with pytest.raises(ConfigError, match="megatron.tensor_model_parallel_size.*num_attention_heads"):
        layout.initialize()  # validate() runs first and raises before torch.distributed starts
    assert not torch.distributed.is_initialized()


def test_query_groups_not_divisible_by_tp():
    hf = _hf(tiny_num_attention_heads=4, tiny_num_key_value_heads=1)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ParallelLayout.from_config(MegatronConfig(tensor_model_parallel_size=2), 2, hf).validate()


def test_layers_not_divisible_by_pp_names_the_field():
    hf = _hf(tiny_num_layers=3)
    with pytest.raises(ConfigError, match="megatron.pipeline_model_parallel_size.*3 layers"):
        ParallelLayout.from_config(MegatronConfig(pipeline_model_parallel_size=2), 2, hf).validate()
    mcfg = MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="megatron.virtual_pipeline_model_parallel_size"):
        ParallelLayout.from_config(mcfg, 2, _hf(tiny_num_layers=2)).validate()


def test_world_size_must_equal_product():
    layout = ParallelLayout(world_size=3, tp=2, pp=1, dp=1)
    with pytest.raises(ConfigError, match="tp\\*pp\\*cp\\*dp"):
        layout.validate()
    ok = ParallelLayout.from_config(MegatronConfig(tensor_model_parallel_size=2), 4, _hf()).validate()
    assert ok.dp == 2


def test_rope_theta_read_from_transformers5_and_config_json_forms():
    hf = _hf()
    hf_dict = hf.to_dict()
    assert ModelShape.from_hf_config(hf).rope_theta == 10000.0
    legacy = {k: v for k, v in hf_dict.items() if k != "rope_parameters"}
    legacy.update(rope_theta=1e6)
    assert ModelShape.from_hf_config(legacy).rope_theta == 1e6
    llama = tiny_hf_config(ModelConfig(), architecture="llama")
    arch = ModelShape.from_hf_config(llama)
    assert arch.model_type == "llama" and not arch.qkv_bias and ModelShape.from_hf_config(hf).qkv_bias


def test_vocab_padding():
    assert pad_vocab_size(99, 1) == 128
    assert pad_vocab_size(99, 2) == 256
    assert pad_vocab_size(152064, 4) == 152064  # Qwen2.5-32B: already a multiple of 512 = 297·512
    assert pad_vocab_size(152064, 8) == 152576  # 149·1024
    assert pad_vocab_size(151936, 8) == 152576


def _layout():
    return ParallelLayout(world_size=8, tp=2, pp=2, dp=2)


def test_cpu_plan_is_local_spec_fp32_without_fusions():
    arch = ModelShape.from_hf_config(_hf())
    plan = plan_transformer_config(arch, MegatronConfig(), _layout(), has_gpu=False, te_error=NO_GPU)
    kw = plan.config_kwargs
    assert plan.layer_spec == LOCAL_SPEC and plan.params_dtype == "float32"
    assert kw["use_cpu_initialization"] and not kw["bf16"] and "fp8" not in kw
    assert kw["num_query_groups"] == 2 and kw["add_qkv_bias"] and kw["gated_linear_unit"]
    assert kw["normalization"] == "RMSNorm" and kw["layernorm_epsilon"] == 1e-6
    assert kw["calculate_per_token_loss"] is True
    with pytest.raises(ConfigError, match="megatron.fp8.enabled"):
        mcfg = MegatronConfig()
        mcfg.fp8.enabled = True
        plan_transformer_config(arch, mcfg, _layout(), has_gpu=False, te_error=NO_GPU)


def test_gpu_plan_te_bf16_and_fp8_recipes():
    arch = ModelShape.from_hf_config(_hf(tiny_num_layers=4))
    bf16 = plan_transformer_config(arch, MegatronConfig(), _layout(), has_gpu=True, te_error=None)
    assert bf16.layer_spec == TE_SPEC and bf16.params_dtype == "bfloat16" and bf16.config_kwargs["bf16"]
    assert not bf16.config_kwargs["use_cpu_initialization"]
    local = plan_transformer_config(arch, MegatronConfig(transformer_impl="local"), _layout(), has_gpu=True,
                                    te_error=TE_ABI_ERROR)
    assert local.layer_spec == LOCAL_SPEC and local.params_dtype == "bfloat16"  # asked for by name

    mcfg = MegatronConfig(transformer_impl="transformer_engine")
    mcfg.fp8.enabled, mcfg.fp8.format, mcfg.fp8.recipe = True, "hybrid", "tensorwise"
    mcfg.fp8.num_layers_at_start_in_bf16, mcfg.fp8.num_layers_at_end_in_bf16 = 1, 1
    plan = plan_transformer_config(arch, mcfg, _layout(), has_gpu=True, te_error=None)
    kw = plan.config_kwargs
    assert (kw["fp8"], kw["fp8_recipe"], kw["fp8_amax_history_len"]) == ("hybrid", "tensorwise", 1024)
    assert kw["first_last_layers_bf16"] and kw["num_layers_at_start_in_bf16"] == 1
    assert kw["num_layers_at_end_in_bf16"] == 1

    # megatron-core rejects bf16 edge layers with delayed scaling: dropped with a note.
    mcfg.fp8.recipe = "delayed"
    plan = plan_transformer_config(arch, mcfg, _layout(), has_gpu=True, te_error=None)
    assert plan.config_kwargs["fp8_recipe"] == "delayed" and "first_last_layers_bf16" not in plan.config_kwargs
    assert plan.notes and "delayed" in plan.notes[0]

    with pytest.raises(ConfigError, match="megatron.transformer_impl.*undefined symbol"):
        plan_transformer_config(arch, mcfg, _layout(), has_gpu=True, te_error=TE_ABI_ERROR)


TE_ABI_ERROR = "ImportError: transformer_engine_torch.so: undefined symbol: _ZN3c104cuda9SetDeviceEib"
"""What TE 2.9 built against one torch says when imported under another (a simulated failure)."""


def test_auto_on_a_gpu_refuses_with_te_import_error_instead_of_the_local_spec():
    """The local spec asserts on sequence_parallel (every GPU experiment sets it): a fallback
    would show that message, never TE's. On the CPU auto keeps the local spec."""
    arch = ModelShape.from_hf_config(_hf())
    for impl in ("auto", "transformer_engine"):
        with pytest.raises(ConfigError) as err:
            plan_transformer_config(arch, MegatronConfig(transformer_impl=impl), _layout(), has_gpu=True,
                                    te_error=TE_ABI_ERROR)
        text = str(err.value)
        assert text.startswith("megatron.transformer_impl") and TE_ABI_ERROR in text, text
        assert "constraints-gpu.txt" in text and "megatron.transformer_impl=local" in text, text
    assert choose_layer_spec("auto", has_gpu=True, te_error=None) == TE_SPEC
    assert choose_layer_spec("auto", has_gpu=False, te_error=NO_GPU) == LOCAL_SPEC
    assert choose_layer_spec("local", has_gpu=True, te_error=TE_ABI_ERROR) == LOCAL_SPEC
    with pytest.raises(ConfigError, match="needs a GPU"):
        choose_layer_spec("transformer_engine", has_gpu=False, te_error=NO_GPU)


def test_te_import_failure_is_logged_and_returned(capsys):
    """A simulated import failure: its type and message are logged (stderr) and returned."""
    def failing_import(name):
        assert name == "transformer_engine.pytorch"
        raise OSError("libcudnn_engines_precompiled.so.9: cannot open shared object file")

    error = probe_transformer_engine(failing_import)
    assert error == "OSError: libcudnn_engines_precompiled.so.9: cannot open shared object file"
    assert error in capsys.readouterr().err
    assert probe_transformer_engine(lambda name: None) is None
    assert capsys.readouterr().err == ""


def test_plan_kwargs_are_accepted_by_megatron_transformer_config():
    """The real TransformerConfig accepts the planned kwargs (FP8 fields included) on the CPU."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    arch = ModelShape.from_hf_config(_hf(tiny_num_layers=4))
    mcfg = MegatronConfig(transformer_impl="transformer_engine")
    mcfg.fp8.enabled, mcfg.fp8.recipe = True, "tensorwise"
    plan = plan_transformer_config(arch, mcfg, ParallelLayout(world_size=1), has_gpu=True, te_error=None)
    kw = dict(plan.config_kwargs, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    config = TransformerConfig(activation_func=F.silu, **kw)
    assert config.fp8 == "e4m3" and config.first_last_layers_bf16 and config.num_query_groups == 2


def test_sequence_parallel_with_the_local_spec_is_refused_before_the_model_is_built():
    """The recipes' sequence_parallel=true on the local spec (a CPU twin, or transformer_impl=local)
    reached megatron-core's WrappedTorchNorm, whose assert ("sequence parallel not supported by torch
    LayerNorm") killed every learner rank at model build under Slurm; now the preflight names it."""
    import inspect

    from megatron.core.transformer.torch_norm import WrappedTorchNorm  # the norm that refuses, read here

    assert "not config.sequence_parallel" in inspect.getsource(WrappedTorchNorm)
    arch = ModelShape.from_hf_config(_hf())
    layout = ParallelLayout(world_size=8, tp=2, pp=2, dp=2, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"^megatron.sequence_parallel: true, but the local layer spec"):
        plan_transformer_config(arch, MegatronConfig(sequence_parallel=True), layout, has_gpu=False, te_error=NO_GPU)
    with pytest.raises(ConfigError, match=r"^megatron.sequence_parallel"):
        plan_transformer_config(arch, MegatronConfig(sequence_parallel=True, transformer_impl="local"), layout,
                                has_gpu=True, te_error=None)
    te = plan_transformer_config(arch, MegatronConfig(sequence_parallel=True), layout, has_gpu=True, te_error=None)
    assert te.config_kwargs["sequence_parallel"] is True
