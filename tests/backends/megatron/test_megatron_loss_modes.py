"""The learner's seq-mean ablation modes: the loss over a mini-batch split into several
micro-batches equals `compute_policy_loss` on the whole batch with the same mode."""

from __future__ import annotations

import math

from dist_helpers import make_config, run_distributed


def _modes_run(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from dapo_mega.algo import compute_policy_loss
    from dapo_mega.algo.train_sample import TrainSample
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.models.tiny import tiny_hf_config

    out = {}
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        cfg = make_config(train_batch_size=1, mini_batch_size=1, n=3, lr=1e-3)
        cfg.algo.loss_agg_mode = mode
        cfg.megatron.micro_batch_tokens = 12  # forces one sample per micro-batch
        hf = tiny_hf_config(cfg.model)
        layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
        learner = MegatronLearner(cfg, hf, layout)
        samples = [TrainSample(prompt_ids=[5, 17, 42], response_ids=[30, 31], advantage=1.0),
                   TrainSample(prompt_ids=[5, 17, 42], response_ids=[30, 31, 32, 33, 34, 35], advantage=-0.5),
                   TrainSample(prompt_ids=[5, 17, 42], response_ids=[36], advantage=-0.5)]
        metrics = learner.train_step(samples)
        # Reference: at the first update π = π_old (ratio 1), so the loss is the mode's
        # aggregation of -A over the response tokens, computed by the algo function on one batch.
        lengths = [len(s.response_ids) for s in samples]
        mask = torch.zeros(3, max(lengths))
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        lp = torch.zeros_like(mask)
        adv = torch.tensor([s.advantage for s in samples])
        ref, _ = compute_policy_loss(lp, lp, adv, mask, loss_agg_mode=mode)
        out[mode] = (metrics["loss/pg"], float(ref))
        layout.destroy()
    return out


def test_seq_mean_modes_match_whole_batch():
    out = run_distributed(_modes_run, 1, timeout_s=300)[0]
    # Hand values: token-mean = -(1*2 - 0.5*6 - 0.5*1)/9 = 1.5/9; seq-mean-token-mean =
    # -(1 - 0.5 - 0.5)/3 = 0; seq-mean-token-sum = -(2 - 3 - 0.5)/3 = 0.5.
    assert math.isclose(out["token-mean"][1], 1.5 / 9, rel_tol=1e-6)
    assert math.isclose(out["seq-mean-token-mean"][1], 0.0, abs_tol=1e-7)
    assert math.isclose(out["seq-mean-token-sum"][1], 0.5, rel_tol=1e-6)
    for mode, (learner_loss, ref) in out.items():
        assert math.isclose(learner_loss, ref, rel_tol=1e-5, abs_tol=1e-6), (mode, learner_loss, ref)
