"""The Qwen3-8B scale-down (configs/experiment/dapo_qwen3_8b.yaml) against the 32B recipe and
the published Qwen3-8B config.json: it differs from dapo_qwen2.5_32b only where its header
says, its learner layout divides the published head counts, and `plan`'s table of the
model is the shape transformers builds from those published sizes."""

from __future__ import annotations

from test_recipe_pins import check_run_pins, check_variant_of_32b

from dapo_mega.config import load_config
from dapo_mega.models.shape import ModelShape
from dapo_mega.plan.memory import KNOWN_MODELS, total_params

# Qwen/Qwen3-8B config.json (Hugging Face hub), the fields a shape reads.
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288, "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False, "max_position_embeddings": 40960, "attention_bias": False,
            "use_sliding_window": False}


def test_qwen3_8b_differs_from_32b_only_where_its_file_says():
    cfg = load_config(["+experiment=dapo_qwen3_8b"])
    check_variant_of_32b(load_config(["+experiment=dapo_qwen2.5_32b"]), cfg, "dapo_qwen3_8b",
                         {"model.name", "model.hf_path", "model.megatron_path", "cluster.num_nodes",
                          "rollout.num_engines", "rollout.engine_tp_size", "megatron.tensor_model_parallel_size",
                          "megatron.pipeline_model_parallel_size", "trainer.run_name"})
    check_run_pins(cfg)
    tp, engine_tp = cfg.megatron.tensor_model_parallel_size, cfg.rollout.engine_tp_size
    assert QWEN3_8B["num_attention_heads"] % tp == 0 and QWEN3_8B["num_key_value_heads"] % tp == 0
    assert QWEN3_8B["num_key_value_heads"] % engine_tp == 0
    assert cfg.algo.max_prompt_length + cfg.algo.max_response_length <= QWEN3_8B["max_position_embeddings"]


def test_plan_table_is_the_published_qwen3_8b():
    from transformers import Qwen3Config

    published = ModelShape.from_hf_config(Qwen3Config(**QWEN3_8B).to_dict())
    table = KNOWN_MODELS[load_config(["+experiment=dapo_qwen3_8b"]).model.name]
    assert table == published
    assert round(total_params(table) / 1e9, 2) == 8.19  # the model card's 8.2B
