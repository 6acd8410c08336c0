"""`dapo-mega plan`'s activations of a mixture's sparse layer (`plan.memory._moe_saved_bytes`:
the router, the all-to-all's output and the experts' SwiGLU) against what torch's autograd
saves in megatron-core's MoE layer on the CPU (the measurement of test_plan_activations.py, on
the tiny Qwen3-MoE: layer 0 dense, layer 1 sparse, 8 experts, top 2). At EP 1 every token copy
stays on the rank; at EP 2 each rank keeps the copies its experts received, which depend on the
router, so the two ranks' sum (each ran the same tokens) meets twice the formula."""

from __future__ import annotations

from dist_helpers import run_distributed
from test_plan_activations import SHAPE, TOKENS, measure_tiny


def _measure_moe(rank, world):
    return measure_tiny(rank, world, "qwen3_moe", ep=world)


def test_plan_sparse_layer_activations_meet_megatrons_moe_layer_at_ep1_and_ep2():
    from dapo_mega.config import ModelConfig
    from dapo_mega.models.shape import ModelShape
    from dapo_mega.models.tiny import tiny_hf_config
    from dapo_mega.plan.memory import layer_saved_bytes

    shape = ModelShape.from_hf_config(tiny_hf_config(ModelConfig(**SHAPE), architecture="qwen3_moe"))
    assert [shape.is_sparse_layer(i) for i in range(shape.num_layers)] == [False, True]
    dense, sparse = (sum(layer_saved_bytes(shape, TOKENS, 1, False, spec="local", element_bytes=4,
                                           layer=i).values()) for i in range(2))
    assert sparse != dense
    one = run_distributed(_measure_moe, 1, timeout_s=240)[0]
    assert abs(one[0] - dense) <= 0.01 * dense, (one[0], dense)
    assert abs(one[1] - sparse) <= 0.01 * sparse, (one[1], sparse)
    two = run_distributed(_measure_moe, 2, timeout_s=240)
    both = two[0][1] + two[1][1]
    assert abs(both - 2 * sparse) <= 0.01 * sparse, (two[0][1], two[1][1], sparse)
