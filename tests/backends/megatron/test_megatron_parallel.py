"""TP=2, PP=2 and DP=2 learners equal the TP=PP=DP=1 learner on the same data and weights.

Each configuration runs in its own gloo process group (tests/dist_helpers.py). Compared:
per-sample response log-probs (compute_log_probs), and the first train_step's loss, clip
fractions, entropy and gradient norm, and log-probs after the update. A further check runs
in the 1-process job: the token-level loss over several micro-batches equals the loss of
the whole batch in one micro-batch and differs from a per-micro-batch mean.
"""

from __future__ import annotations

import math

import pytest
from dist_helpers import make_config, make_samples, run_distributed


def _learner_run(rank, world, tp, pp):
    import warnings

    warnings.filterwarnings("ignore")

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = make_config(tp, pp)
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    learner = MegatronLearner(cfg, hf, layout)
    samples = make_samples()
    before = learner.compute_log_probs(samples)
    metrics = learner.train_step(samples)
    after = learner.compute_log_probs(samples)
    extra = {}
    if world == 1:
        extra = _loss_split_checks(learner, samples)
    return {"before": before, "after": after, "metrics": metrics, "extra": extra}


def _loss_split_checks(learner, samples):
    """Token-level loss: several micro-batches == one micro-batch; != mean of micro-batch means."""
    import torch

    from dapo_mega.algo import compute_policy_loss
    from dapo_mega.backends.megatron.batch import collate_micro_batch, count_loss_tokens, plan_micro_batches
    from dapo_mega.backends.megatron.logprobs import compute_token_log_probs

    a = learner.cfg.algo
    model = learner.model_chunks[0]
    old = learner.compute_log_probs(samples)
    perturbed = []
    for s, lp in zip(samples, old):
        s2 = type(s)(**{**s.__dict__, "old_log_probs": [float(x) + 0.1 * ((k % 3) - 1) for k, x in enumerate(lp)]})
        perturbed.append(s2)
    indices = list(range(len(perturbed)))
    total_tokens = count_loss_tokens(perturbed, indices)

    def losses(groups, global_tokens):
        out = []
        with torch.no_grad():
            for g in groups:
                mb = collate_micro_batch(perturbed, g)
                logits = model(mb.tokens, mb.position_ids, None)
                lp, _ = compute_token_log_probs(logits, mb.labels, a.temperature, learner.info.shape.vocab_size, False)
                loss, _ = compute_policy_loss(lp, mb.old_log_probs, mb.advantages, mb.response_mask,
                                              a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c,
                                              global_num_tokens=global_tokens)
                out.append(float(loss))
        return out

    split = plan_micro_batches(perturbed, indices, micro_batch_tokens=32)
    whole = losses([indices], total_tokens)[0]
    parts = losses(split, total_tokens)
    local_means = losses(split, None)
    return {"whole": whole, "sum_parts": sum(parts), "mean_of_means": sum(local_means) / len(local_means),
            "num_micro_batches": len(split)}


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_learner_run, 1, args=(1, 1), timeout_s=240)[0]


def _assert_same(ref, got, name):
    import torch

    for a, b in zip(ref["before"], got["before"]):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5, msg=f"{name}: log-probs before the update")
    for key in ("loss/pg", "actor/grad_norm", "actor/entropy", "loss/clip_frac_low", "loss/clip_frac_high"):
        assert math.isclose(got["metrics"][key], ref["metrics"][key], rel_tol=1e-4, abs_tol=1e-6), (
            f"{name}: {key} {got['metrics'][key]} != {ref['metrics'][key]}")
    for a, b in zip(ref["after"], got["after"]):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=f"{name}: log-probs after the update")


def test_reference_loss_is_token_level_over_micro_batches(reference):
    extra = reference["extra"]
    assert extra["num_micro_batches"] > 1
    assert math.isclose(extra["sum_parts"], extra["whole"], rel_tol=1e-5, abs_tol=1e-7)
    assert abs(extra["mean_of_means"] - extra["whole"]) > 1e-4
    m = reference["metrics"]
    assert m["train/num_updates"] == 2.0 and m["train/skipped_updates"] == 0.0
    assert m["actor/grad_norm"] > 0 and math.isfinite(m["loss/pg"])
    # The update moved the policy.
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(reference["before"], reference["after"]))


@pytest.mark.parametrize("tp,pp,world", [(2, 1, 2), (1, 2, 2), (1, 1, 2),
                                         pytest.param(2, 2, 4, marks=pytest.mark.slow)],
                         ids=["tp2", "pp2", "dp2", "tp2xpp2"])
def test_parallel_layout_matches_single_process(reference, tp, pp, world):
    got = run_distributed(_learner_run, world, args=(tp, pp), timeout_s=240)
    for rank in range(world):
        _assert_same(reference, got[rank], f"tp{tp}-pp{pp}-world{world} rank {rank}")
