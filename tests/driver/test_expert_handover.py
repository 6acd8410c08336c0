"""A mixture's routed experts from the driver to the learner ranks (issue #46 item 2,
`driver/expert_handover.py`), 4 gloo ranks laid out TP 2 x DP 2: the samples the driver
broadcasts carry no experts (their pickled size is the samples' own), and each rank receives
exactly its DP rank's share of the reports (the first rank of DP rank 1 from the driver, the
TP peers from their DP rank's first rank), equal to what the engines reported."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
from dist_helpers import run_distributed

from dapo_mega.algo.train_sample import TrainSample
from dapo_mega.backends.megatron.batch import data_parallel_samples, step_mini_batches
from dapo_mega.config import DapoConfig
from dapo_mega.models.shape import ModelShape
from dapo_mega.rollout.samples import compact_routed_experts

LAYERS, TOP_K, EXPERTS, TP, DP = 24, 8, 64, 2, 2
SHAPE = ModelShape(model_type="qwen3_moe", num_layers=LAYERS, hidden_size=8, ffn_hidden_size=8, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=4, tie_word_embeddings=False, qkv_bias=False, vocab_size=50,
                   num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_ffn_hidden_size=4)
STEP = 5


def _config() -> DapoConfig:
    cfg = DapoConfig()
    cfg.algo.n_samples_per_prompt, cfg.algo.mini_batch_size, cfg.algo.train_batch_size = 4, 2, 4
    return cfg


def _step_samples():
    """16 samples with their engines' reports (one without), and the reported arrays."""
    import base64

    rng = np.random.default_rng(46)
    samples, arrays = [], []
    for i in range(16):
        s = TrainSample(prompt_ids=rng.integers(3, 40, int(rng.integers(5, 20))).tolist(),
                        response_ids=rng.integers(3, 40, int(rng.integers(5, 40))).tolist(), advantage=1.0)
        array = rng.integers(0, EXPERTS, (s.length - 1, LAYERS, TOP_K))
        s.routed_experts = compact_routed_experts(base64.b64encode(array.astype(np.int32).tobytes()).decode())
        samples.append(s)
        arrays.append(array)
    samples[6].routed_experts, arrays[6] = None, None
    return samples, arrays


def _hand_over(rank: int, world: int, run_dir: str):
    import torch.distributed as dist

    from dapo_mega import distributed as D
    from dapo_mega.driver.expert_handover import ExpertHandOver
    from dapo_mega.driver.roles import DriverRole, LearnerRankRole
    from dapo_mega.driver.run_state import RunState
    from dapo_mega.engines.book import EngineBook
    from dapo_mega.rollout.source import RolloutBatch

    dist.init_process_group("gloo")
    try:
        cfg = _config()
        layout = SimpleNamespace(dp=DP, coordinates_of=lambda r: (r % TP, 0, r // TP, 0))  # tp-cp-dp-pp order
        experts = ExpertHandOver.build(cfg, layout, SHAPE, driver_rank=0)
        host = D.host_group()
        if rank == 0:
            role = DriverRole(cfg, RunState(run_dir, cfg.trainer), SimpleNamespace(manager=SimpleNamespace(
                book=EngineBook())), None, [], None, host_group=host, experts=experts)
            role.advantage_step = lambda batch: _step_samples()[0]
        else:
            role = LearnerRankRole(host_group=host, experts=experts)
        samples = role.train_samples(RolloutBatch(step=STEP))
        received = role.routed_experts(samples, STEP)
        if rank == 0:
            role.gate.close()
        return {"pickled": len(pickle.dumps(samples)), "carried": [s.routed_experts for s in samples],
                "lengths": [s.length for s in samples], "reported": received.reported,
                "reports": {i: r.tolist() for i, r in received.reports.items()}}
    finally:
        dist.destroy_process_group()


def test_each_rank_receives_its_data_parallel_share_and_the_broadcast_carries_none(tmp_path):
    runs = run_distributed(_hand_over, TP * DP, args=(str(tmp_path),), timeout_s=180)
    samples, arrays = _step_samples()
    report_bytes = sum(len(s.routed_experts or "") for s in samples)
    for r in runs:
        assert r["carried"] == [None] * len(samples)                      # no report in the broadcast
        assert r["lengths"] == [s.length for s in samples]
        assert r["pickled"] < report_bytes / 5, (r["pickled"], report_bytes)
        assert r["reported"] == len(samples) - 1                         # the step's, on every rank
    shares = data_parallel_samples(samples, step_mini_batches(len(samples), _config().algo, _config().megatron.seed,
                                                               STEP), DP, _config().megatron.balance_data_parallel)
    for rank, r in enumerate(runs):
        share = shares[rank // TP]
        assert sorted(r["reports"]) == sorted(i for i in share if arrays[i] is not None), rank
        for i, report in r["reports"].items():
            assert (np.asarray(report) == arrays[i]).all(), (rank, i)
    assert set(runs[0]["reports"]).isdisjoint(runs[TP]["reports"])        # a DP rank holds no other's
