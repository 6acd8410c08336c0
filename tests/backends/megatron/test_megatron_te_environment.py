"""A CPU build in an environment where Transformer Engine imports (a GPU cluster's learner
venv) stays local, and a TE learner loads a checkpoint written with the local spec.

No TE here: `transformer_block.LayerNormImpl`, which megatron-core sets to TE's TENorm
whenever transformer_engine imports, is set to a stand-in class; and the TE learner's
request is the local model's plus one `_extra_state` object, as TE modules add.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import make_config, run_distributed

from dapo_mega.backends.megatron.checkpoint import CheckpointCorruptError


class TENormStandIn(torch.nn.Module):
    """What TENorm would be on this CPU: a norm the local model must not contain."""

    def __init__(self, config=None, hidden_size=0, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))


def _build(world):
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.model import build_model
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = make_config()
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    return build_model(hf, cfg.megatron, layout)[0]


def _final_norms(rank, world):
    from megatron.core.transformer import transformer_block

    transformer_block.LayerNormImpl = TENormStandIn  # as if transformer_engine imported
    (model,) = _build(world)
    return type(model.decoder.final_layernorm).__name__, type(model.decoder.layers[0].input_layernorm).__name__


def test_the_local_specs_final_norm_is_its_own_where_te_imports():
    final, layer = run_distributed(_final_norms, 1)[0]
    assert final == layer == "RMSNorm"  # torch's, as every layer's; not the TE stand-in


def _load_with_extra_objects(rank, world, ckpt_dir, extra_keys):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from dapo_mega.backends.megatron import checkpoint

    chunks = _build(world)
    Path(ckpt_dir).mkdir(parents=True)
    checkpoint.save_dist_checkpoint(checkpoint.model_sharded_state_dict(chunks), ckpt_dir)
    saved = {k: v.clone() for k, v in chunks[0].state_dict().items() if torch.is_tensor(v)}
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.zero_()
    own = checkpoint.model_sharded_state_dict

    def with_objects(model_chunks):  # what a TE module adds to the request
        state = own(model_chunks)
        for key in extra_keys:
            state["model"][key] = ShardedObject(key, None, (1,), (0,), replica_id=0)
        return state

    checkpoint.model_sharded_state_dict = with_objects
    try:
        checkpoint.load_model_from_dist_checkpoint(chunks, ckpt_dir)
    except CheckpointCorruptError as exc:
        return str(exc)
    return all(torch.equal(v, chunks[0].state_dict()[k]) for k, v in saved.items())


def test_a_te_learner_loads_a_local_spec_checkpoint_without_its_extra_state(tmp_path):
    key = "decoder.final_layernorm._extra_state"  # TENorm's; the local norm has none
    assert run_distributed(_load_with_extra_objects, 1, (str(tmp_path / "a"), [key]))[0] is True


def test_an_absent_object_that_is_not_te_extra_state_is_refused_by_name(tmp_path):
    (message,) = run_distributed(_load_with_extra_objects, 1, (str(tmp_path / "b"), ["decoder.router_state"]))
    assert "decoder.router_state" in message and "lacks 1 object" in message


def test_a_te_norm_in_a_local_model_is_refused():
    from types import SimpleNamespace

    from dapo_mega.backends.megatron.model import TE_SPEC, _require_spec_norm
    from dapo_mega.config import ConfigError

    decoder = SimpleNamespace(final_layernorm=TENormStandIn(hidden_size=2),
                              layers=[SimpleNamespace(input_layernorm=torch.nn.RMSNorm(2))])
    with pytest.raises(ConfigError, match="TENormStandIn"):
        _require_spec_norm(SimpleNamespace(decoder=decoder), "local")
    _require_spec_norm(SimpleNamespace(decoder=decoder), TE_SPEC)  # the TE spec's norm is TE's
