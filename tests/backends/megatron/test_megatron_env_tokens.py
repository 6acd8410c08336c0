"""Multi-turn samples (issue #39 item 2): the environment's tokens of a response carry no
gradient. Two learners from one seed train on the same group, one whose environment answer
(the end of sample 0's response) has other token ids: their weights after the update are
equal. A third learner whose sample does not say where the environment wrote (no env_spans)
trains on those tokens, and its weights differ: the check can fail."""

from __future__ import annotations

from dist_helpers import make_config, run_distributed


def _scored(token_ids, env_spans, reward):
    from dapo_mega.reward.types import SampleReward
    from dapo_mega.rollout.samples import ScoredSample

    return ScoredSample(prompt_id="p", sample_index=0, token_ids=list(token_ids), logprobs=[-1.0] * len(token_ids),
                        weight_versions=[], response_text="", truncated=False, seed=None, engine_id="e",
                        queue_delay_s=0.0, generation_latency_s=0.0, env_spans=env_spans,
                        score=SampleReward(reward=reward, correct=reward > 0))


def _train_three(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.driver.advantages import build_train_samples
    from dapo_mega.models.tiny import tiny_hf_config
    from dapo_mega.rollout.samples import Group

    cfg = make_config(train_batch_size=1, mini_batch_size=1, n=2, lr=1e-2)
    cfg.algo.dynamic_sampling = False
    hf = tiny_hf_config(cfg.model)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf).initialize()
    model_turn, other = [30, 31, 32, 33], [40, 41, 42, 43, 44, 45]

    def trained(env_ids, env_spans):
        torch.manual_seed(11)
        learner = MegatronLearner(cfg, hf, layout)
        group = Group(prompt=None, prompt_input=[5, 17, 42, 8], engine_id="e", queue_delay_s=0.0, latency_s=0.0,
                      samples=[_scored(model_turn + env_ids, env_spans, 1.0), _scored(other, [], -1.0)])
        learner.train_step(build_train_samples([group], cfg.algo))
        return torch.cat([p.detach().flatten() for p in learner.model_chunks[0].parameters()])

    span = [[len(model_turn), len(model_turn) + 3]]
    a = trained([50, 51, 52], span)
    b = trained([60, 61, 62], span)  # only the environment's tokens changed
    unmasked = trained([60, 61, 62], [])  # the same tokens, trained on
    return {"same": float((a - b).abs().max()), "unmasked": float((a - unmasked).abs().max())}


def test_environment_tokens_carry_no_gradient():
    result = run_distributed(_train_three, 1, timeout_s=300)[0]
    assert result["same"] == 0.0, result
    assert result["unmasked"] > 1e-6, result
