"""The embedded engine's flat weight layout (`engines/embedded/flat_weights.py`): a flattened
bucket that is a byte range of the parameters lands in them with no scratch buffer; one in
another order or dtype still loads right through a reused scratch buffer, and the layout then
follows the sender's order; release / resume keeps it; a tied model's lm_head still loads
through the embedding."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from dapo_mega.config import ModelConfig, RolloutConfig
from dapo_mega.engines.fleet import EngineFleet, free_port
from dapo_mega.engines.sglang.client import EngineClient
from dapo_mega.weights.sync import WeightSyncer

BUCKET_MB = 0.05  # 52 kB: buckets of one to ten of the tiny model's tensors


def hf_state(model_dir, seed):
    """The model's HF state dict (its order), perturbed so every sync changes every weight."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


async def _engine_view(url, names):
    async with EngineClient(url) as c:
        weights = {n: torch.tensor(await c.get_weights_by_name(n, truncate_size=10**6)) for n in names}
        info = await c._request("GET", "/server_info")
        out = await c.generate([[4, 5, 6]], {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    return weights, info, out[0]


def greedy_reference(model_dir, state):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ref.load_state_dict({k: v.float() for k, v in state.items()})
    with torch.no_grad():
        return ref.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=6, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, 3:].tolist()


class Engine:
    """One embedded engine and a syncer into it; `sync` returns the receive counters' change."""

    def __init__(self, url, model_dir, group_prefix="flat_weights"):
        self.url, self.model_dir = url, model_dir
        self.syncer = WeightSyncer([url], bucket_mb=BUCKET_MB, backend="gloo", timeout_s=120,
                                   group_prefix=group_prefix)
        self.syncer.init_group(master_port=free_port())

    def counters(self):
        return asyncio.run(_engine_view(self.url, []))[1]["weight_receive"]

    def sync(self, named, version):
        before = self.counters()
        stats = self.syncer.sync(iter(named), weight_version=version)
        after = self.counters()
        return stats, {k: after[k] - before[k] for k in after}, after

    def check(self, state, version):
        """The engine holds exactly `state` (cast to float32) as `version` and generates with it."""
        weights, info, sample = asyncio.run(_engine_view(self.url, list(state)))
        for name, tensor in state.items():
            assert torch.equal(weights[name], tensor.float()), f"{name} differs after the sync"
        assert info["weight_version"] == version and sample.versions == [version]
        assert sample.token_ids == greedy_reference(self.model_dir, state)

    def close(self):
        self.syncer.destroy_group()
        self.syncer.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with EngineFleet(RolloutConfig(), str(tiny_model_dir), num_threads=1) as fleet:
        fleet.start(1)
        e = Engine(fleet.engines[0].url, tiny_model_dir)
        yield e
        e.close()


def test_parameters_are_views_of_one_flat_storage_in_state_dict_order(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from dapo_mega.engines.embedded.model_runner import ModelRunner

    runner = ModelRunner(str(tiny_model_dir))
    storage = runner.flat.storages[torch.float32]
    names = list(runner.params)
    at = storage.data_ptr()
    for name in names:  # back to back, in the HF state-dict order
        assert runner.params[name].data_ptr() == at, name
        at += runner.params[name].numel() * 4
    assert at == storage.data_ptr() + storage.numel() * 4
    ids = torch.tensor([[4, 5, 6, 7]])
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():  # the model computes with the views
        assert torch.equal(runner.model(input_ids=ids).logits, ref(input_ids=ids).logits)

    run = names[1:4]
    nbytes = sum(runner.params[n].numel() * 4 for n in run)
    span = runner.flat.span(run, [torch.float32] * 3, nbytes)
    assert span is not None and span.data_ptr() == runner.params[run[0]].data_ptr() and span.numel() == nbytes
    span.view(torch.float32).fill_(1.5)  # the span is the parameters' memory
    assert all(bool((runner.params[n] == 1.5).all()) for n in run)
    assert not bool((runner.params[names[0]] == 1.5).any()) and not bool((runner.params[names[4]] == 1.5).any())
    assert runner.flat.span(run[::-1], [torch.float32] * 3, nbytes) is None  # another order
    assert runner.flat.span(run, [torch.bfloat16] * 3, nbytes // 2) is None  # another dtype
    assert runner.flat.span([names[1], names[3]], [torch.float32] * 2, nbytes) is None  # a gap

    runner.release_weights()
    assert all(p.numel() == 0 for p in runner.params.values())
    runner.resume_weights()
    storage = runner.flat.storages[torch.float32]
    assert runner.params[names[0]].data_ptr() == storage.data_ptr()
    assert runner.flat.span(run, [torch.float32] * 3, nbytes).data_ptr() == runner.params[run[0]].data_ptr()
    assert all(bool((p == 0).all()) and p.shape == ref.state_dict()[n].shape for n, p in runner.params.items())


def test_scratch_buffers_are_reused_and_never_held_twice():
    from dapo_mega.engines.embedded.flat_weights import ScratchBuffers

    scratch = ScratchBuffers(torch.device("cpu"))
    i, a = scratch.acquire(100)
    j, b = scratch.acquire(50)
    assert i != j and a.data_ptr() != b.data_ptr() and scratch.allocations == 2
    got = []
    third = threading.Thread(target=lambda: got.append(scratch.acquire(80)))
    third.start()
    third.join(0.3)
    assert third.is_alive() and not got  # both are held (one received, one loading): it waits
    scratch.release(i)
    third.join(10)
    assert got[0][0] == i and got[0][1].data_ptr() == a.data_ptr() and got[0][1].numel() == 80
    assert scratch.allocations == 2  # reused, not allocated again


def test_buckets_in_the_layout_land_in_place_others_through_scratch(engine, tiny_model_dir):
    state = hf_state(tiny_model_dir, seed=1)
    stats, delta, _ = engine.sync(state.items(), "1")
    assert stats.num_buckets >= 4
    assert delta["direct_buckets"] == stats.num_buckets and delta["scratch_buckets"] == 0
    assert delta["scratch_allocations"] == 0
    engine.check(state, "1")

    backwards = list(hf_state(tiny_model_dir, seed=2).items())[::-1]  # not the layout's order
    stats, delta, total = engine.sync(backwards, "2")
    assert delta["scratch_buckets"] >= 2 and delta["relayouts"] == 1
    assert total["scratch_allocations"] <= 2  # two buffers, reused across buckets
    engine.check(dict(backwards), "2")

    backwards = list(hf_state(tiny_model_dir, seed=3).items())[::-1]  # the layout follows the sender
    stats, delta, _ = engine.sync(backwards, "3")
    assert delta["direct_buckets"] == stats.num_buckets and delta["scratch_buckets"] == 0
    assert delta["relayouts"] == 0
    engine.check(dict(backwards), "3")


def test_another_dtype_is_cast_through_scratch(engine, tiny_model_dir):
    bf16 = [(n, t.to(torch.bfloat16)) for n, t in hf_state(tiny_model_dir, seed=4).items()]
    stats, delta, total = engine.sync(bf16, "4")
    assert delta["scratch_buckets"] == stats.num_buckets and delta["direct_buckets"] == 0
    assert delta["relayouts"] == 0 and total["scratch_allocations"] <= 2
    engine.check(dict(bf16), "4")


def test_release_resume_then_sync_lands_in_place(engine, tiny_model_dir):
    backwards = list(hf_state(tiny_model_dir, seed=5).items())[::-1]
    engine.sync(backwards, "5")  # the layout takes this order (if it had another)
    engine.syncer.release_engine_memory()
    engine.syncer.resume_engine_memory()  # zeros, in the same layout
    backwards = list(hf_state(tiny_model_dir, seed=6).items())[::-1]
    stats, delta, _ = engine.sync(backwards, "6")
    assert delta["direct_buckets"] == stats.num_buckets and delta["scratch_buckets"] == 0
    engine.check(dict(backwards), "6")


def test_tied_lm_head_loads_through_the_embedding(tmp_path):
    from dapo_mega.models.tiny import build_tiny_model_dir

    model_dir = build_tiny_model_dir(tmp_path, model_cfg=ModelConfig(tiny_tie_word_embeddings=True), seed=7)
    state = hf_state(model_dir, seed=7)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # one matrix, sent under both names
    with EngineFleet(RolloutConfig(), str(model_dir), num_threads=1) as fleet:
        fleet.start(1)
        engine = Engine(fleet.engines[0].url, model_dir, group_prefix="flat_weights_tied")
        try:
            for version in ("1", "2"):
                stats, delta, _ = engine.sync(state.items(), version)
                # lm_head has no place of its own: only its bucket goes through scratch, and the
                # layout stays (the order was the layout's)
                assert delta["scratch_buckets"] == 1 and delta["direct_buckets"] == stats.num_buckets - 1
                assert delta["relayouts"] == 0
                engine.check(state, version)
        finally:
            engine.close()


def _two_dtype_layout():
    """A FlatParameters of four parameters in two dtypes (a bf16 model with fp32 norms), their
    values distinct."""
    from dapo_mega.engines.embedded.flat_weights import FlatParameters

    params = {"a": torch.arange(6.0).reshape(2, 3).to(torch.bfloat16), "norm1": torch.arange(4.0) + 100,
              "b": torch.arange(8.0).reshape(4, 2).to(torch.bfloat16) + 10, "norm2": torch.arange(3.0) + 200}
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in params.items()}
    flat = FlatParameters(params, {n: tuple(p.shape) for n, p in params.items()})
    flat.plan(list(params))
    flat.allocate("current")
    return params, flat


def test_a_relayout_keeps_every_value_goes_one_dtype_at_a_time_and_drops_the_old_storages():
    import weakref

    params, flat = _two_dtype_layout()
    want = {n: p.detach().clone() for n, p in params.items()}
    old = {dt: weakref.ref(s) for dt, s in flat.storages.items()}
    flat.relayout(["b", "norm2", "a", "norm1"])
    assert flat.order == ["b", "norm2", "a", "norm1"]
    for name, p in params.items():
        assert torch.equal(p, want[name]) and p.dtype == want[name].dtype, name
        slot = flat.slots[name]
        assert p.data_ptr() == flat.storages[slot.dtype].data_ptr() + slot.start * p.element_size()
    assert flat.slots["b"].start == 0 and flat.slots["norm2"].start == 0  # each dtype in the new order
    assert all(ref() is None for ref in old.values())  # nothing holds the old layout


def test_a_bucket_mixing_dtypes_goes_through_scratch_and_never_asks_for_a_relayout():
    """SGLang's flattened bucket packs a bf16 matrix and an fp32 norm back to back; one storage
    per dtype can never take that in place, so the layout must not be redone for it (a relayout
    at every sync: a copy of the model each time)."""
    from types import SimpleNamespace

    from dapo_mega.engines.embedded.flat_weights import BucketReceiver
    from dapo_mega.wire import transport

    params, flat = _two_dtype_layout()
    lock = threading.RLock()

    def load(named, version):
        for name, tensor in named:
            params[name].data.copy_(tensor)

    runner = SimpleNamespace(flat=flat, model_lock=lock, weights_released=False, params=params, views=params,
                             device=torch.device("cpu"), load_named_tensors=load)
    receiver = BucketReceiver(runner)
    pg = transport.init_custom_process_group("gloo", f"tcp://127.0.0.1:{free_port()}", 1, 0, "mixed_dtypes")
    try:
        names = ["a", "norm1"]  # in the layout's order, each of its own dtype: one bucket of two dtypes
        dtypes, shapes = [torch.bfloat16, torch.float32], [[2, 3], [4]]
        for version in ("1", "2"):
            receiver.load(receiver.receive(pg, names, dtypes, shapes, "flattened_bucket"), version)
        # a bucket of one dtype in another order than the layout's asks for one, once
        receiver.load(receiver.receive(pg, ["b", "a"], [torch.bfloat16] * 2, [[4, 2], [2, 3]], "flattened_bucket"), "3")
    finally:
        transport.destroy_custom_process_group(pg)
    assert receiver.stats.scratch_buckets == 3 and receiver.stats.direct_buckets == 0
    assert receiver.stats.relayouts == 1 and flat.order[:2] == ["b", "a"]


def test_releasing_the_weights_frees_the_scratch_buffers_too(engine, tiny_model_dir):
    bf16 = [(n, t.to(torch.bfloat16)) for n, t in hf_state(tiny_model_dir, seed=8).items()]
    engine.sync(bf16, "8")  # through scratch: the buffers exist
    engine.syncer.release_engine_memory()
    async def read_norm():
        async with EngineClient(engine.url) as c:
            return await c.get_weights_by_name("model.norm.weight", truncate_size=10)
    with pytest.raises(Exception, match="released"):  # no released (empty) weights are read
        asyncio.run(asyncio.wait_for(read_norm(), 30))
    engine.syncer.resume_engine_memory()
    stats, delta, _ = engine.sync(bf16, "9")
    assert delta["scratch_allocations"] >= 1  # allocated again: release had freed them
    engine.check(dict(bf16), "9")


def test_a_tied_matrix_keeps_the_embeddings_name_whichever_name_comes_first():
    """The loader skips a tied `lm_head.weight` (SGLang's rule), so its place must be the
    embedding's: a sender that sends lm_head first must not take the place under its name."""
    from dapo_mega.engines.embedded.flat_weights import FlatParameters

    tied = torch.nn.Parameter(torch.arange(6.0).reshape(3, 2), requires_grad=False)
    params = {"model.embed_tokens.weight": tied, "norm": torch.nn.Parameter(torch.ones(2)), "lm_head.weight": tied}
    flat = FlatParameters(params, {n: tuple(p.shape) for n, p in params.items()})
    flat.plan(list(params))
    flat.allocate("current")
    flat.relayout(["lm_head.weight", "norm", "model.embed_tokens.weight"])
    assert flat.order == ["model.embed_tokens.weight", "norm"] and "lm_head.weight" not in flat.slots
    assert flat.slots["model.embed_tokens.weight"].start == 0
    assert params["lm_head.weight"] is params["model.embed_tokens.weight"]
    assert torch.equal(params["model.embed_tokens.weight"], torch.arange(6.0).reshape(3, 2))
