"""The real SGLang 0.5.23 CPU server on a mixture of experts, held to transformers (issue #38
item 4): a tiny Qwen3-MoE with every layer sparse (what SGLang builds: plan/preflight.py
`check_engine_serves_model`), fp32 on both sides. Greedy tokens equal transformers' argmax,
their log-probs its log-softmax, and each token's routed experts (SGLang's `meta_info.
routed_experts`, asked with `return_routed_experts` of an engine the fleet started with
`--enable-return-routed-experts`: tools/sglang_cpu/cpu_host_buffers.py makes that start on a
CPU) are transformers' router's top-k, as the embedded engine reports them
(`engines/embedded/model_runner.Routing`, the same comparison in test_megatron_routing.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from sglang_venv import sglang_python_or_skip

from dapo_mega.backends.megatron.routing import decode_routed_experts
from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.engines.sglang.client import EngineClient
from dapo_mega.models.tiny import build_tiny_model_dir

PROMPTS = ([20, 21, 22, 23, 24], [30, 31, 32, 5, 40, 41])
STEPS = 8


@pytest.mark.slow  # ~40 s: SGLang's start
def test_sglang_serves_a_mixture_as_transformers_computes_it(tmp_path):
    from transformers import AutoModelForCausalLM

    from dapo_mega.engines.embedded.model_runner import Routing

    python = sglang_python_or_skip()
    model_dir = build_tiny_model_dir(tmp_path / "moe", seed=4, architecture="qwen3_moe", dense_layers=[])
    cfg = RolloutConfig(backend="sglang", engine_python=str(python), max_running_requests=2, dtype="float32",
                        health_timeout_s=240, extra_server_args=["--max-total-tokens", "4096"])
    fleet = EngineFleet(cfg, str(model_dir), tmp_path / "logs", device="cpu", weight_version="0", num_threads=1)
    assert fleet.returns_routed_experts
    try:
        endpoint = fleet.start(1)[0]

        async def ask():
            async with EngineClient(endpoint) as client:
                return await client.generate(list(PROMPTS), {"n": 1, "temperature": 0.0, "max_new_tokens": STEPS,
                                                             "ignore_eos": True},
                                             return_logprob=True, return_routed_experts=True)
        replies = asyncio.run(ask())
    finally:
        fleet.close()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routing = Routing.of(model)
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    for reply in sorted(replies, key=lambda r: r.prompt_index):
        prompt = PROMPTS[reply.prompt_index]
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(STEPS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            assert reply.token_ids == ids[len(prompt):], reply.prompt_index
            logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1]
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(reply.token_ids)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(reply.logprobs), want, atol=1e-3)
            model(torch.tensor([ids[:-1]]))  # the last token is never fed
            experts = routing.experts(1, len(ids) - 1)[0].numpy()
        reported = decode_routed_experts(reply.meta_info.get("routed_experts"), len(ids) - 1, layers, k)
        assert reported is not None, sorted(reply.meta_info)
        same = [set(a) == set(b) for a, b in zip(reported.reshape(-1, k).tolist(), experts.reshape(-1, k).tolist())]
        assert np.mean(same) == 1.0, f"{sum(same)} of {len(same)} token-layer choices equal"
