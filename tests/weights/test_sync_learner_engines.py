"""Megatron learners at TP 2 and at PP 2 sync into two embedded engines over gloo.

After one DAPO update and `sync_learner_weights`, each engine's weights are bit-identical
to the HF export of the learner's weights (`export_learner_to_hf`, the conversion path),
the engines report the new version, and a generation after the sync carries it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from dist_helpers import make_config, run_distributed

from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import EngineFleet, free_port
from dapo_mega.engines.sglang.client import EngineClient


def trained_learner(world, tp, pp, model_dir):
    """(learner, layout) of this rank: the HF weights of `model_dir`, then one real update, so
    the synced weights differ from what the engines loaded at start."""
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.algo.train_sample import TrainSample
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.weights.hf_io import HFCheckpointReader
    from dapo_mega.weights.stream import load_hf_into_megatron

    cfg = make_config(tp=tp, pp=pp, train_batch_size=1, mini_batch_size=1, n=2, lr=1e-2)
    layout = ParallelLayout.from_config(cfg.megatron, world, model_dir).initialize()
    learner = MegatronLearner(cfg, model_dir, layout)
    load_hf_into_megatron(learner.model_chunks, learner.info, layout, HFCheckpointReader(model_dir))
    learner.train_step([TrainSample([5, 6, 7], [8, 9, 10], advantage=1.0),
                        TrainSample([5, 6, 7], [11, 12], advantage=-1.0)])
    return learner, layout


def _learner_sync(rank, world, tp, pp, model_dir, engine_urls, ports, export_dir):
    from dapo_mega.weights.convert import export_learner_to_hf
    from dapo_mega.weights.sync import WeightSyncer, sync_learner_weights

    learner, layout = trained_learner(world, tp, pp, model_dir)
    syncer = None
    if layout.is_weight_source or rank == 0:
        syncer = WeightSyncer(engine_urls, bucket_mb=0.02, mode="distributed", backend="gloo", timeout_s=120)
        if layout.is_weight_source:
            syncer.init_group(ports[layout.pp_rank], stage=layout.pp_rank)
    stats = sync_learner_weights(syncer, learner.model_chunks, learner.info, layout, "7")
    export_learner_to_hf(learner.model_chunks, learner.info, layout, export_dir)
    if syncer is not None:
        syncer.close()
    return None if stats is None else (stats.num_tensors, stats.num_buckets)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models(3)


async def _engine_view(url, names):
    async with EngineClient(url) as c:
        weights = {n: torch.tensor(await c.get_weights_by_name(n, truncate_size=10**7)) for n in names}
        version = await c.weight_version()
        out = await c.generate([[4, 5, 6]], {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True})
    return weights, version, out[0]


def assert_engines_serve_export(urls, model_dir, exported, version):
    """The update changed the weights, and every engine holds exactly `exported` as `version`."""
    from safetensors.torch import load_file

    before = load_file(str(model_dir / "model.safetensors"))
    assert any(not torch.equal(before[n], t) for n, t in exported.items()), "the update changed nothing"
    for url in urls:
        weights, served, sample = asyncio.run(_engine_view(url, list(exported)))
        for name, tensor in exported.items():
            assert torch.equal(weights[name], tensor), f"{url}: {name} differs from the HF export"
        assert served == version and sample.versions == [version]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_learner_sync_bit_identical_to_export(model_dir, tmp_path, tp, pp):
    from safetensors.torch import load_file

    with EngineFleet(RolloutConfig(), str(model_dir), tmp_path / "logs", num_threads=1) as fleet:
        urls = [e.url for e in fleet.start(2)]
        export_dir = tmp_path / "export"
        stats = run_distributed(_learner_sync, 2, args=(tp, pp, str(model_dir), urls, [free_port(), free_port()],
                                                        str(export_dir)), timeout_s=400)
        sent = sum(s[0] for s in stats if s is not None)
        exported = {}
        for shard in export_dir.glob("*.safetensors"):
            exported.update(load_file(str(shard)))
        assert sent == len(exported), "every exported tensor is synced exactly once (over the PP stages)"
        assert_engines_serve_export(urls, model_dir, exported, "7")
