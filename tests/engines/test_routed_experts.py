"""The embedded engine serves a Qwen3-MoE and reports each token's routed experts as SGLang 0.5.23
does (`return_routed_experts` on /generate with `--enable-return-routed-experts`: base64 of int32
[positions, num_hidden_layers, num_experts_per_tok] over positions [routed_experts_start_len,
seqlen - 1), zeros in the layers without experts). Issue #38 item 4: what routing replay will
hand the learner. The reference is transformers' own router on the whole sequence."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch

from dapo_mega.config import ModelConfig, RolloutConfig
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.engines.sglang.client import EngineClient
from dapo_mega.models.tiny import build_tiny_model_dir

PROMPTS = [[5, 6, 7, 8, 9], [12, 40, 41]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE of 3 layers: layer 0 dense (mlp_only_layers), layers 1 and 2 of 8 experts."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("moe"), ModelConfig(tiny_num_layers=3), seed=3,
                                architecture="qwen3_moe")


@pytest.fixture(scope="module")
def engine(moe_dir, tmp_path_factory):
    rollout = RolloutConfig(backend="embedded", health_timeout_s=120,
                            extra_server_args=["--enable-return-routed-experts"])
    with EngineFleet(rollout, str(moe_dir), tmp_path_factory.mktemp("logs"), device="cpu", num_threads=1) as fleet:
        yield fleet.start(1)[0]


def generate(endpoint, **fields):
    body = {"input_ids": PROMPTS, "sampling_params": {"n": 2, "temperature": 1.0, "max_new_tokens": 6,
                                                      "ignore_eos": True, "sampling_seed": 7}, **fields}

    async def go():
        async with EngineClient(endpoint) as client:
            return await client._request("POST", "/generate", body)
    return asyncio.run(go())


def reference_experts(moe_dir, ids):
    """transformers' top-k experts of every position of `ids` in every layer (0s where dense)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    cfg = model.config
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    experts = np.zeros((len(ids), cfg.num_hidden_layers, cfg.num_experts_per_tok), dtype=np.int32)
    sparse = [i for i in range(cfg.num_hidden_layers) if i not in cfg.mlp_only_layers]
    for layer, logits in zip(sparse, out.router_logits):
        experts[:, layer] = torch.topk(logits.float(), cfg.num_experts_per_tok, dim=-1).indices.numpy()
    return experts, sparse


def decoded(reply, layers, top_k):
    raw = base64.b64decode(reply["meta_info"]["routed_experts"])
    return np.frombuffer(raw, dtype=np.int32).reshape(-1, layers, top_k)


def test_each_tokens_experts_are_transformers_router_choices(engine, moe_dir):
    """Every sample's experts over [0, seqlen - 1) (the prompt's, then each generated token's but
    the last, which was never fed) are the ones transformers' router picks on the whole
    sequence, as sets (top-k order aside); the dense layer's are 0. From routed_experts_start_len
    on only the later positions are reported."""
    replies = generate(engine, return_routed_experts=True)
    assert len(replies) == 4
    for k, reply in enumerate(replies):
        ids = PROMPTS[k // 2] + reply["output_ids"]
        want, sparse = reference_experts(moe_dir, ids)
        got = decoded(reply, want.shape[1], want.shape[2])
        assert got.shape == (len(ids) - 1,) + want.shape[1:], got.shape
        assert (got[:, 0] == 0).all() and 0 not in sparse
        for layer in sparse:
            assert [sorted(r) for r in got[:, layer].tolist()] == [sorted(r) for r in want[:-1, layer].tolist()]
    later = generate(engine, return_routed_experts=True, routed_experts_start_len=3)
    for reply in later:
        full = len(PROMPTS[later.index(reply) // 2]) + len(reply["output_ids"]) - 1
        assert decoded(reply, 3, 2).shape[0] == full - 3


def test_routed_experts_only_when_asked_and_a_start_past_the_prompt_is_refused(engine):
    assert all("routed_experts" not in r["meta_info"] for r in generate(engine))

    async def refused():
        async with EngineClient(engine) as client:
            return await client._request("POST", "/generate", {
                "input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 2},
                "return_routed_experts": True, "routed_experts_start_len": 4})
    with pytest.raises(Exception, match="routed_experts_start_len=4 is higher than the number of input tokens"):
        asyncio.run(refused())

