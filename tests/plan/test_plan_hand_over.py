"""`dapo-mega plan` counts what the driver hands the learners each step (issue #46 item 2,
`plan/hand_over.py`): the pickled samples and a mixture's routed-expert reports, by hand for
the Qwen3-30B-A3B recipe (the issue's 17.5 GB: what the pickled broadcast carried to every GPU),
and against what the code really packs and pickles."""

from __future__ import annotations

import base64
import math
import pickle
import random

import numpy as np
import pytest

from dapo_mega.algo.train_sample import TrainSample
from dapo_mega.backends.megatron.expert_shards import pack_expert_shard, reported_samples
from dapo_mega.config import load_config
from dapo_mega.models.shape import ModelShape
from dapo_mega.plan.hand_over import hand_over_bytes, sample_pickle_bytes
from dapo_mega.plan.memory import compute_plan, format_plan
from dapo_mega.rollout.samples import compact_routed_experts


def _recipe(*overrides):
    return compute_plan(load_config(["+experiment=dapo_qwen3_30b_a3b", *overrides]))


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def test_the_30b_a3b_recipe_by_hand():
    plan = _recipe("algo.routing_replay=true")
    h = plan.hand_over
    # 512 prompts x 16; prompts of min(150, 2048 / 4) tokens; responses log-normal of median
    # 20480 / 8 = 2560 and sigma 1, capped at 20480: E[min(X, c)] = e^(mu + 1/2) Phi(ln(c / 2560) - 1)
    # + c (1 - Phi(ln(c / 2560)))
    samples, prompt, cap = 512 * 16, 150, 20480
    z = math.log(cap / 2560)
    mean_response = 2560 * math.exp(0.5) * _phi(z - 1) + cap * (1 - _phi(z))
    assert mean_response == pytest.approx(4013.8, abs=0.1)
    positions = prompt + mean_response - 1                        # the last token is never fed
    per_position = 48 * 8 * 1                                     # layers x top-8 x one byte (128 experts)
    packed = samples * positions * per_position
    assert packed / 1e9 == pytest.approx(13.09, abs=0.01)
    assert packed * 4 / 3 / 1e9 == pytest.approx(17.5, abs=0.05)  # the figure: base64, on every GPU
    assert (h.samples_per_step, h.reporting_samples, h.report_bytes_per_position) == (samples, samples, per_position)
    assert h.mean_positions == pytest.approx(positions)
    assert h.reports_bytes == pytest.approx(packed) and h.reports_base64_bytes == pytest.approx(packed * 4 / 3)
    # DP 8 (32 GPUs / TP 4): each DP rank's share on its ranks' hosts, the worst a full-length step's
    assert plan.parallel.dp == 8 and h.shard_bytes == pytest.approx(packed / 8)
    assert h.shard_max_bytes == 1024 * (2048 + 20480 - 1) * per_position
    # a GPU sees one sparse layer's targets at a time: 22528 / TP 4 tokens x (8k + 9 + 4E + 8k)
    assert h.device_bytes_per_router == 22528 / 4 * (64 + 9 + 512 + 64)
    assert "17.46 GB as the samples carry them" in format_plan(plan)


def test_reports_only_where_asked_and_none_for_a_dense_model():
    agreement_only = _recipe().hand_over                        # replay off: one request in 8 reports
    assert agreement_only.reporting_samples == 8192 / 8
    assert agreement_only.reports_bytes == pytest.approx(_recipe("algo.routing_replay=true").hand_over.reports_bytes / 8)
    dense = compute_plan(load_config(["+experiment=dapo_qwen2.5_32b"])).hand_over
    assert dense.reports_bytes == dense.shard_bytes == dense.device_bytes_per_router == 0
    assert dense.sample_pickle_bytes > 0


def test_the_pickled_samples_as_pickle_counts_them():
    rng = random.Random(0)
    for prompt, response, mask in ((150, 4014, False), (2048, 20480, True), (300, 900, True)):
        sample = TrainSample(prompt_ids=[rng.randrange(65536, 151936) for _ in range(prompt)],
                             response_ids=[rng.randrange(65536, 151936) for _ in range(response)], advantage=0.5,
                             engine_log_probs=[-rng.random() for _ in range(response)],
                             loss_mask=[1] * response if mask else None, age=1)
        measured = len(pickle.dumps([sample] * 1))
        assert sample_pickle_bytes(prompt, response, mask) == pytest.approx(measured, rel=0.02)


def test_a_shard_is_the_plans_bytes_a_position():
    shape = ModelShape(model_type="qwen3_moe", num_layers=48, hidden_size=8, ffn_hidden_size=8, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, tie_word_embeddings=False, qkv_bias=False, vocab_size=50,
                       num_experts=128, num_experts_per_tok=8, moe_ffn_hidden_size=4)
    cfg = load_config(["+experiment=dapo_qwen3_30b_a3b", "algo.routing_replay=true"])
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(6):
        s = TrainSample(prompt_ids=[3] * int(rng.integers(5, 30)), response_ids=[4] * int(rng.integers(5, 60)))
        ids = rng.integers(0, 128, (s.length - 1, 48, 8)).astype(np.int32)
        s.routed_experts = compact_routed_experts(base64.b64encode(ids.tobytes()).decode())
        samples.append(s)
    reports = [s.routed_experts for s in samples]
    shard = pack_expert_shard(samples, reports, range(6), shape, reported_samples(samples, reports, shape))
    per_position = hand_over_bytes(cfg, shape, 1, 0, 0).report_bytes_per_position
    assert shard.payload.numel() == sum(s.length - 1 for s in samples) * per_position
    assert sum(len(r) for r in reports) == pytest.approx(shard.payload.numel() * 4 / 3, rel=0.01)  # as carried
