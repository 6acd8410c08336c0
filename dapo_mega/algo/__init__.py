"""Pure tensor math of DAPO (arXiv 2503.14476): no torch.distributed, Megatron or SGLang.

    compute_group_advantages   Eq. 9   group-relative advantages, no critic
    compute_policy_loss        Eq. 8/10/12 decoupled clip (+ dual clip), token-level loss
    compute_off_policy_weights         off-policy correction of the engine/learner mismatch:
                                       tis, mis, geo_mask, icepop, geo_mask_tis (off_policy.py)
    compute_tis_weights                truncated importance sampling (the tis mode)
    summarize_tis_weights              its ratio statistics (weight, truncation, mismatch KL)
    compute_correction_stats           what a correction masked, by age (summarize_correction)
    compute_mismatch_stats             engine/learner log-prob mismatch by age (|Δ|, k3 KL), always logged
    compute_overlong_penalty   Eq. 13  soft overlong punishment
    select_informative_groups  Eq. 11  dynamic sampling's group filter
    TrainSample                        what the driver hands the learner: tokens, advantage, masks
"""

from dapo_mega.algo.advantages import compute_group_advantages
from dapo_mega.algo.group_filter import (
    ALL_CORRECT_GROUP,
    ALL_WRONG_GROUP,
    KEPT,
    GroupSelection,
    select_informative_groups,
)
from dapo_mega.algo.mismatch import (
    compute_mismatch_stats,
    empty_mismatch_stats,
    merge_mismatch_stats,
    summarize_mismatch,
)
from dapo_mega.algo.off_policy import (
    OFF_POLICY_MODES,
    TIS_METRICS,
    compute_correction_stats,
    compute_off_policy_weights,
    compute_tis_weights,
    empty_correction_stats,
    summarize_correction,
    summarize_tis_weights,
)
from dapo_mega.algo.overlong import compute_overlong_penalty
from dapo_mega.algo.policy_loss import LOSS_AGG_MODES, compute_policy_loss
from dapo_mega.algo.train_sample import TrainSample

__all__ = [
    "ALL_CORRECT_GROUP",
    "ALL_WRONG_GROUP",
    "KEPT",
    "LOSS_AGG_MODES",
    "OFF_POLICY_MODES",
    "TIS_METRICS",
    "TrainSample",
    "GroupSelection",
    "compute_group_advantages",
    "compute_correction_stats",
    "compute_mismatch_stats",
    "compute_off_policy_weights",
    "compute_overlong_penalty",
    "compute_policy_loss",
    "compute_tis_weights",
    "empty_correction_stats",
    "empty_mismatch_stats",
    "merge_mismatch_stats",
    "select_informative_groups",
    "summarize_correction",
    "summarize_mismatch",
    "summarize_tis_weights",
]
