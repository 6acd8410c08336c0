"""`dapo-mega plan` against memory figures computed by hand for the 32B reproduction."""

from __future__ import annotations

import json

import pytest

from dapo_mega.cli import main as cli_main
from dapo_mega.config import load_config
from dapo_mega.plan import compute_plan, total_params

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
    assert plan["model"]["source"] == "table"  # no /models/Qwen2.5-32B here
    assert plan["total_params"] == expected


def test_qwen32b_colocated_plan_matches_hand_computed_memory():
    plan = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b"]))
    p = plan["parallel"]
    assert (p["tp"], p["pp"], p["dp"], p["world_size"]) == (8, 2, 8, 128)  # 128 GPUs / (8*2)
    stage0, stage1 = plan["learner_memory"]["stages"]
    # stage 0: 32 layers x (487,595,008 TP-sharded / 8 + 10,240 norms) + embedding 152064/8*5120
    #        = 32 * 60,959,616 + 97,320,960 = 2,048,028,672 ; stage 1 adds the final norm instead
    assert stage0["params"] == 2_048_028_672
    assert stage1["params"] == 2_048_028_672 + 5_120
    # model state: bf16 param 2 + fp32 grad 4 + (master 4 + m 4 + v 4) / DP 8 = 7.5 bytes/param
    assert stage1["model_state_bytes"] == pytest.approx(2_048_033_792 * 7.5)
    assert stage1["model_state_bytes"] / GIB == pytest.approx(14.305, abs=1e-3)
    assert stage1["optimizer_bytes"] == pytest.approx(2_048_033_792 * 1.5)
    # activations, s = 22528 tokens, h = 5120, SP on, full recompute:
    #   kept layer input 2*s*h/8 = 28,835,840 ; one recomputed layer s*h*34/8 = 490,209,280
    #   stage 0: 32 layers x 2 micro-batches in flight x 28,835,840 + 490,209,280 = 2,335,703,040
    #   stage 1: 32 x 1 x 28,835,840 + 490,209,280 + fp32 logits 4*22528*(152064/8) 1,712,848,896
    assert stage0["activation_bytes"] == 2_335_703_040
    assert stage1["activation_bytes"] == 922_746_880 + 490_209_280 + 1_712_848_896
    assert plan["learner_memory"]["worst_stage"] == 1
    assert plan["learner_memory"]["worst_total_gib"] == pytest.approx((15_360_253_440 + 3_125_805_056) / GIB)
    # KV room per engine (TP 4): 4 x min(0.6 x 80 GiB, 80 GiB - 15,360,253,440 resident) - 2 x 32,763,876,352
    room = 4 * 0.6 * 80 * GIB - 2 * 32_763_876_352
    assert plan["engines"]["kv_room_bytes"] == pytest.approx(room)
    # K+V x 64 layers x (8 KV heads / 4) x 128 x 2 bytes = 65,536 per GPU, x4 GPUs per engine
    assert plan["engines"]["kv_bytes_per_token"] == 262_144
    assert plan["engines"]["kv_tokens"] == int(room // 262_144) == 536_463
    assert plan["weight_sync"]["bytes_per_step"] == 2 * 32_763_876_352
    assert plan["warnings"] == []


def test_plan_warns_on_cross_node_tp_idle_engines_and_oom():
    cfg = load_config(["+experiment=dapo_qwen2.5_32b", "megatron.tensor_model_parallel_size=16",
                       "megatron.pipeline_model_parallel_size=1", "rollout.num_engines=8",
                       "megatron.recompute_granularity=null", "cluster.gpu_memory_gib=24"])
    warnings = "\n".join(compute_plan(cfg)["warnings"])
    assert "TP 16 crosses nodes" in warnings
    assert "engines idle GPUs: 96 of 128" in warnings  # 8 engines x 4 GPUs of 128
    assert "learner does not fit" in warnings
    disagg = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b_disagg", "cluster.max_staleness=0"]))
    assert any("engines idle while learners train" in w for w in disagg["warnings"])
    assert disagg["parallel"]["dp"] == 4 and disagg["cluster"]["learner_nodes"] == 8
    assert disagg["layout"][8]["roles"] == ["engines 0-1 (TP 4)"]


def test_plan_reads_hf_config_json(tmp_path):
    config = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = compute_plan(load_config([f"model.hf_path={tmp_path}", "model.name=mine"]))
    # 4 x (256*256*2 + 2*256*64 + bias 256+128 + 3*256*512 + 2*256) + tied 1000*256 + 256
    per_layer = 256 * 256 * 2 + 2 * 256 * 64 + 384 + 3 * 256 * 512 + 512
    assert plan["model"]["source"] == "hf_config"
    assert plan["total_params"] == 4 * per_layer + 256_000 + 256


def test_plan_cli_json_and_exit_status(capsys):
    assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parallel"]["tp"] == 8 and len(out["layout"]) == 16
    assert cli_main(["plan", "+experiment=dapo_qwen2.5_32b", "cluster.gpu_memory_gib=16"]) == 1
    assert "WARNING: learner does not fit" in capsys.readouterr().out
