"""Direction of a DAPO update, non-finite handling and the SFT step, on a 1-process learner."""

from __future__ import annotations

import math

from dist_helpers import make_config, run_distributed


def _direction_run(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.algo.train_sample import TrainSample
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner, NonFiniteError
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = make_config(train_batch_size=1, mini_batch_size=1, n=1, lr=1e-3)
    cfg.algo.dynamic_sampling = False
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    learner = MegatronLearner(cfg, hf, layout)
    prompt, response = [5, 17, 42, 8], [30, 31, 32, 33, 34]
    out = {}
    for sign in (1.0, -1.0):
        sample = [TrainSample(prompt_ids=prompt, response_ids=response, advantage=sign)]
        before = learner.compute_log_probs(sample)[0].sum().item()
        metrics = learner.train_step(sample)
        after = learner.compute_log_probs(sample)[0].sum().item()
        out[sign] = (before, after, metrics)

    bad = [TrainSample(prompt_ids=prompt, response_ids=response, advantage=float("nan"))]
    skipped = learner.train_step(bad)
    unchanged = learner.compute_log_probs(bad)[0].sum().item()
    cfg.algo.on_nonfinite = "stop"
    try:
        learner.train_step(bad)
        raised = False
    except NonFiniteError:
        raised = True

    sft_sample = [TrainSample(prompt_ids=prompt, response_ids=response)]
    sft = [learner.sft_step(sft_sample, lr=1e-2)["sft/loss"] for _ in range(3)]
    return {"out": out, "skipped": skipped, "unchanged": unchanged, "raised": raised, "sft": sft,
            "lr": learner.optimizer.param_groups[0]["lr"]}


def test_update_direction_nonfinite_and_sft():
    result = run_distributed(_direction_run, 1, timeout_s=240)[0]
    pos_before, pos_after, pos_metrics = result["out"][1.0]
    neg_before, neg_after, _ = result["out"][-1.0]
    assert pos_after > pos_before + 1e-4, "a positive advantage must raise the response's log-prob"
    assert neg_after < neg_before - 1e-4, "a negative advantage must lower the response's log-prob"
    assert pos_metrics["train/num_updates"] == 1.0 and pos_metrics["actor/lr"] == 1e-3
    # First update: π = π_old, so the loss is −Â·1 averaged over tokens = −1 and nothing is clipped.
    assert math.isclose(pos_metrics["loss/pg"], -1.0, rel_tol=1e-5)
    assert pos_metrics["loss/clip_frac_high"] == 0.0

    skipped = result["skipped"]
    assert skipped["train/skipped_updates"] == 1.0 and skipped["train/num_updates"] == 0.0
    assert math.isclose(result["unchanged"], neg_after, abs_tol=1e-6), "a skipped update must not move weights"
    assert result["raised"]
    sft = result["sft"]
    assert sft[2] < sft[0], f"SFT loss must fall: {sft}"


def _first_update_run(rank, world):
    """The same step twice from the same initial weights: (a) as train_step runs it, the first
    update's π_old being its own detached log-probs; (b) with π_old of every sample given
    (use_engine_logprobs) from a forward-only pass before the step, the textbook way."""
    import dataclasses
    import warnings

    warnings.filterwarnings("ignore")
    from dist_helpers import make_samples

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = make_config(train_batch_size=2, mini_batch_size=1, n=4, lr=1e-2, micro_batch_tokens=64)
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    samples = make_samples(seed=3)
    old_pass_samples = []

    def count_forward_passes(learner):
        inner = learner._forward_log_probs

        def counted(micro_batches, *args, **kwargs):
            old_pass_samples.extend(i for mb in micro_batches for i in mb.sample_indices)
            return inner(micro_batches, *args, **kwargs)
        learner._forward_log_probs = counted

    a = MegatronLearner(cfg, hf, layout)
    count_forward_passes(a)
    metrics_a = a.train_step(samples, step=1)
    in_pass = sorted(old_pass_samples)
    after_a = [t.tolist() for t in a.compute_log_probs(samples)]

    b = MegatronLearner(cfg, hf, layout)
    before_b = b.compute_log_probs(samples)
    cfg.algo.use_engine_logprobs = True
    metrics_b = b.train_step([dataclasses.replace(s, engine_log_probs=lp.tolist()) for s, lp in zip(samples, before_b)],
                             step=1)
    after_b = [t.tolist() for t in b.compute_log_probs(samples)]
    return {"in_pass": in_pass, "after": (after_a, after_b), "before": [t.tolist() for t in before_b], "loss": (metrics_a["loss/pg"], metrics_b["loss/pg"]),
            "updates": (metrics_a["train/num_updates"], metrics_b["train/num_updates"])}


def test_first_update_takes_pi_old_from_its_own_forward():
    """Two mini-batches: the forward-only π_old pass covers the second one only, and the step
    ends at the same weights as with π_old of all samples computed before it."""
    result = run_distributed(_first_update_run, 1, timeout_s=240)[0]
    assert result["updates"] == (2.0, 2.0)
    assert len(result["in_pass"]) == 4, result["in_pass"]  # one group of 4 of the 8 samples
    assert len(set(result["in_pass"])) == 4 and {i // 4 for i in result["in_pass"]} in ({0}, {1})
    after_a, after_b = result["after"]
    moved = max(abs(x - y) for s_a, s_b in zip(after_a, after_b) for x, y in zip(s_a, s_b))
    assert moved < 1e-5, f"log-probs after the step differ by {moved}"
    step = max(abs(x - y) for s_a, s_0 in zip(after_a, result["before"]) for x, y in zip(s_a, s_0))
    assert step > 1e-3, "the step must move the weights for the comparison to mean anything"
    assert math.isclose(result["loss"][0], result["loss"][1], rel_tol=1e-5, abs_tol=1e-7)
