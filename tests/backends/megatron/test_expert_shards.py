"""Which of a step's routed-expert bytes go to which data-parallel rank (issue #46 item 2,
`backends/megatron/expert_shards.py`, `batch.data_parallel_samples`), on the CPU: each DP rank's
shard holds exactly the reports of the samples it trains on, one byte an expert id, and reads
back into the engine's arrays; the samples each rank trains on are the learner's own shards."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest

from dapo_mega.algo.train_sample import TrainSample
from dapo_mega.backends.megatron.batch import data_parallel_samples, shard_of, step_mini_batches
from dapo_mega.backends.megatron.expert_shards import (
    RoutedExperts,
    expert_id_dtype,
    pack_expert_shard,
    reported_samples,
    unpack_expert_shard,
)
from dapo_mega.config import AlgoConfig
from dapo_mega.models.shape import ModelShape
from dapo_mega.rollout.samples import compact_routed_experts

LAYERS, TOP_K = 3, 2


def moe_shape(experts: int = 8) -> ModelShape:
    return ModelShape(model_type="qwen3_moe", num_layers=LAYERS, hidden_size=8, ffn_hidden_size=8,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=False,
                      qkv_bias=False, vocab_size=50, num_experts=experts, num_experts_per_tok=TOP_K,
                      moe_ffn_hidden_size=4)


def sglang_report(array: np.ndarray) -> str:
    """What SGLang sends: base64 of int32."""
    return base64.b64encode(array.astype(np.int32).tobytes()).decode()


def step_samples(num: int = 16, experts: int = 8, seed: int = 0):
    """`num` samples of random lengths, their engine reports (compact, as samples keep them; one
    as SGLang sends it; one missing; one of a wrong size) and the arrays they hold."""
    rng = np.random.default_rng(seed)
    samples, arrays = [], []
    for i in range(num):
        sample = TrainSample(prompt_ids=[5] * int(rng.integers(2, 6)), response_ids=[6] * int(rng.integers(1, 9)))
        array = rng.integers(0, experts, (sample.length - 1, LAYERS, TOP_K))
        sample.routed_experts = compact_routed_experts(sglang_report(array))
        samples.append(sample)
        arrays.append(array)
    samples[1].routed_experts = sglang_report(arrays[1])                        # as SGLang sends it
    samples[2].routed_experts, arrays[2] = None, None                           # the engine reported none
    samples[3].routed_experts = sglang_report(np.zeros((2, LAYERS, TOP_K)))    # another span: no report
    arrays[3] = None
    return samples, arrays


@pytest.mark.parametrize("balanced", [True, False])
def test_each_data_parallel_rank_gets_exactly_its_samples_reports(balanced):
    shape, dp = moe_shape(), 4
    samples, arrays = step_samples()
    algo = AlgoConfig(n_samples_per_prompt=4, mini_batch_size=2, train_batch_size=4)
    mini_batches = step_mini_batches(len(samples), algo, megatron_seed=3, step=7)
    shares = data_parallel_samples(samples, mini_batches, dp, balanced)
    # the learner's own rule: its share of each mini-batch (MegatronLearner._shard), every sample once
    assert shares == [[i for mb in mini_batches for i in shard_of(samples, mb, rank, dp, balanced)]
                      for rank in range(dp)]
    assert sorted(i for share in shares for i in share) == list(range(len(samples)))

    reports = [s.routed_experts for s in samples]
    reported = reported_samples(samples, reports, shape)
    assert reported == len(samples) - 2
    total = 0
    for rank, share in enumerate(shares):
        shard = pack_expert_shard(samples, reports, share, shape, reported)
        # one byte an expert id: the shard's payload is its reports' positions x layers x top-k
        kept = [i for i in share if arrays[i] is not None]
        assert shard.payload.numel() == sum(arrays[i].size for i in kept)
        received = unpack_expert_shard(shard, shape)
        assert received.reported == reported and sorted(received.reports) == sorted(kept)
        for i in kept:
            assert received.get(i).dtype == np.uint8 and (received.get(i) == arrays[i]).all()
        total += shard.payload.numel()
    assert total == sum(a.size for a in arrays if a is not None)  # every byte goes to one rank only


def test_more_than_256_experts_take_two_bytes_and_the_samples_read_alike():
    shape = moe_shape(experts=300)
    samples, arrays = step_samples(num=6, experts=300, seed=1)
    assert expert_id_dtype(300) == np.int16 and expert_id_dtype(256) == np.uint8
    experts = RoutedExperts.of_samples(samples, shape)
    assert experts.reported == 4 and sorted(experts.reports) == [0, 1, 4, 5]
    for i in experts.reports:
        assert experts.get(i).dtype == np.int16 and (experts.get(i) == arrays[i]).all()
    assert experts.nbytes == 2 * sum(arrays[i].size for i in experts.reports)


def test_a_shard_whose_header_does_not_match_its_bytes_is_refused():
    shape = moe_shape()
    samples, _ = step_samples(num=4)
    shard = pack_expert_shard(samples, [s.routed_experts for s in samples], [0, 1], shape, 2)
    shard.payload = shard.payload[:-1]
    with pytest.raises(ValueError, match="whose header lists"):
        unpack_expert_shard(shard, shape)


def test_shares_follow_the_step_seed():
    algo = AlgoConfig(n_samples_per_prompt=2, mini_batch_size=2, train_batch_size=4)
    samples = [TrainSample(prompt_ids=[1] * random.Random(i).randint(2, 9), response_ids=[2]) for i in range(8)]
    first = data_parallel_samples(samples, step_mini_batches(8, algo, 0, step=1), 2, True)
    assert first == data_parallel_samples(samples, step_mini_batches(8, algo, 0, step=1), 2, True)
    assert any(data_parallel_samples(samples, step_mini_batches(8, algo, 0, step=s), 2, True) != first
               for s in range(2, 6))
    unshuffled = AlgoConfig(n_samples_per_prompt=2, mini_batch_size=2, train_batch_size=4, shuffle_mini_batches=False)
    assert step_mini_batches(8, unshuffled, 0, step=1) == [[0, 1, 2, 3], [4, 5, 6, 7]]
