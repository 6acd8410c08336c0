"""`dapo-mega plan`'s per-layer activation formula for Qwen3 (q/k RMSNorm per head, head_dim
twice hidden / heads) against what torch's autograd saves in a tiny megatron-core Qwen3 on the
CPU (the measurement of test_plan_activations.py, on the Qwen3 shape)."""

from __future__ import annotations

from dist_helpers import run_distributed
from test_plan_activations import SHAPE, TOKENS, measure_tiny


def _measure_qwen3(rank, world):
    return measure_tiny(rank, world, "qwen3", ep=1)


def test_plan_layer_activations_meet_a_tiny_qwen3():
    from dapo_mega.config import ModelConfig
    from dapo_mega.models.shape import ModelShape
    from dapo_mega.models.tiny import tiny_hf_config
    from dapo_mega.plan.memory import layer_saved_bytes

    got = run_distributed(_measure_qwen3, 1, timeout_s=240)[0]
    shape = ModelShape.from_hf_config(tiny_hf_config(ModelConfig(**SHAPE), architecture="qwen3"))
    assert shape.qk_layernorm and shape.head_dim != shape.hidden_size // shape.num_attention_heads
    per_layer = sum(layer_saved_bytes(shape, TOKENS, 1, False, spec="local", element_bytes=4).values())
    for layer in range(shape.num_layers):
        assert abs(got[layer] - per_layer) <= 0.01 * per_layer, (layer, got[layer], per_layer)
