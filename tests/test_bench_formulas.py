"""The pure parts of the benchmarks: waste estimator, time-to-target, FLOPs and MFU.

No benchmark is run here; the figures are checked against hand computations and, for the
waste estimator, against a Monte-Carlo simulation of dynamic sampling.
"""

import random
import sys
from math import comb
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_dynamic_sampling as ds  # noqa: E402
import bench_e2e_trl as e2e  # noqa: E402
import gpu_node  # noqa: E402

from dapo_mega.models.shape import ModelShape  # noqa: E402


# ------------------------------------------------------------------ Eq. (1)-(3) of bench_dynamic_sampling
def test_p_informative_by_hand():
    # G = 2: informative iff one right one wrong: 2 p (1 - p)
    assert ds.p_informative(0.3, 2) == pytest.approx(2 * 0.3 * 0.7)
    # G = 8, p = 1/2: 1 - 2 / 256
    assert ds.p_informative(0.5, 8) == pytest.approx(1 - 2 / 256)
    assert ds.p_informative(0.0, 8) == 0.0 and ds.p_informative(1.0, 8) == 0.0


def test_informative_estimate_is_the_indicator_for_one_group():
    for k in range(9):
        assert ds.informative_estimate(k, 8, 8) == (0.0 if k in (0, 8) else 1.0)
    with pytest.raises(ValueError):
        ds.informative_estimate(1, 4, 8)


def test_informative_estimate_is_unbiased():
    # E over K ~ Binomial(n, p) of Eq. (3) equals Eq. (1), exactly (sum over the pmf)
    n, g, p = 12, 4, 0.3
    expected = sum(comb(n, k) * p ** k * (1 - p) ** (n - k) * ds.informative_estimate(k, n, g) for k in range(n + 1))
    assert expected == pytest.approx(ds.p_informative(p, g), abs=1e-12)
    # whereas the plug-in is biased low here
    plugin = sum(comb(n, k) * p ** k * (1 - p) ** (n - k) * ds.p_informative(k / n, g) for k in range(n + 1))
    assert plugin < expected - 0.01


def test_minimum_samples_per_trained_by_hand():
    # two prompts, one group each: one informative, one all wrong -> 2 groups generated per kept
    assert ds.minimum_samples_per_trained([(3, 8), (0, 8)], 8) == pytest.approx(2.0)
    # plus two carried (informative) groups: 4 groups, 3 informative
    assert ds.minimum_samples_per_trained([(3, 8), (0, 8)], 8, extra_informative_groups=2) == pytest.approx(4 / 3)


def _rows(step, prompt, correct, reason):
    return [{"step": step, "prompt_id": prompt, "correct": c, "reject_reason": reason} for c in correct]


def test_ledger_waste_by_hand():
    g = 4
    rows = (_rows(1, "a", [1, 0, 0, 1], "kept") + _rows(1, "b", [0, 0, 0, 0], "all_wrong_group")
            + _rows(2, "c", [1, 1, 1, 1], "all_correct_group") + _rows(2, "d", [1, 0, 1, 1], "verifier_error"))
    out = ds.ledger_waste(rows, g, carried_groups_at_end=1)
    assert out["samples_trained"] == 8           # groups a and d
    assert out["samples_generated"] == 16 + 4    # 4 ledger groups + 1 carried
    assert out["measured"] == pytest.approx(20 / 8)
    # 5 groups, 3 informative (a, d, the carried one)
    assert out["minimum"] == pytest.approx(5 / 3)
    assert out["ratio"] == pytest.approx((5 / 3) / (20 / 8))
    # pooled per step: step 1 accuracy 2/8, step 2 accuracy 7/8
    pooled = 16 / (8 * ds.p_informative(2 / 8, g) + 8 * ds.p_informative(7 / 8, g))
    assert out["minimum_per_step_pooled"] == pytest.approx(pooled)


def test_waste_of_a_simulated_carry_over_sampler_is_close_to_one():
    """Dynamic sampling with carry-over, simulated: measured ~ minimum (ratio near 1)."""
    rng = random.Random(0)
    g, batch, gen_batch = 8, 16, 32
    rows, carry, steps = [], 0, 200
    for step in range(1, steps + 1):
        kept = carry
        while kept < batch:
            for i in range(gen_batch):
                p = rng.choice([0.05, 0.3, 0.6, 0.95])
                correct = [int(rng.random() < p) for _ in range(g)]
                informative = 0 < sum(correct) < g
                reason = "kept" if informative else ("all_correct_group" if sum(correct) == g else "all_wrong_group")
                rows += _rows(step, f"{step}-{kept}-{i}", correct, reason)
                kept += informative
        carry = kept - batch
    # the simulation writes surplus informative groups as kept in the step that generated them
    out = ds.ledger_waste(rows, g, carried_groups_at_end=0)
    assert out["ratio"] == pytest.approx(1.0, abs=1e-9)
    # and the measured waste matches Eq. (2) with the true accuracies within sampling noise
    truth = 1 / (sum(ds.p_informative(p, g) for p in (0.05, 0.3, 0.6, 0.95)) / 4)
    assert out["measured"] == pytest.approx(truth, rel=0.05)


# ------------------------------------------------------------------ bench_e2e_trl time accounting
def test_dapo_mega_eval_curve_excludes_eval_and_save():
    rows = [{"step": 0, "time/unix": 100.0, "eval/avg_at_k": 0.1},
            {"step": 1, "time/unix": 110.0},
            {"step": 2, "time/unix": 125.0, "time/eval_s": 3.0, "eval/avg_at_k": 0.2},
            {"step": 3, "time/unix": 140.0, "time/save_s": 2.0},
            {"step": 4, "time/unix": 160.0, "time/eval_s": 4.0, "eval/avg_at_k": 0.3}]
    for r, (roll, learn) in zip(rows[1:], [(4.0, 3.0), (5.0, 4.0), (6.0, 5.0), (7.0, 6.0)]):
        r.update({"time/rollout_s": roll, "time/train_s": learn, "time/sync_s": 0.5})
    curve = e2e.dapo_mega_eval_curve(rows)
    assert [p["step"] for p in curve] == [0, 2, 4]
    assert [p["train_s"] for p in curve] == pytest.approx([0.0, 22.0, 51.0])
    # where the time to step 4 went: 22 s rollout, 18 s learner, 2 s sync, the rest 9 s
    assert curve[2]["split"] == pytest.approx({"rollout_s": 22.0, "learner_s": 18.0, "sync_s": 2.0, "other_s": 9.0})
    assert e2e.time_to_target(curve, 0.25)["step"] == 4
    assert e2e.time_to_target(curve, 0.5) is None


def test_summarize_ratio_is_trl_over_ours():
    ours = [{"step": 0, "train_s": 0.0, "avg_at_k": 0.1}, {"step": 2, "train_s": 10.0, "avg_at_k": 0.3}]
    trl = [{"step": 0, "train_s": 0.0, "avg_at_k": 0.1}, {"step": 2, "train_s": 20.0, "avg_at_k": 0.2},
           {"step": 4, "train_s": 40.0, "avg_at_k": 0.31}]
    out = e2e.summarize(ours, trl, 0.3)
    assert out["ratio"] == pytest.approx(4.0)
    # 4.0 = (TRL 10 s per step / ours 5 s per step) x (TRL 4 steps / ours 2 steps)
    assert out["per_step_ratio"] == pytest.approx(2.0) and out["steps_to_target"] == {"ours": 2, "trl": 4}
    assert "ratio" not in e2e.summarize(ours, trl[:2], 0.3)


def test_combine_seeds_sums_times_over_seeds_both_reached():
    def seed(n, ours_t, trl_t, ours_sps, trl_sps):
        return {"seed": n, "ours_reached": ours_t and {"step": 4, "train_s": ours_t},
                "trl_reached": trl_t and {"step": 8, "train_s": trl_t},
                "ours_seconds_per_step": ours_sps, "trl_seconds_per_step": trl_sps,
                "ours_budget_s": 40 * ours_sps, "trl_budget_s": 40 * trl_sps}
    out = e2e.combine_seeds([seed(1, 10.0, 30.0, 1.0, 2.0), seed(2, 20.0, 15.0, 3.0, 2.0), seed(3, None, 9.0, 2.0, 5.0)])
    # seeds 1 and 2: TRL 45 s / ours 30 s; seed 3 (ours never reached) left out of the ratio
    assert out["ratio"] == pytest.approx(1.5) and out["unreached"] == [3] and out["seeds_reached_by_both"] == 2
    assert out["ours"] == pytest.approx(15.0) and out["baseline"] == pytest.approx(22.5)
    assert out["steps_to_target"] == {"ours": [4, 4], "trl": [8, 8]}
    # seconds per step over all three seeds: TRL 3 / ours 2
    assert out["per_step_ratio"] == pytest.approx(1.5)
    # seed 3 with ours at its budget (40 steps x 2 s): (30 + 15 + 9) / (10 + 20 + 80)
    assert out["ratio_unreached_at_budget"] == pytest.approx(54 / 110)
    assert "ratio" not in e2e.combine_seeds([seed(1, None, 9.0, 1.0, 1.0)])


# ------------------------------------------------------------------ gpu_node FLOPs and MFU
def test_param_count_of_qwen25_7b_shape():
    # Qwen2.5-7B: 7.62e9 parameters (model card), 6.53e9 without embeddings
    shape = gpu_node.QWEN25_7B
    assert gpu_node.count_parameters(shape) == pytest.approx(7.615e9, rel=0.002)
    assert gpu_node.count_parameters(shape, include_embeddings=False) == pytest.approx(6.53e9, rel=0.005)


def test_train_flops_by_hand():
    shape = ModelShape(model_type="qwen2", hidden_size=4, num_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=2, ffn_hidden_size=8, vocab_size=10,
                       tie_word_embeddings=False, qkv_bias=True)
    # head_dim 2, one KV head -> kv width 2. Per layer: q 4*4+4=20, k 4*2+2=10, v 10, o 4*4=16,
    # mlp 3*4*8=96, 2 norms 2*4=8 -> 160; 2 layers 320, final norm 4 -> 324 without embeddings;
    # + embeddings 10*4 + lm head 10*4 -> 404
    assert gpu_node.count_parameters(shape, include_embeddings=False) == 324
    assert gpu_node.count_parameters(shape) == 404
    # dense matmul FLOPs use the non-embedding weights plus the LM head (no input embedding)
    n_matmul = gpu_node.count_parameters(shape, include_embeddings=False) + 10 * 4
    seqs = [3, 5]
    tokens = sum(seqs)
    # causal attention: QK^T and AV, 2 FLOPs per MAC, s^2/2 pairs, x3 for fwd+bwd
    attn = 3 * 2 * 2 * 2 * 4 * sum(s * s / 2 for s in seqs)
    assert gpu_node.train_flops(shape, seqs) == pytest.approx(6 * n_matmul * tokens + attn)


def test_mfu_by_hand():
    assert gpu_node.mfu(flops=989e12, seconds=2.0, peak_tflops=989.0) == pytest.approx(0.5)
    assert gpu_node.PEAK_TFLOPS["bf16"] == 989.0 and gpu_node.PEAK_TFLOPS["fp8"] == 1979.0


def test_gpu_node_parses_arguments_without_a_gpu():
    args = gpu_node.parse_args(["--layers", "4", "--seq-len", "2048", "--skip-sglang"])
    assert args.layers == 4 and args.seq_len == 2048 and args.skip_sglang
