"""`dapo-mega plan` against memory figures computed by hand for the 32B reproduction."""

from __future__ import annotations

import json

import pytest

from dapo_mega.cli import main as cli_main
from dapo_mega.config import load_config
from dapo_mega.plan.memory import compute_plan

GIB = 1024 ** 3


def test_qwen32b_parameter_count_matches_the_published_size():
    # per layer: q 5120*5120 + k,v 2*5120*1024 + o 5120*5120            = 62,914,560
    #            QKV bias 5120 + 2*1024                                  =      7,168
    #            SwiGLU 3*5120*27648                                     = 424,673,280
    #            two RMSNorms 2*5120                                     =     10,240
    #            → 487,605,248; x64 layers                               = 31,206,735,872
    # embedding + untied output 2*152064*5120 = 1,557,135,360; final norm 5120
    expected = 31_206_735_872 + 1_557_135_360 + 5_120
    assert expected == 32_763_876_352  # "32.8B" on the Qwen2.5-32B model card
    plan = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b"]))
    assert plan.model.source == "table"  # no /models/Qwen2.5-32B here
    assert plan.total_params == expected


# The hand computation of docs/cluster.md ("Memory by hand"), its results as literals.
HAND = {
    "params": (2_048_356_352, 2_048_361_472),
    "model_state_bytes": (15_362_672_640, 15_362_711_040),
    "per_layer_activation_bytes": (675_231_744, 675_231_744),
    "activation_kept_bytes": (1_845_493_760, 980_418_560),
    "recompute_bytes": (1_373_059_072, 1_373_059_072),
    "logits_bytes": (0, 2_187_599_872),
    "total_bytes": (18_581_225_472, 18_530_729_472),
}


def _within(value, hand, rel=0.10):
    return abs(value - hand) <= rel * hand


def test_qwen32b_colocated_plan_matches_the_hand_computation_in_docs():
    plan = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b"]))
    p = plan.parallel
    assert (p.tp, p.pp, p.dp, p.world_size) == (8, 2, 8, 128)  # 128 GPUs / (8*2)
    for stage in plan.learner_memory.stages:
        for key, hand in HAND.items():
            value = getattr(stage, key)
            assert _within(value, hand[stage.stage]), (stage.stage, key, value, hand)
        assert stage.fp8_cache_bytes == 0
    stage0, stage1 = plan.learner_memory.stages
    assert stage0.params == 2_048_356_352 and stage1.params == 2_048_361_472  # exact: counting
    assert plan.learner_memory.per_layer_activation_s_h_over_t == pytest.approx(46.8, abs=0.05)  # not 34
    assert plan.learner_memory.worst_stage == 0
    # KV room per engine: 4 GPUs x (0.6 x free at start - 2*Phi/4), free at start 67,852,280,320
    eng = plan.engines
    assert _within(eng.kv_room_bytes, 97_317_720_064) and eng.kv_room_bytes / GIB < 92  # 131 GiB before
    assert eng.kv_bytes_per_token == 262_144
    assert _within(eng.kv_tokens, 371_237)
    assert _within(eng.weights_per_gpu_bytes, 16_381_938_176)
    for fit in eng.colocated:  # one GPU during rollout: 59.9 of 80 GiB; training 19.8
        assert _within(fit.rollout_bytes, 64_282_417_971)
        assert _within(fit.kv_fresh, 25_558_446_899)
        assert _within(fit.training_bytes, 21_265_580_032)
    ck = plan.checkpoint
    assert _within(ck.bytes, 458_694_268_928) and _within(ck.disk_peak_bytes, 2_752_165_613_568)
    assert ck.keep_last_k == 3
    ram = plan.conversion_host_ram
    # by hand (docs/cluster.md): 8 x (0.4 + 65.5 / 8 + 2 x 1.56) GB; verify in fp32 0.4 + 131.1 + 3.1 GB,
    # in bf16 0.4 + 65.5 + 1.56 GB
    assert _within(ram.import_export.total_bytes, 93.8e9) and _within(ram.verify_stored.total_bytes, 67.5e9)
    assert _within(ram.verify.total_bytes, 134.6e9)
    assert plan.weight_sync.bytes_per_step == 2 * 32_763_876_352
    assert plan.warnings == []  # learner and engine fit together, by SGLang's formula too


def test_fp8_adds_weight_caches_and_context_parallel_is_refused_as_the_learner_does():
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import check_learner_supports
    from dapo_mega.config import ConfigError

    fp8 = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b_fp8"]))
    for stage in fp8.learner_memory.stages:  # FP8 copy + transpose of 32 layers' linear weights
        assert _within(stage.fp8_cache_bytes, 3_900_702_720)
        assert _within(stage.total_bytes, HAND["total_bytes"][stage.stage] + 3_900_702_720)
    cfg = load_config(["+experiment=dapo_qwen2.5_32b", "megatron.context_parallel_size=2"])
    with pytest.raises(ConfigError) as planned:
        compute_plan(cfg)
    with pytest.raises(ConfigError) as learner:
        check_learner_supports(ParallelLayout.from_config(cfg.megatron, 128))
    assert str(planned.value) == str(learner.value)
    assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b", "megatron.context_parallel_size=2"]) == 2


def test_plan_warns_when_learner_and_engine_do_not_fit_on_one_gpu():
    # f = 0.95: the first job's pool 0.95 x 69.9e9 - 16.4e9 = 50.0e9; beside the learner's
    # 15.4e9, 2.7e9 of contexts, 16.4e9 of weights, 3.2e9 of graphs, 1.1e9 of sync buckets: 88.8e9 > 85.9e9
    plan = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b", "rollout.mem_fraction_static=0.95"]))
    assert any(w.startswith("learner and engine do not fit together on a stage-1 GPU during rollout")
               for w in plan.warnings), plan.warnings
    assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b", "rollout.mem_fraction_static=0.95"]) == 1
    disagg = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b_disagg"]))
    assert disagg.engines.colocated == []  # engine GPUs hold no learner: 0.85 x (80 - 1) GiB - weights
    assert _within(disagg.engines.kv_per_gpu_bytes, 0.85 * 79 * GIB - 16_381_938_176)


def test_plan_warns_on_cross_node_tp_idle_engines_and_oom():
    cfg = load_config(["+experiment=dapo_qwen2.5_32b", "megatron.tensor_model_parallel_size=16",
                       "megatron.pipeline_model_parallel_size=1", "rollout.num_engines=8",
                       "megatron.recompute_granularity=null", "cluster.gpu_memory_gib=24"])
    plan = compute_plan(cfg)
    warnings = "\n".join(plan.warnings)
    assert "TP 16 crosses nodes" in warnings
    assert "engines idle GPUs: 96 of 128" in warnings  # 8 engines x 4 GPUs of 128
    assert "learner does not fit" in warnings
    # the memory (and the heads TP 16 cannot split) block the run, a launcher refuses on them;
    # crossing nodes and idle GPUs are advice
    blocking = [w.split(":")[0] for w in plan.blocking]
    assert "learner does not fit" in blocking and any("do not split over TP 16" in w for w in plan.blocking)
    assert not any("crosses nodes" in w or "engines idle GPUs" in w for w in plan.blocking), plan.blocking
    assert set(plan.blocking) < set(plan.warnings)
    assert plan.to_dict()["blocking"] == plan.blocking
    disagg = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b_disagg", "cluster.max_staleness=0"]))
    assert any("engines idle while learners train" in w for w in disagg.warnings)
    assert disagg.parallel.dp == 4 and disagg.cluster.learner_nodes == 8
    assert disagg.layout[8].roles == ["engines 0-1 (TP 4)"]


def test_plan_reads_hf_config_json(tmp_path):
    config = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = compute_plan(load_config([f"model.hf_path={tmp_path}", "model.name=mine"]))
    # 4 x (256*256*2 + 2*256*64 + bias 256+128 + 3*256*512 + 2*256) + tied 1000*256 + 256
    per_layer = 256 * 256 * 2 + 2 * 256 * 64 + 384 + 3 * 256 * 512 + 512
    assert plan.model.source == "hf_config"
    assert plan.total_params == 4 * per_layer + 256_000 + 256


def test_plan_cli_json_and_exit_status(capsys):
    assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parallel"]["tp"] == 8 and len(out["layout"]) == 16
    checkpoint = out["checkpoint"]  # bf16 model 2 + fp32 master, m, v 12 bytes per parameter; 3 kept + 1 written
    # + steps 100 and 200 of 313 that keep_every: 100 keeps (300 is among the newest 3)
    assert checkpoint["bytes"] == 14 * 32_763_876_352 and checkpoint["disk_peak_bytes"] == 6 * 14 * 32_763_876_352
    assert checkpoint["kept_for_good"] == 2
    assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b"]) == 0
    text = capsys.readouterr().out
    assert "checkpoints: 458.7 GB each" in text and "2 kept by keep_every: 2.75 TB on disk" in text
    assert "46.8*s*h/t" in text and "colocated stage-1 GPU, rollout:" in text
    assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b", "cluster.gpu_memory_gib=16"]) == 1
    assert "WARNING: learner does not fit" in capsys.readouterr().out


def test_the_weight_update_groups_nccl_buffers_come_out_of_the_engines_share_outside_its_pool(monkeypatch):
    """Issue #37 item 5: an engine GPU joins one NCCL weight-update group per learner PP stage
    (disaggregated), after SGLang sized its pool, so the groups' buffers come out of the
    (1 - mem_fraction_static) share beside CUDA graphs. With that share set between what the
    graphs alone and the graphs plus two groups need, the 32B disaggregated recipe (PP 2)
    warns, naming the groups; without the groups it would not. Colocated runs join none."""
    import dapo_mega.plan.memory as memory

    cfg = load_config(["+experiment=dapo_qwen2.5_32b_disagg"])
    assert memory.weight_update_groups_per_engine_gpu(cfg) == cfg.megatron.pipeline_model_parallel_size == 2
    assert memory.weight_update_groups_per_engine_gpu(load_config(["+experiment=dapo_qwen2.5_32b"])) == 0
    free = memory.engine_kv_room(cfg, memory.total_params(memory.resolve_model_shape(cfg)[0]), 0.0).free_at_start
    share = (memory.ENGINE_RUNTIME_GIB + memory.WEIGHT_UPDATE_GROUP_GIB) * memory.GIB  # between 3.0 and 3.5 GiB
    cfg.rollout.mem_fraction_static = 1 - share / free
    plan = compute_plan(cfg)
    assert plan.engines.weight_update_groups == 2
    assert plan.engines.outside_pool_bytes < plan.engines.outside_pool_needed_bytes
    assert any("2 weight-update group(s)' NCCL buffers" in w for w in plan.warnings), plan.warnings
    monkeypatch.setattr(memory, "WEIGHT_UPDATE_GROUP_GIB", 0.0)
    assert not any("weight-update group" in w for w in compute_plan(cfg).warnings)


def _tiny_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False)
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


@pytest.mark.parametrize("overrides", [{}, {"decoder_sparse_step": 2, "mlp_only_layers": []},
                                       {"tie_word_embeddings": True}])
def test_moe_parameters_are_transformers_own_count(overrides):
    """Issue #38 item 7: a Qwen3-MoE's total parameters are the ones transformers'
    Qwen3MoeForCausalLM holds (dense MLP layers, sparse layers with a router and routed
    experts), and its active ones leave out the experts a token is not routed to."""
    import torch
    from transformers import AutoModelForCausalLM

    from dapo_mega.models.shape import ModelShape
    from dapo_mega.plan.memory import active_params, total_params

    hf = _tiny_moe_config(**overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    experts = sum(p.numel() for n, p in named.items() if ".mlp.experts." in n)
    shape = ModelShape.from_hf_config(hf.to_dict())
    assert shape.is_moe and experts > 0
    assert total_params(shape) == total
    assert active_params(shape) == total - experts * (hf.num_experts - hf.num_experts_per_tok) // hf.num_experts


def test_the_plan_of_qwen3_30b_a3b_prints_its_total_and_active_parameters_and_refuses_experts_that_do_not_split(
        tmp_path):
    """30.5 B parameters and 3.3 B active (Qwen's model card: 30.5B, 3.3B activated), from the
    table and from a config.json with the published fields; EP shards the experts' memory and
    is refused where it does not divide them, or on a dense model, naming the field."""
    import json

    from dapo_mega.config import ConfigError

    plan = compute_plan(load_config(["model=qwen3_30b_a3b"]))
    assert round(plan.total_params / 1e9, 1) == 30.5 and 3.3 <= plan.active_params / 1e9 < 3.4
    published = _tiny_moe_config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                 num_experts=128, num_experts_per_tok=8, mlp_only_layers=[]).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(published))
    from_json = compute_plan(load_config(["model=qwen3_30b_a3b", f"model.hf_path={tmp_path}"]))
    assert (from_json.total_params, from_json.active_params) == (plan.total_params, plan.active_params)
    assert "30.53 B params (3.35 B active: 8 of 128 experts per token)" in \
        __import__("dapo_mega.plan.memory", fromlist=["format_plan"]).format_plan(plan)
    one, eight = (compute_plan(load_config(["model=qwen3_30b_a3b", f"megatron.expert_model_parallel_size={ep}"]))
                  for ep in (1, 8))
    experts = 48 * 128 * 3 * 2048 * 768  # 29.0 B of the 30.5: EP 8 keeps 16 of each layer's 128 experts per GPU
    assert one.learner_memory.stages[0].params - eight.learner_memory.stages[0].params == experts * 7 // 8
    with pytest.raises(ConfigError, match=r"megatron.expert_model_parallel_size: 3 does not divide the model's 128"):
        compute_plan(load_config(["model=qwen3_30b_a3b", "megatron.expert_model_parallel_size=3"]))
    with pytest.raises(ConfigError, match=r"megatron.expert_model_parallel_size: 2 for a dense model"):
        compute_plan(load_config(["+experiment=dapo_qwen2.5_32b", "megatron.expert_model_parallel_size=2"]))


def test_a_mixture_of_experts_becomes_megatron_cores_moe_config_and_its_layout_is_checked():
    """Every entry point builds through `plan_transformer_config`: a Qwen3-MoE's routing becomes
    megatron-core's (the sparse layers from decoder_sparse_step / mlp_only_layers, renormalised
    top-k as softmax over the chosen logits, grouped GEMM with TE only), at the layout's EP."""
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.model import LOCAL_SPEC, TE_SPEC, moe_config_kwargs, plan_transformer_config
    from dapo_mega.config import ConfigError, MegatronConfig
    from dapo_mega.models.shape import ModelShape

    hf = _tiny_moe_config(decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True).to_dict()
    shape = ModelShape.from_hf_config(hf)
    mcfg = MegatronConfig(expert_model_parallel_size=2)
    kwargs = plan_transformer_config(shape, mcfg, ParallelLayout.from_config(mcfg, 2, hf).validate(), False,
                                     None).config_kwargs
    assert kwargs["moe_layer_freq"] == [0, 1, 0, 0]  # HF: (i + 1) % 2 == 0 and i not in mlp_only_layers
    assert (kwargs["num_moe_experts"], kwargs["moe_router_topk"], kwargs["moe_ffn_hidden_size"]) == (8, 2, 32)
    assert kwargs["moe_router_pre_softmax"] is False and kwargs["expert_model_parallel_size"] == 2
    assert kwargs["moe_grouped_gemm"] is False and moe_config_kwargs(shape, 2, TE_SPEC)["moe_grouped_gemm"] is True
    unnormalised = ModelShape.from_hf_config(_tiny_moe_config(norm_topk_prob=False).to_dict())
    assert moe_config_kwargs(unnormalised, 1, LOCAL_SPEC)["moe_router_pre_softmax"] is True
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size: 3 does not divide the model's 8 experts"):
        ParallelLayout.from_config(MegatronConfig(expert_model_parallel_size=3), 3, hf).validate()
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size: 4 does not divide TP x CP x DP = 2"):
        ParallelLayout.from_config(MegatronConfig(expert_model_parallel_size=4), 2, hf).validate()
    # megatron-core's MoE layer refuses to train at TP > 1 without sequence parallelism: said before it starts
    with pytest.raises(ConfigError, match=r"^megatron.sequence_parallel: false with TP 2 for a mixture of experts"):
        ParallelLayout.from_config(MegatronConfig(tensor_model_parallel_size=2), 2, hf).validate()
    ParallelLayout.from_config(MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True), 2, hf).validate()


def test_the_plan_prints_what_each_cpu_sglang_engine_takes():
    """Issue #45 item 3: SGLang on a CPU is capped at the run's need (the fleet's --max-total-tokens),
    and the plan counts that pool, not mem_fraction_static of the host: by hand, the tiny
    default's 2 layers x K and V x 2 KV heads x 16 dims x 2 bytes (bf16) = 256 bytes per token."""
    from dapo_mega.plan.memory import format_plan

    cfg = load_config(["rollout.backend=sglang", "cluster.mode=colocated", "cluster.device=cpu",
                       "rollout.max_running_requests=64", "algo.max_prompt_length=100", "algo.max_response_length=300"])
    plan = compute_plan(cfg)
    eng = plan.engines
    assert eng.cpu_pool_cap_tokens == 32_000 and eng.kv_tokens == 32_000  # 64 x 400 x 1.25
    assert eng.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert eng.kv_room_bytes == 32_000 * eng.kv_bytes_per_token
    assert all(f.kv_fresh <= eng.kv_room_bytes for f in eng.colocated)
    line = next(ln for ln in format_plan(plan).splitlines() if "SGLang engine's pool is capped" in ln)
    assert f"capped at 32,000 tokens = {32_000 * eng.kv_bytes_per_token / 2**20:,.1f} MiB of host memory" in line
    gpu = compute_plan(load_config(["rollout.backend=sglang", "cluster.mode=colocated"]))
    assert gpu.engines.cpu_pool_cap_tokens == 0 and gpu.engines.kv_tokens > 32_000
