"""The learner logs the engine/learner log-prob mismatch every step, TIS or not (algo/mismatch.py),
and applies the off-policy correction it is configured with (algo/off_policy.py).

Engine log-probs are made from the learner's own π_old shifted by known offsets (age-0
samples by +0.3 nats, age-1 samples by -0.1): the step's metrics must give back those
offsets and their k3 KL, per age bucket; and each correction mode must mask what those
ratios (age 0: ρ = e^-0.3 = 0.7408 per token; age 1: ρ = e^0.1 = 1.1052) put outside its
bounds.
"""

import math

import pytest
from dist_helpers import run_distributed

from dapo_mega.algo import TrainSample

OFFSET = {0: 0.3, 1: -0.1}  # engine log p - learner log p, by age


def _samples():
    out = []
    for i in range(8):
        prompt = [5 + (7 * i + k) % 80 for k in range(2 + i % 3)]
        response = [3 + (11 * i + 5 * k) % 85 for k in range(3 + i % 5)]
        out.append(TrainSample(prompt_ids=prompt, response_ids=response, advantage=1.0 if i % 2 else -1.0,
                               age=i % 2))
    return out


def _config(use_engine_logprobs=False, **algo):
    from dapo_mega.config import DapoConfig

    cfg = DapoConfig()
    cfg.model.tiny_num_layers = 1
    cfg.megatron.micro_batch_tokens, cfg.megatron.transformer_impl = 64, "local"
    a = cfg.algo
    a.train_batch_size, a.mini_batch_size, a.n_samples_per_prompt, a.lr_warmup_steps = 2, 1, 4, 0
    a.tis_cap, a.use_engine_logprobs, a.temperature = None, use_engine_logprobs, 0.8
    for key, value in algo.items():
        setattr(a, key, value)
    cfg.checks.mismatch_age_buckets = 2
    return cfg


def _offset_step(cfg, world):
    """One train step of a fresh tiny learner on `_samples()` with engine log-probs = its own
    log-probs + OFFSET by age."""
    import dataclasses

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.models.tiny import tiny_hf_config

    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()  # re-entrant: one per learner
    learner = MegatronLearner(cfg, hf, layout)
    samples = _samples()
    learner_lp = learner.compute_log_probs(samples)
    samples = [dataclasses.replace(s, engine_log_probs=(lp + OFFSET[s.age]).tolist())
               for s, lp in zip(samples, learner_lp)]
    return learner.train_step(samples, step=1)


def _train_step(rank, world, use_engine_logprobs):
    import warnings

    warnings.filterwarnings("ignore")
    metrics = _offset_step(_config(use_engine_logprobs), world)
    return metrics, sum(len(s.response_ids) for s in _samples() if s.age == 0)


@pytest.mark.parametrize("use_engine_logprobs", [False, True], ids=["learner-old", "engine-old"])
def test_train_step_reports_the_mismatch_by_age(use_engine_logprobs):
    metrics, young_tokens = run_distributed(_train_step, 1, args=(use_engine_logprobs,), timeout_s=240)[0]
    assert not any(k.startswith("tis/") for k in metrics)  # no TIS asked for: the mismatch is logged anyway
    assert metrics["mismatch/age_0/logp_abs_mean"] == pytest.approx(0.3, abs=1e-4)
    assert metrics["mismatch/age_0/logp_abs_max"] == pytest.approx(0.3, abs=1e-4)
    assert metrics["mismatch/age_0/k3_kl"] == pytest.approx(math.exp(-0.3) - 1 + 0.3, abs=1e-4)
    if use_engine_logprobs:  # the learner's π_old is known before the first update only (one mini-batch)
        assert 0 < metrics["mismatch/tokens"] < sum(len(s.response_ids) for s in _samples())
        return
    assert metrics["mismatch/age_0/tokens"] == young_tokens
    assert metrics["mismatch/age_1plus/logp_abs_mean"] == pytest.approx(0.1, abs=1e-4)
    assert metrics["mismatch/age_1plus/k3_kl"] == pytest.approx(math.exp(0.1) - 1 - 0.1, abs=1e-5)
    assert metrics["mismatch/logp_abs_mean"] == pytest.approx(
        (0.3 * young_tokens + 0.1 * (metrics["mismatch/tokens"] - young_tokens)) / metrics["mismatch/tokens"], abs=1e-4)


# Response lengths (3 + i % 5): age 0 (even i) 3, 5, 7, 4 = 19 tokens; age 1 (odd i) 4, 6, 3, 5 = 18.
MODES = {
    "none": {},
    # age-1 tokens (1.1052 > 1.05) truncated, none masked
    "tis": {"tis_cap": 1.05},
    # Π ρ: age 0 e^(-0.3 L) <= 0.41 < 0.5, all masked; age 1 e^(0.1 L): L 3, 4 -> 1.35, 1.49 kept,
    # L 5, 6 -> 1.65, 1.82 > 1.6 masked: 6 of 8 sequences, 19 + 5 + 6 = 30 of 37 tokens
    "mis": {"off_policy_correction": "mis", "mis_low": 0.5, "mis_high": 1.6},
    # geometric mean = the token ratio: age 0 0.7408 < 0.8 masked, age 1 1.1052 kept
    "geo_mask": {"off_policy_correction": "geo_mask", "geo_mask_low": 0.8, "geo_mask_high": 1.25},
    # token ratio: age 0 0.7408 < 0.75 masked, age 1 1.1052 kept with weight 1.1052
    "icepop": {"off_policy_correction": "icepop", "icepop_low": 0.75, "icepop_high": 1.2},
    # geo_mask's mask (age 0 masked) times tis's weight (age 1: min(1.1052, 1.05) = 1.05)
    "geo_mask_tis": {"off_policy_correction": "geo_mask_tis", "tis_cap": 1.05, "geo_mask_low": 0.8,
                     "geo_mask_high": 1.25},
    # both ages outside [0.9, 1.05]: every token masked, so the loss is exactly 0
    "icepop_all": {"off_policy_correction": "icepop", "icepop_low": 0.9, "icepop_high": 1.05},
}
EXPECTED = {  # masked token fraction, masked sequence fraction, by age bucket and overall
    "tis": {"": (0.0, 0.0), "age_0": (0.0, 0.0), "age_1plus": (0.0, 0.0)},
    "mis": {"": (30 / 37, 6 / 8), "age_0": (1.0, 1.0), "age_1plus": (11 / 18, 2 / 4)},
    "geo_mask": {"": (19 / 37, 4 / 8), "age_0": (1.0, 1.0), "age_1plus": (0.0, 0.0)},
    "icepop": {"": (19 / 37, 4 / 8), "age_0": (1.0, 1.0), "age_1plus": (0.0, 0.0)},
    "geo_mask_tis": {"": (19 / 37, 4 / 8), "age_0": (1.0, 1.0), "age_1plus": (0.0, 0.0)},
    "icepop_all": {"": (1.0, 1.0), "age_0": (1.0, 1.0), "age_1plus": (1.0, 1.0)},
}


def _train_step_each_mode(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    return {name: _offset_step(_config(**algo), world) for name, algo in MODES.items()}


def test_each_off_policy_correction_trains_and_masks_what_its_bounds_say():
    results = run_distributed(_train_step_each_mode, 1, timeout_s=300)[0]
    for name, metrics in results.items():
        assert metrics["train/num_updates"] == 2.0, name
        assert math.isfinite(metrics["loss/pg"]) and math.isfinite(metrics["actor/grad_norm"]), name
        assert metrics["mismatch/age_0/logp_abs_mean"] == pytest.approx(0.3, abs=1e-4), name  # wired for every mode
    assert not any(k.startswith(("off_policy/", "tis/")) for k in results["none"])
    for name, buckets in EXPECTED.items():
        for bucket, (tokens, seqs) in buckets.items():
            prefix = "off_policy/" + (bucket + "/" if bucket else "")
            assert results[name][prefix + "masked_token_frac"] == pytest.approx(tokens, abs=1e-9), (name, bucket)
            assert results[name][prefix + "masked_seq_frac"] == pytest.approx(seqs, abs=1e-9), (name, bucket)
    # tis/* are token means per update averaged over the 2 updates (one group each): group 0
    # (samples 0-3, lengths 3 4 5 6) has 4 + 6 of 18 tokens at age 1, group 1 (7 3 4 5) 3 + 5 of 19
    assert results["tis"]["tis/truncated_frac"] == pytest.approx((10 / 18 + 8 / 19) / 2, abs=1e-6)
    assert results["tis"]["off_policy/weight_mean"] == pytest.approx((19 * math.exp(-0.3) + 18 * 1.05) / 37, abs=1e-4)
    assert results["icepop"]["off_policy/weight_mean"] == pytest.approx(18 * math.exp(0.1) / 37, abs=1e-4)
    assert results["geo_mask_tis"]["off_policy/weight_mean"] == pytest.approx(18 * 1.05 / 37, abs=1e-4)
    assert "tis/truncated_frac" in results["geo_mask_tis"]
    assert results["mis"]["off_policy/weight_mean"] == pytest.approx(
        (4 * math.exp(0.4) + 3 * math.exp(0.3)) / 37, abs=1e-4)
    assert results["icepop_all"]["loss/pg"] == 0.0 and results["icepop_all"]["actor/grad_norm"] == 0.0
    assert results["none"]["loss/pg"] != 0.0


def _denominator_runs(rank, world):
    """geo_mask masks every age-0 sequence (ρ_geo = e^-0.3 < 0.8). Returns the step metrics of:
    masked tokens left out of the denominator, kept in it (ours), and the reference: mode none
    on the age-1 samples alone (what verl trains on once its rollout_rs drops the rest from the
    loss mask). lr ~ 0: both updates of each step read the same weights, so their gradient
    norms compare update by update."""
    import dataclasses
    import warnings

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.models.tiny import tiny_hf_config

    warnings.filterwarnings("ignore")
    geo = {"off_policy_correction": "geo_mask", "geo_mask_low": 0.8, "geo_mask_high": 1.25, "lr": 1e-30}
    out = {"out": _offset_step(_config(masked_tokens_in_denominator=False, **geo), world),
           "in": _offset_step(_config(**geo), world)}
    cfg = _config(lr=1e-30, n_samples_per_prompt=2)
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    learner = MegatronLearner(cfg, hf, layout)
    old = [s for s in _samples() if s.age == 1]
    out["reference"] = learner.train_step([dataclasses.replace(s, age=0) for s in old], step=1)
    return out


def test_masked_tokens_leave_the_denominator_as_verl_drops_them_from_the_loss_mask():
    """Issue #37 item 8: algo.masked_tokens_in_denominator=false gives the gradient and loss of
    the kept tokens' own mean, the same as training on the kept samples alone; true (ours)
    gives those scaled down by the kept fraction (each update: 10 of 18, then 8 of 19 tokens)."""
    results = run_distributed(_denominator_runs, 1, timeout_s=300)[0]
    out, kept_in, reference = results["out"], results["in"], results["reference"]
    assert out["actor/grad_norm"] == pytest.approx(reference["actor/grad_norm"], rel=1e-4)
    assert out["loss/pg"] == pytest.approx(reference["loss/pg"], rel=1e-4, abs=1e-7)
    assert out["off_policy/masked_token_frac"] == pytest.approx(19 / 37, abs=1e-9)
    assert kept_in["actor/grad_norm"] < 0.7 * reference["actor/grad_norm"]
