"""`dapo-mega plan`'s per-layer activation formula for Qwen3 (q/k RMSNorm per head, head_dim
twice hidden / heads) against what torch's autograd saves in a tiny megatron-core Qwen3 on the
CPU (the measurement of test_plan_activations.py, on the Qwen3 shape)."""

from __future__ import annotations

from dist_helpers import run_distributed
from test_plan_activations import SHAPE, TOKENS, _config, _inputs, _saved_bytes_by_layer


def _measure_qwen3(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.model import build_model
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = _config(recompute=False)
    hf = tiny_hf_config(cfg.model, architecture="qwen3")
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    (model,), _ = build_model(hf, cfg.megatron, layout)
    tokens, position_ids, mask = _inputs(60)
    return _saved_bytes_by_layer(model, lambda: model(tokens, position_ids, mask))


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
