"""Direction of a DAPO update, non-finite handling and the SFT step, on a 1-process learner."""

from __future__ import annotations

import math

from dist_helpers import run_distributed
from dist_helpers import make_config


def _direction_run(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    from dapo_mega.backends.megatron.batch import TrainSample
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.train_step import MegatronLearner, NonFiniteError
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
