"""A bf16 learner build holds one dtype, so the distributed optimizer finds each parameter's
own state when a checkpoint is saved.

Seen on the first GPU run (bench/gpu_node.py, check e, H200 without Transformer Engine): the
local spec's norms came out fp32 beside bf16 matrices, and the save at step 2 failed inside
megatron-core (`sharded_param_state_dp_reshardable`: a (64,) state for a 128-element range).
The CPU learner refuses bf16 for training, but a bf16 build (the conversion's override) and
megatron's optimizer run here, which is the whole of that path.
"""

from __future__ import annotations

import torch
from dist_helpers import make_config, run_distributed


def _bf16_optimizer(rank, world):
    from types import SimpleNamespace

    from dapo_mega.backends.megatron.checkpoint import _full_state
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.model import build_model
    from dapo_mega.backends.megatron.optimizer import build_optimizer, wrap_with_ddp
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = make_config()
    assert cfg.megatron.use_distributed_optimizer
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    chunks, _ = build_model(hf, cfg.megatron, layout, params_dtype=torch.bfloat16)
    dtypes = sorted({str(p.dtype) for c in chunks for p in c.parameters()})
    ddp = wrap_with_ddp(chunks, cfg.megatron)
    optimizer = build_optimizer(ddp, cfg.algo, cfg.megatron, bf16=True)
    for chunk in ddp:
        for p in chunk.parameters():
            p.main_grad.normal_(0, 1e-3)
    optimizer.step()  # Adam's state exists from the first update on
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    state_numel = {p: inner._get_main_param_and_optimizer_states(p)["param"].numel()
                   for c in chunks for p in c.parameters()}
    wrong = [(tuple(p.shape), n) for p, n in state_numel.items() if n != p.numel()]
    learner = SimpleNamespace(model_chunks=chunks, optimizer=optimizer)
    try:
        _full_state(learner, is_loading=False, optimizer_sharding="dp_reshardable")
        saved = ""
    except AssertionError as exc:
        saved = repr(exc)
    return dtypes, wrong, saved


def test_a_bf16_build_has_one_dtype_and_the_optimizer_state_of_each_param_is_its_own():
    dtypes, wrong, save_error = run_distributed(_bf16_optimizer, 1)[0]
    assert dtypes == ["torch.bfloat16"], f"a bf16 build holds {dtypes}: the local spec's norms stayed fp32"
    assert not wrong, f"params handed another's optimizer state (shape, state numel): {wrong}"
    assert save_error == "", f"the optimizer's sharded state dict failed: {save_error}"
