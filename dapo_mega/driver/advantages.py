"""The advantage step: the kept groups of a rollout batch -> the learner's TrainSamples.

Thin glue over `dapo_mega.algo`: group-relative advantages (DAPO Eq. 9) over the samples'
rewards, one advantage per response broadcast over its tokens by the loss; the engine's
log-probs travel along for truncated importance sampling; with `algo.overlong_filter`
a truncated response is masked out of the loss (DAPO §3.4, the ablation before shaping).
The prompt ids are the ones the engine was given (`Group.prompt_input`), so the learner
trains on exactly the tokens that were sampled from.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from dapo_mega.algo import compute_group_advantages
from dapo_mega.algo.train_sample import TrainSample
from dapo_mega.config import AlgoConfig
from dapo_mega.rollout.samples import Group


def build_train_samples(groups: Sequence[Group], algo: AlgoConfig, mask_offpolicy: bool = False) -> List[TrainSample]:
    """TrainSamples of `groups` in order (group by group, sample by sample).

    algo: an AlgoConfig (adv_eps, normalize_adv_std, overlong_filter).
    mask_offpolicy: rollout.mask_offpolicy_in_partial_rollout (with partial rollouts on): a
        resumed sample's tokens of older weight versions carry no loss (`offpolicy_prefix_mask`).
    A multi-turn sample's environment tokens (`ScoredSample.env_spans`) never carry loss.
    """
    from dapo_mega.rollout.partial import offpolicy_prefix_mask

    rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float32)
    if rewards.numel() == 0:
        return []
    index = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    adv = compute_group_advantages(rewards, index, eps=algo.adv_eps, normalize_std=algo.normalize_adv_std)
    out: List[TrainSample] = []
    k = 0
    for g in groups:
        prompt_ids = list(g.prompt_input)
        for s in g.samples:
            masked = algo.overlong_filter and s.truncated
            loss_mask = [0] * len(s.token_ids) if masked else (offpolicy_prefix_mask(s) if mask_offpolicy else None)
            env = s.env_mask()  # a multi-turn sample: the environment's tokens carry no loss
            if env is not None and not masked:
                loss_mask = env if loss_mask is None else [a * b for a, b in zip(loss_mask, env)]
            out.append(TrainSample(prompt_ids=prompt_ids, response_ids=list(s.token_ids), advantage=float(adv[k]),
                                   engine_log_probs=s.logprobs, loss_mask=loss_mask, age=s.age,
                                   routed_experts=s.routed_experts))
            k += 1
    return out
