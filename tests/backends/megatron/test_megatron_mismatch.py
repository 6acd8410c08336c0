"""The learner logs the engine/learner log-prob mismatch every step, TIS or not (algo/mismatch.py).

Engine log-probs are made from the learner's own π_old shifted by known offsets (age-0
samples by +0.3 nats, age-1 samples by -0.1): the step's metrics must give back those
offsets and their k3 KL, per age bucket.
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


def _train_step(rank, world, use_engine_logprobs):
    import dataclasses
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
    a.train_batch_size, a.mini_batch_size, a.n_samples_per_prompt, a.lr_warmup_steps = 2, 1, 4, 0
    a.tis_cap, a.use_engine_logprobs, a.temperature = None, use_engine_logprobs, 0.8
    cfg.checks.mismatch_age_buckets = 2
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    learner = MegatronLearner(cfg, hf, layout)
    samples = _samples()
    learner_lp = learner.compute_log_probs(samples)
    samples = [dataclasses.replace(s, engine_log_probs=(lp + OFFSET[s.age]).tolist())
               for s, lp in zip(samples, learner_lp)]
    return learner.train_step(samples, step=1), sum(len(s.response_ids) for s in samples if s.age == 0)


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
