"""Every data-parallel rank runs the same number of micro-batches.

FP8 delayed scaling all-reduces amaxes over every TP x DP rank of a stage at each
grad-enabled forward and in backward, so DP ranks packed separately must still run equal
micro-batch counts, and an interleaved pipeline accepts only some counts. The pure rule
(`equalized_micro_batch_count`) and the padding micro-batch first, then the learner at DP 2
(two gloo processes whose samples pack into 2 and 1 micro-batches) and at PP 2 x VPP 2.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from dist_helpers import make_config, run_distributed

from dapo_mega.algo import TrainSample
from dapo_mega.backends.megatron.batch import (
    build_padding_micro_batch,
    collate_packed_micro_batch,
    gather_responses,
    plan_packed,
    shard_balanced,
)
from dapo_mega.backends.megatron.packing import equalized_micro_batch_count, measure_layout


# ---------------------------------------------------------------------- the count rule
def test_count_is_the_largest_without_interleaving():
    assert equalized_micro_batch_count([10, 11, 11, 10, 10, 10, 10, 10]) == 11
    assert equalized_micro_batch_count([3, 5], pp_size=4) == 5  # 1F1B takes any count
    assert equalized_micro_batch_count([]) == 1
    assert equalized_micro_batch_count([0, 0]) == 1


def test_count_fits_the_interleaved_schedule():
    # default group N = PP: a multiple of PP, at least PP
    assert [equalized_micro_batch_count([m], pp_size=4, vpp_size=2) for m in (1, 3, 4, 5, 8, 9)] == \
        [4, 4, 4, 8, 8, 12]
    assert equalized_micro_batch_count([11, 10], pp_size=2, vpp_size=2) == 12
    assert equalized_micro_batch_count([3], pp_size=2, vpp_size=1) == 4  # megatron interleaves with VPP 1 too
    # N = 3 at PP 2: M >= 3 and M mod 3 in {0, 2}
    assert [equalized_micro_batch_count([m], pp_size=2, vpp_size=2, group_size=3) for m in range(1, 9)] == \
        [3, 3, 3, 5, 5, 6, 8, 8]
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage"):
        equalized_micro_batch_count([4], pp_size=4, vpp_size=2, group_size=2)


def _megatron_interleaved_accepts(m: int, pp: int, group: int) -> bool:
    """The checks of megatron-core 0.16.1 forward_backward_pipelining_with_interleaving."""
    if group > m or group < pp:
        return False
    return not 0 < m % group < pp


def test_count_is_the_smallest_megatron_accepts():
    for pp in (2, 3, 4):
        for group in (None, pp, pp + 1, 2 * pp + 1):
            n = pp if group is None else group
            for m in range(1, 30):
                got = equalized_micro_batch_count([m], pp_size=pp, vpp_size=2, group_size=group)
                assert _megatron_interleaved_accepts(got, pp, n), (pp, group, m, got)
                assert got >= m and not any(_megatron_interleaved_accepts(k, pp, n) for k in range(m, got))


def test_32b_shape_packs_unequal_counts_that_the_rule_equalizes():
    """512 samples per mini-batch over DP 8, 22,528-token THD rows: the packer alone gives
    ranks different counts on some mini-batches (the hang); the rule gives one count."""
    rng = random.Random(0)
    unequal = 0
    for trial in range(6):
        lengths = [min(20480, int(rng.lognormvariate(math.log(1500), 1.0))) + rng.randint(80, 220)
                   for _ in range(512)]
        counts = measure_layout(lengths, 8, 22528, packing=True, balanced=True, thd=True, multiple=16).micro_batches
        unequal += len(set(counts)) > 1
        assert equalized_micro_batch_count(counts) == max(counts)
        assert equalized_micro_batch_count(counts, pp_size=4, vpp_size=2) % 4 == 0
    assert unequal >= 1, "the long tail should give some mini-batch unequal counts"


# ---------------------------------------------------------------------- the padding micro-batch
def test_padding_micro_batch_is_empty_and_shaped_like_its_pass():
    samples = [TrainSample([1, 2], [3, 4, 5], advantage=1.0), TrainSample([6], [7, 8], advantage=-1.0)]
    for attention, multiple in (("mask", 1), ("thd", 16), ("causal", 4)):
        rows = [[0, 1]] if attention != "causal" else [[0], [1]]
        real = collate_packed_micro_batch(samples, rows, seq_len=16, seq_multiple=multiple, attention=attention)
        for uniform in (True, False):
            pad = build_padding_micro_batch(real, uniform=uniform, seq_multiple=multiple)
            assert pad.attention == attention and pad.placements == [] and pad.real_tokens == 0
            assert pad.tokens.shape == (real.tokens.shape if uniform else (1, max(2, multiple)))
            assert pad.response_mask.sum() == 0 and pad.advantages.abs().sum() == 0
            assert gather_responses(pad.response_mask, pad).numel() == 0
            if attention == "thd":
                assert pad.cu_seqlens.tolist() == [0, pad.tokens.shape[1]]
            if attention == "mask":  # every pad column attends to itself: no fully masked softmax row
                assert not pad.attention_mask[:, 0].diagonal(dim1=-2, dim2=-1).any()


# ---------------------------------------------------------------------- the learner at DP 2
# One mini-batch of 4 samples, 24 tokens per DP rank after balancing: rank A [20, 4] packs
# into 2 micro-batches (rows as wide as 20, one per 32-token micro-batch), rank B [12, 12]
# into 1 (two 12-wide rows). Two mini-batches, so the π_old pass and both updates see it.
LENGTHS = [(4, 16), (2, 2), (4, 8), (3, 9)] * 2
MICRO_BATCH_TOKENS = 32


def _samples():
    rng = random.Random(7)
    out = []
    for k, (p, r) in enumerate(LENGTHS):
        out.append(TrainSample(prompt_ids=[rng.randrange(3, 90) for _ in range(p)],
                               response_ids=[rng.randrange(3, 90) for _ in range(r)],
                               advantage=1.0 if k % 2 == 0 else -1.0))
    return out


def test_dp2_samples_pack_into_different_counts():
    """The test data's premise, from the pure functions the learner uses."""
    samples = _samples()
    mini_batch = list(range(4))
    counts = []
    for rank in range(2):
        groups, _ = plan_packed(samples, shard_balanced(samples, mini_batch, rank, 2), MICRO_BATCH_TOKENS, thd=False)
        counts.append(len(groups))
    assert sorted(counts) == [1, 2]


def _record_schedule(learner, calls):
    """Record each schedule pass (num_microbatches, forward_only) and each grad-enabled model
    forward (where Transformer Engine would all-reduce the FP8 amaxes)."""
    import megatron.core.pipeline_parallel as pipeline_parallel

    inner = pipeline_parallel.get_forward_backward_func

    def counted_get():
        fn = inner()

        def run(**kwargs):
            calls["passes"].append((kwargs["num_microbatches"], kwargs["forward_only"]))
            return fn(**kwargs)
        return run
    pipeline_parallel.get_forward_backward_func = counted_get

    def hook(module, args):
        calls["forwards"] += 1
        calls["grad_forwards"] += int(torch.is_grad_enabled())
    for chunk in learner.model_chunks:
        chunk.register_forward_pre_hook(hook)


def _dp2_run(rank, world, pad):
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = make_config(micro_batch_tokens=MICRO_BATCH_TOKENS, train_batch_size=2, mini_batch_size=1, n=4, lr=1e-2)
    cfg.algo.shuffle_mini_batches = False
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    torch.manual_seed(0)
    learner = MegatronLearner(cfg, hf, layout)
    initial = {name: p.detach().clone() for name, p in learner.model_chunks[0].named_parameters()}
    if not pad:  # the layout before equal counts: each rank's own packing
        learner._schedule_passes = lambda samples, shards: [learner._micro_batches(samples, s) for s in shards]
    calls = {"passes": [], "forwards": 0, "grad_forwards": 0}
    _record_schedule(learner, calls)
    metrics = learner.train_step(_samples(), step=0)
    sft = learner.sft_step(_samples()[:4], lr=1e-3)
    weights = {name: p.detach().clone() for name, p in learner.model_chunks[0].named_parameters()}
    return {"calls": calls, "metrics": metrics, "sft": sft, "weights": weights, "initial": initial}


def test_dp_ranks_run_equal_micro_batch_counts_and_padding_changes_nothing():
    padded = run_distributed(_dp2_run, 2, args=(True,), timeout_s=240)
    plain = run_distributed(_dp2_run, 2, args=(False,), timeout_s=240)
    assert plain[0]["calls"] != plain[1]["calls"], "premise: unpadded ranks run different counts"
    a, b = padded[0]["calls"], padded[1]["calls"]
    assert a == b, f"DP ranks ran different schedules: {a} vs {b}"
    # π_old pass over the second mini-batch, two updates, then the SFT update: 2 each
    assert a["passes"] == [(2, True), (2, False), (2, False), (2, False)], a
    assert a["grad_forwards"] == 6
    for key in ("loss/pg", "actor/grad_norm", "actor/entropy", "loss/approx_kl", "loss/ratio_mean"):
        for rank in range(2):
            assert padded[rank]["metrics"][key] == pytest.approx(plain[rank]["metrics"][key], rel=1e-6, abs=1e-9), key
    assert padded[0]["sft"]["sft/loss"] == pytest.approx(plain[0]["sft"]["sft/loss"], rel=1e-6)
    assert padded[0]["sft"]["sft/grad_norm"] == pytest.approx(plain[0]["sft"]["sft/grad_norm"], rel=1e-6)
    for name, tensor in plain[0]["weights"].items():
        torch.testing.assert_close(padded[0]["weights"][name], tensor, atol=1e-6, rtol=1e-6, msg=name)
        torch.testing.assert_close(padded[1]["weights"][name], tensor, atol=1e-6, rtol=1e-6, msg=name)
    moved = max((padded[0]["weights"][n] - t).abs().max().item() for n, t in padded[0]["initial"].items())
    assert padded[0]["metrics"]["train/num_updates"] == 2.0 and moved > 1e-3, "the updates must move the weights"


# ---------------------------------------------------------------------- interleaved pipeline
def _vpp_run(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = make_config(pp=2, micro_batch_tokens=MICRO_BATCH_TOKENS, train_batch_size=1, mini_batch_size=1, n=4)
    cfg.model.tiny_num_layers = 4
    cfg.megatron.virtual_pipeline_model_parallel_size = 2
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    learner = MegatronLearner(cfg, hf, layout)
    calls = {"passes": [], "forwards": 0, "grad_forwards": 0}
    _record_schedule(learner, calls)
    samples = _samples()[:4]
    # uniform rows as wide as the 20-token sample, one per micro-batch: 3 micro-batches packed
    packed = len(learner._micro_batches(samples, range(4)))
    metrics = learner.train_step(samples, step=0)
    log_probs = learner.compute_log_probs(samples)
    return {"packed": packed, "passes": calls["passes"], "metrics": metrics, "log_probs": [t.tolist() for t in log_probs]}


def test_interleaved_pipeline_runs_a_count_its_schedule_accepts():
    """PP 2 x VPP 2: packing gives 3 micro-batches, which megatron's interleaved schedule
    refuses (3 mod 2 = 1 < PP); the learner runs 4."""
    results = run_distributed(_vpp_run, 2, timeout_s=240)
    assert results[0]["packed"] == 3
    for result in results:
        assert result["passes"] == [(4, False), (4, True)], result["passes"]
        assert result["metrics"]["train/num_updates"] == 1.0
        # π = π_old on the first update: −Σ Â / N over the 35 response tokens (24 of Â = +1,
        # 11 of Â = −1); the padding micro-batch adds no loss and no token
        assert result["metrics"]["loss/pg"] == pytest.approx(-13 / 35, rel=1e-5)
        assert all(len(lp) == len(s.response_ids) for lp, s in zip(result["log_probs"], _samples()[:4]))
