"""Sequence packing, balanced data-parallel shards, FP8 alignment and the mini-batch shuffle.

Pure functions first (packing.py, batch.py collation), then the learner: packed micro-batches
give the same per-sample log-probs, loss, metrics (TIS included) and gradients as one
sample per padded row, at TP 1, TP 2 and PP 2 (gloo processes, tests/dist_helpers.py).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from functools import partial

import pytest
import torch
from dist_helpers import run_distributed

from dapo_mega.algo import TrainSample
from dapo_mega.backends.megatron.batch import (
    collate_micro_batch,
    collate_packed_micro_batch,
    gather_responses,
    plan_packed,
    response_values,
    shard_balanced,
)
from dapo_mega.backends.megatron.packing import (
    fp8_token_multiple,
    measure_layout,
    pack_rows,
    partition_balanced,
    partition_contiguous,
    plan_packed_micro_batches,
    shuffle_groups,
    token_multiple,
)


def long_tailed_lengths(n: int, seed: int = 0, cap: int = 20480):
    """Log-normal response lengths (median ~1.5k, a tail to the 20k cap) plus ~150-token prompts."""
    rng = random.Random(seed)
    return [min(cap, int(rng.lognormvariate(math.log(1500), 1.0))) + rng.randint(80, 220) for _ in range(n)]


# ---------------------------------------------------------------------- pure functions
def test_partition_balanced_is_within_a_few_percent_on_a_long_tail():
    # 512 responses of a 32B mini-batch over DP 8 (64 per rank), and smaller splits
    lengths = long_tailed_lengths(512)
    for k in (2, 4, 8):
        parts = partition_balanced(lengths, k)
        assert sorted(i for p in parts for i in p) == list(range(512))  # a partition
        loads = [sum(lengths[i] for i in p) for p in parts]
        mean = sum(lengths) / k
        assert max(loads) / mean < 1.001, (k, max(loads) / mean)
    contiguous = [sum(lengths[i] for i in p) for p in partition_contiguous(512, 8)]
    assert max(contiguous) / (sum(lengths) / 8) > 1.1  # the problem being solved is real here
    # hand-worked differencing of {8,7,6,5,4}: 8-7 -> 1; 6-5 -> 1; 4-1 -> 3; 3-1 -> 2, so
    # 16/14 ({8,6,... } vs ...); longest-first greedy would leave 17/13
    parts = partition_balanced([8, 7, 6, 5, 4], 2)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [14, 16]
    assert sorted(map(len, partition_balanced([3, 1], 4))) == [0, 0, 1, 1]  # more ranks than samples


def test_shard_balanced_is_the_same_on_every_rank_and_covers_the_batch():
    samples = [TrainSample([1] * 5, [2] * n) for n in long_tailed_lengths(64, seed=3, cap=3000)]
    indices = list(range(10, 60))
    shards = [shard_balanced(samples, indices, r, 4) for r in range(4)]
    assert sorted(i for s in shards for i in s) == indices
    assert shards == [shard_balanced(samples, indices, r, 4) for r in range(4)]


def test_shuffle_groups_moves_whole_groups_deterministically():
    order = shuffle_groups(12, 4, seed=7)
    assert sorted(order) == list(range(12)) and order == shuffle_groups(12, 4, seed=7)
    blocks = [order[k:k + 4] for k in range(0, 12, 4)]
    assert all(b == list(range(b[0], b[0] + 4)) and b[0] % 4 == 0 for b in blocks)
    seeds = {tuple(shuffle_groups(64, 4, seed=s)) for s in range(6)}
    assert len(seeds) == 6  # the seed (the step) changes the order


def test_pack_rows_first_fit_decreasing_respects_the_budget():
    lengths = [9, 3, 7, 2, 5, 1]
    rows = pack_rows(lengths, range(6), row_tokens=10)
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    assert rows[0][0] == 0 and len(rows) == 3  # 27 tokens need 3 rows of 10: FFD finds them
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_rows(lengths, range(6), row_tokens=8)
    # alignment: padded row sizes stay within the budget
    rows = pack_rows(lengths, range(6), row_tokens=16, multiple=8)
    assert all(-(-sum(lengths[i] for i in r) // 8) * 8 <= 16 for r in rows)


def test_pack_rows_places_every_sample_where_textbook_first_fit_decreasing_does():
    """Skipping rows too full for the shortest sample must change no placement: compare with
    the textbook FFD (every row tried in order), on near-full rows (the local spec's rows as
    wide as the longest sample) and on wide THD rows, with and without alignment."""
    def textbook(lengths, row_tokens, multiple):
        rows, used = [], []
        for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
            fit = next((r for r in range(len(rows))
                        if -(-(used[r] + lengths[i]) // multiple) * multiple <= row_tokens), None)
            if fit is None:
                rows.append([i])
                used.append(lengths[i])
            else:
                rows[fit].append(i)
                used[fit] += lengths[i]
        return rows

    rng = random.Random(7)
    for trial in range(60):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 120))]
        multiple = rng.choice([1, 1, 8, 16])
        widest = -(-max(lengths) // multiple) * multiple
        for row_tokens in (widest, widest + rng.randint(0, 40), 4 * widest):
            row_tokens = -(-row_tokens // multiple) * multiple
            assert pack_rows(lengths, range(len(lengths)), row_tokens, multiple) == \
                textbook(lengths, row_tokens, multiple), (trial, row_tokens, multiple)


def test_uniform_plan_for_pipeline_parallel_has_one_shape():
    lengths = [9, 3, 7, 2, 5, 1, 4]
    groups, width = plan_packed_micro_batches(lengths, range(7), micro_batch_tokens=20, uniform=True)
    assert width == 10 or width == 9  # widest packed row
    assert len({len(g) for g in groups}) == 1
    assert sorted(i for g in groups for r in g for i in r) == list(range(7))


def test_fp8_alignment_of_packed_micro_batches():
    assert fp8_token_multiple(False) == 1
    assert fp8_token_multiple(True, "delayed") == fp8_token_multiple(True, "blockwise") == 16
    with pytest.raises(ValueError, match="mxfp8"):
        fp8_token_multiple(True, "mxfp8")
    assert token_multiple(tp=8, sequence_parallel=True, fp8_enabled=True) == 128
    assert token_multiple(tp=8, sequence_parallel=False, fp8_enabled=True) == 16
    rng = random.Random(1)
    samples = [TrainSample([5] * rng.randint(1, 9), [6] * rng.randint(1, 40)) for _ in range(40)]
    multiple = token_multiple(tp=2, sequence_parallel=True, fp8_enabled=True)
    for thd in (True, False):
        for uniform in (False, True):
            groups, width = plan_packed(samples, range(40), 256, thd=thd, uniform=uniform, seq_multiple=multiple)
            for rows in groups:
                mb = collate_packed_micro_batch(samples, rows, seq_len=width or None, seq_multiple=multiple,
                                                attention="thd" if thd else "mask")
                b, s = mb.tokens.shape
                # TE: product of all but the last dim of the GEMM input (tokens on this TP rank) % 16
                assert (b * s // 2) % 16 == 0 and s % 2 == 0, (b, s)


def test_collate_packed_row_layout_mask_and_cu_seqlens():
    a = TrainSample([1, 2], [3, 4, 5], advantage=1.0, old_log_probs=[-1.0, -2.0, -3.0])
    b = TrainSample([6], [7, 8], advantage=-2.0, loss_mask=[1, 0], engine_log_probs=[-0.5, -0.6])
    mb = collate_packed_micro_batch([a, b], [[0, 1]], seq_len=10, attention="mask")
    assert mb.tokens[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 0, 0]
    assert mb.position_ids[0, :8].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    # labels stop at each sample's end: 5 does not predict 6
    assert mb.labels[0].tolist() == [2, 3, 4, 5, 0, 7, 8, 0, 0, 0]
    assert mb.response_mask[0].tolist() == [0, 1, 1, 1, 0, 1, 0, 0, 0, 0]
    assert mb.advantages[0].tolist() == [0, 1, 1, 1, 0, -2, -2, 0, 0, 0]
    allowed = ~mb.attention_mask[0, 0]
    assert allowed[4, :5].all() and not allowed[4, 5:].any()          # a: causal inside a
    assert allowed[7, 5:8].all() and not allowed[7, :5].any()         # b never sees a
    assert not allowed[6, 7] and allowed[9, 9] and not allowed[9, 8]  # causal; pad sees itself
    values = response_values(torch.arange(10.0).unsqueeze(0), mb)
    assert values[0].tolist() == [1.0, 2.0, 3.0] and values[1].tolist() == [5.0, 6.0]
    gathered = gather_responses(mb.old_log_probs, mb)
    assert gathered.tolist() == [[-1.0, -2.0, -3.0], [0.0, 0.0, 0.0]]
    assert gather_responses(mb.engine_log_probs, mb)[1, :2].tolist() == pytest.approx([-0.5, -0.6])
    thd = collate_packed_micro_batch([a, b], [[0, 1]], seq_multiple=16, attention="thd")
    assert thd.tokens.shape == (1, 16) and thd.attention_mask is None
    assert thd.cu_seqlens.tolist() == [0, 5, 8, 16] and thd.cu_seqlens.dtype == torch.int32
    assert thd.max_seqlen == 8
    # one sample per row: the padded layout, no mask needed
    padded = collate_micro_batch([a, b], [0, 1, -1])
    assert padded.attention_mask is None and padded.tokens.shape == (3, 5) and padded.sample_indices == [0, 1]


def test_layout_measurement_packed_and_balanced_beats_padded_contiguous():
    lengths = long_tailed_lengths(256, seed=5)
    before = measure_layout(lengths, dp=4, micro_batch_tokens=22528, packing=False, balanced=False)
    after = measure_layout(lengths, dp=4, micro_batch_tokens=22528, packing=True, balanced=True, thd=True)
    assert after.useful_tokens == before.useful_tokens == sum(lengths)
    assert after.padding_efficiency > 0.95 > before.padding_efficiency
    assert after.dp_imbalance < 1.05 < before.dp_imbalance


# ---------------------------------------------------------------------- learner: packed == padded
def _make_samples(seed=0, num=8, vocab=90):
    rng = random.Random(seed)
    out = []
    for i in range(num):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        # one long response, the rest short: rows as wide as the long one hold several short ones
        response = [rng.randrange(3, vocab) for _ in range(20 if i == 3 else rng.randint(1, 9))]
        out.append(TrainSample(prompt_ids=prompt, response_ids=response, advantage=(1.0 if i % 2 == 0 else -1.3),
                               engine_log_probs=[-4.5 + (-1.0, -0.2, 0.3, 0.8)[(k + i) % 4]
                                                 for k in range(len(response))]))
    return out


def _packed_vs_padded(rank, world, tp, pp, loss_agg_mode):
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.batch import count_loss_tokens
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.config import DapoConfig
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = DapoConfig()
    cfg.model.tiny_num_layers = 2
    m = cfg.megatron
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = tp, pp
    m.micro_batch_tokens, m.transformer_impl = 64, "local"
    cfg.algo.temperature, cfg.algo.tis_cap, cfg.algo.loss_agg_mode = 0.7, 1.5, loss_agg_mode
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(m, world, hf).initialize()
    learner = MegatronLearner(cfg, hf, layout)
    samples = _make_samples()
    indices = list(range(len(samples)))

    def run(packed):
        m.sequence_packing = packed
        log_probs = learner.compute_log_probs(samples)
        old = [lp + 0.1 * ((torch.arange(len(lp)) % 3) - 1) for lp in log_probs]
        batch = [dataclasses.replace(s, old_log_probs=o.tolist()) for s, o in zip(samples, old)]
        micro = learner._micro_batches(batch, indices)
        learner._zero_grads()
        tokens = float(count_loss_tokens(batch, indices))
        outputs = learner._run_schedule(micro, partial(learner._policy_loss_func, tokens, float(len(batch))),
                                        forward_only=False)
        grads = {name: p.main_grad.detach().clone() for chunk in learner.ddp_chunks
                 for name, p in chunk.named_parameters()}
        keys = ("loss", "num_tokens") + learner._metric_keys
        sums = {k: sum(float(o[k]) * (1.0 if k in ("loss", "num_tokens") else float(o["num_tokens"]))
                       for o in outputs) for k in keys}
        rows = max(max(Counter(p.row for p in mb.placements).values(), default=0) for mb in micro)
        return {"log_probs": log_probs, "grads": grads, "sums": sums, "micro_batches": len(micro),
                "max_samples_per_row": rows}

    padded, packed = run(False), run(True)
    learner._zero_grads()
    return {"padded": padded, "packed": packed, "last_stage": layout.is_last_stage and layout.tp_rank == 0}


@pytest.mark.parametrize("tp,pp,world,mode", [(1, 1, 1, "token-mean"), (1, 1, 1, "seq-mean-token-mean"),
                                              (2, 1, 2, "token-mean"), (1, 2, 2, "token-mean")],
                         ids=["tp1", "tp1-seqmean", "tp2", "pp2"])
def test_packed_equals_padded(tp, pp, world, mode):
    results = run_distributed(_packed_vs_padded, world, args=(tp, pp, mode), timeout_s=240)
    for rank, res in enumerate(results):
        padded, packed = res["padded"], res["packed"]
        assert packed["max_samples_per_row"] > 1, "the test must actually pack several samples into a row"
        assert packed["micro_batches"] <= padded["micro_batches"]
        for a, b in zip(padded["log_probs"], packed["log_probs"]):
            torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)
        assert sum(float(g.abs().sum()) for g in padded["grads"].values()) > 0
        for name, grad in padded["grads"].items():
            torch.testing.assert_close(packed["grads"][name], grad, atol=1e-7, rtol=1e-4, msg=f"rank {rank} {name}")
        if res["last_stage"]:
            for key, value in padded["sums"].items():
                assert math.isclose(packed["sums"][key], value, rel_tol=1e-5, abs_tol=1e-7), (key, value,
                                                                                           packed["sums"][key])
            assert padded["sums"]["tis/truncated_frac"] > 0  # TIS ran and truncated some tokens


def test_async_32b_config_turns_on_tis_with_engine_log_probs():
    from dapo_mega.config import load_config

    for name in ("dapo_qwen2.5_32b_disagg", "dapo_qwen2.5_32b_disagg_fp8"):
        cfg = load_config([f"+experiment={name}"])
        assert cfg.algo.correction_mode() == "tis" and cfg.algo.tis_cap == 2.0, name
        assert not cfg.algo.use_engine_logprobs and cfg.cluster.max_staleness == 1, name
    fp8 = load_config(["+experiment=dapo_qwen2.5_32b_fp8"]).algo  # synchronous: FP8 numerics only
    assert (fp8.correction_mode(), fp8.geo_mask_low, fp8.geo_mask_high, fp8.tis_cap) == ("geo_mask", 0.99, 1.01, None)
    assert load_config(["+experiment=dapo_qwen2.5_32b"]).algo.correction_mode() == "none"  # the paper's run


def _train_step_tis(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.config import DapoConfig
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = DapoConfig()
    cfg.model.tiny_num_layers = 1
    cfg.megatron.micro_batch_tokens, cfg.megatron.transformer_impl = 64, "local"
    a = cfg.algo
    a.train_batch_size, a.mini_batch_size, a.n_samples_per_prompt, a.tis_cap, a.lr_warmup_steps = 2, 1, 4, 1.5, 0
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    return MegatronLearner(cfg, hf, layout).train_step(_make_samples(), step=3)


def test_train_step_reports_tis_ratio_statistics():
    metrics = run_distributed(_train_step_tis, 1, timeout_s=240)[0]
    assert metrics["train/num_updates"] == 2.0
    assert 0.0 < metrics["tis/weight_mean"] <= 1.5
    assert 0.0 < metrics["tis/truncated_frac"] < 1.0
    assert metrics["tis/mismatch_kl"] > 0.0 and math.isfinite(metrics["tis/log_ratio_mean"])
    # packed rows as wide as the longest sample carry some padding; one DP rank: no imbalance
    assert 0.5 < metrics["perf/padding_efficiency"] <= 1.0 and metrics["perf/dp_imbalance"] == 1.0


def test_layout_measurement_by_hand():
    lengths = [10, 2, 6, 4]
    # contiguous, padded: rank 0 {10, 2}: 10·2 > 12, so two micro-batches (10 + 2 columns);
    # rank 1 {6, 4}: one micro-batch 2 rows × 6 = 12 -> 24 computed for 22 useful
    padded = measure_layout(lengths, dp=2, micro_batch_tokens=12, packing=False, balanced=False)
    assert (padded.rank_tokens, padded.micro_batches) == ([12, 12], [2, 1])
    assert padded.padding_efficiency == pytest.approx(22 / 24) and padded.dp_imbalance == 1.0
    # Karmarkar-Karp: 10|6 -> {10,4}|{6,4}... -> {10}|{6,4,2}; THD rows of <= 12: no padding
    packed = measure_layout(lengths, dp=2, micro_batch_tokens=12, packing=True, balanced=True, thd=True)
    assert sorted(packed.rank_tokens) == [10, 12] and packed.padding_efficiency == 1.0
    assert packed.dp_imbalance == pytest.approx(12 / 11)
    # FP8 alignment (multiple 8): rows round up to 16 and 16 -> 32 computed
    aligned = measure_layout(lengths, dp=2, micro_batch_tokens=16, packing=True, balanced=True, thd=True, multiple=8)
    assert aligned.computed_tokens == 32


def test_plan_reports_padding_efficiency_and_dp_imbalance_for_32b():
    from dapo_mega.config import load_config
    from dapo_mega.plan.memory import LengthAssumption, compute_plan, format_plan

    cfg = load_config(["+experiment=dapo_qwen2.5_32b"])
    plan = compute_plan(cfg)
    eff = plan.learner_efficiency
    assert eff.assumption.samples == cfg.algo.mini_batch_size * cfg.algo.n_samples_per_prompt
    assert eff.configured.thd and eff.configured.token_multiple == 8  # SP over TP 8
    assert eff.configured.padding_efficiency > 0.99 and eff.configured.dp_imbalance < 1.01
    assert eff.padded_contiguous.padding_efficiency < 0.8 and eff.padded_contiguous.dp_imbalance > 1.05
    text = format_plan(plan)
    assert "padding efficiency" in text and "DP imbalance" in text
    # a narrower distribution pads less, and the plan follows the assumption
    narrow = compute_plan(cfg, LengthAssumption(response_median=1000, response_sigma=0.1))
    assert narrow.learner_efficiency.padded_contiguous.padding_efficiency > 0.85
    cfg.megatron.balance_data_parallel = cfg.megatron.sequence_packing = False
    assert compute_plan(cfg).learner_efficiency.configured.dp_imbalance == pytest.approx(
        eff.padded_contiguous.dp_imbalance)


def _shuffle_run(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.config import DapoConfig
    from dapo_mega.models.tiny import tiny_hf_config

    def learner(shuffle):
        cfg = DapoConfig()
        cfg.model.tiny_num_layers = 1
        cfg.megatron.micro_batch_tokens, cfg.megatron.transformer_impl = 64, "local"
        a = cfg.algo
        a.train_batch_size, a.mini_batch_size, a.n_samples_per_prompt, a.lr, a.lr_warmup_steps = 2, 1, 4, 1e-2, 0
        a.shuffle_mini_batches = shuffle
        return cfg, MegatronLearner(cfg, hf, layout)

    cfg = DapoConfig()
    cfg.model.tiny_num_layers = 1
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    samples = _make_samples()
    # a step whose seed swaps the two groups
    step = next(s for s in range(50) if shuffle_groups(8, 4, seed=cfg.megatron.seed * 1_000_003 + s)[0] == 4)
    order = shuffle_groups(8, 4, seed=cfg.megatron.seed * 1_000_003 + step)
    out = {}
    for name, shuffle, batch in (("shuffled", True, samples), ("reordered", False, [samples[i] for i in order]),
                                 ("prompt_order", False, samples)):
        _, lrn = learner(shuffle)
        lrn.train_step(batch, step=step)
        out[name] = lrn.compute_log_probs(samples)
    return out


def test_mini_batches_see_the_groups_in_seeded_shuffled_order():
    out = run_distributed(_shuffle_run, 1, timeout_s=300)[0]
    for a, b in zip(out["shuffled"], out["reordered"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)  # shuffle == training on the permuted batch
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(out["shuffled"], out["prompt_order"]))


def test_thd_micro_batch_becomes_megatron_packed_seq_params():
    from dapo_mega.backends.megatron.learner import MegatronLearner

    a = TrainSample([1, 2], [3, 4, 5])
    b = TrainSample([6], [7, 8])
    thd = collate_packed_micro_batch([a, b], [[0, 1]], seq_multiple=16, attention="thd")
    params = MegatronLearner._packed_seq_params(thd)
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 8
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 5, 8, 16]
    assert MegatronLearner._packed_seq_params(collate_packed_micro_batch([a, b], [[0, 1]])) is None


def _cpu_mode_probe(rank, world):
    import megatron.core.pipeline_parallel.schedules as schedules

    from dapo_mega.backends.megatron.cpu_support import enable_cpu_support, without_function_mode

    assert enable_cpu_support()
    outside = torch.zeros(1, device="cuda").device.type  # redirected by the mode
    try:
        with without_function_mode():
            torch.zeros(1, device="cuda")
        inside = "no error"
    except (RuntimeError, AssertionError) as exc:  # "Torch not compiled with CUDA enabled"
        inside = type(exc).__name__
    from megatron.core.transformer.utils import get_default_causal_mask

    return {"outside": outside, "inside": inside, "wrapped": hasattr(schedules.forward_step, "__wrapped__")
            and hasattr(schedules.backward_step, "__wrapped__"),
            "mask": get_default_causal_mask(3).tolist()}


def test_cpu_support_leaves_the_micro_batch_step_outside_the_function_mode():
    got = run_distributed(_cpu_mode_probe, 1, timeout_s=120)[0]
    assert got["outside"] == "cpu"
    assert got["inside"] != "no error"  # a CUDA call in the unintercepted part still fails loudly
    assert got["wrapped"]
    assert got["mask"] == [[False, True, True], [False, False, True], [False, False, False]]


EAGER_PROBE = """
import sys
import dapo_mega.backends.megatron  # installs the hook, as every learner, conversion and audit process does
from megatron.core.fusions import fused_bias_geglu, fused_bias_swiglu
import megatron.core.jit as jit
print(jit.jit_fuser is jit.noop_decorator, type(fused_bias_geglu.geglu).__name__,
      type(fused_bias_swiglu.swiglu).__name__, "torch._inductor.compile_fx" in sys.modules)
"""


def test_megatron_fusions_stay_eager_on_a_cpu_and_match_their_formula():
    """Substitution 7: megatron's fusions load undecorated (torch.compile's wrappers imported
    the inductor, ~1.7 s of a core per learner process) and compute what they say."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-W", "ignore", "-c", EAGER_PROBE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "function", "function", "False"], out.stdout
    from megatron.core.fusions.fused_bias_geglu import geglu

    y = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    a, b = y[:, :4], y[:, 4:]
    want = torch.nn.functional.gelu(a, approximate="tanh") * b  # GEGLU with the tanh GELU, by torch's own op
    torch.testing.assert_close(geglu(y), want, rtol=1e-5, atol=1e-6)
