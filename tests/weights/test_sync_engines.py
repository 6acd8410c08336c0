"""Weight sync into two embedded engines: distributed (gloo broadcast) and colocated (shm)."""

import asyncio

import pytest
import torch

from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import EngineFleet, free_port
from dapo_mega.engines.sglang.client import EngineClient
from dapo_mega.weights.sync import WeightSyncer, iter_buckets


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models(5)


@pytest.fixture(scope="module")
def engines(model_dir):
    with EngineFleet(RolloutConfig(), str(model_dir), num_threads=1) as fleet:
        fleet.start(2)
        yield fleet.engines


def perturbed_state(model_dir, seed):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    return model, state


async def engine_view(url, names):
    async with EngineClient(url) as c:
        weights = {n: torch.tensor(await c.get_weights_by_name(n, truncate_size=10**6)) for n in names}
        version = await c.weight_version()
        out = await c.generate([[4, 5, 6]], {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    return weights, version, out[0]


def check_engines(engines, model_dir, state, version):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ref.load_state_dict(state)
    with torch.no_grad():
        greedy = ref.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    for e in engines:
        weights, got_version, sample = asyncio.run(engine_view(e.url, list(state)))
        for name, tensor in state.items():
            assert torch.equal(weights[name], tensor), f"{e.url}: {name} differs after sync"
        assert got_version == version
        assert sample.versions == [version]
        assert sample.token_ids == greedy  # the engine generates with exactly the new weights


def test_iter_buckets_bounds_and_order():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=80))
    assert [[n for n, _ in b] for b, _ in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert [last for _, last in buckets] == [False, False, True]


def test_distributed_then_colocated_sync_bit_identical(engines, model_dir):
    syncer = WeightSyncer([e.url for e in engines], bucket_mb=0.05, mode="distributed", backend="gloo",
                          timeout_s=120)
    try:
        syncer.init_group(master_port=free_port(), stage=0)
        _, state = perturbed_state(model_dir, seed=1)
        stats = syncer.sync(iter(state.items()), weight_version="1")
        assert stats.num_buckets > 2 and stats.num_tensors == len(state)
        assert stats.bytes == sum(t.numel() * 4 for t in state.values())
        check_engines(engines, model_dir, state, "1")

        _, state2 = perturbed_state(model_dir, seed=2)
        syncer.mode = "colocated"
        syncer.release_engine_memory()
        syncer.resume_engine_memory()
        stats = syncer.sync(iter(state2.items()), weight_version="2")
        assert stats.num_tensors == len(state2)
        check_engines(engines, model_dir, state2, "2")
    finally:
        syncer.mode = "distributed"
        syncer.destroy_group()
        syncer.close()


KILLED_TRAINER = """
import os, sys
from dapo_mega.engines.fleet import free_port
from dapo_mega.weights.sync import WeightSyncer
syncer = WeightSyncer(sys.argv[1:], mode="distributed", backend="gloo", timeout_s=60)
syncer.init_group(master_port=free_port(), stage=0)
os._exit(0)  # killed: no close(), the engines keep its group
"""


def test_a_new_trainer_joins_engines_that_a_killed_one_left_in_its_group(engines, model_dir):
    """Engines outlive trainers (attached by URL, a registry, a resumed run): a trainer killed
    after joining its weight-update group leaves the group's name on every engine, and both
    SGLang and the embedded engine refuse a second group of that name. The next trainer
    still joins (it asks the engines to forget the old group first), syncs, and on close
    leaves the group, so a third joins too."""
    import subprocess
    import sys

    urls = [e.url for e in engines]
    subprocess.run([sys.executable, "-c", KILLED_TRAINER, *urls], check=True, timeout=120)
    for seed, version in ((3, "3"), (4, "4")):
        syncer = WeightSyncer(urls, bucket_mb=0.05, mode="distributed", backend="gloo", timeout_s=60)
        try:
            syncer.init_group(master_port=free_port(), stage=0)
            _, state = perturbed_state(model_dir, seed=seed)
            syncer.sync(iter(state.items()), weight_version=version)
            check_engines(engines, model_dir, state, version)
        finally:
            syncer.close()
        assert syncer.group is None


def test_an_engine_that_refuses_the_group_is_named_at_once(engines):
    """An engine that answers /init_weights_update_group with an error never joins the
    rendezvous: the syncer says so with the engine's message, instead of waiting out its
    timeout in the rendezvous (here: NCCL asked of a CPU engine)."""
    import time

    from dapo_mega.weights.sync import WeightSyncError

    syncer = WeightSyncer([e.url for e in engines], mode="distributed", backend="nccl", timeout_s=120)
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match="needs a GPU"):
            syncer.init_group(master_port=free_port(), stage=0)
    finally:
        syncer.close()
    assert time.monotonic() - start < 30
