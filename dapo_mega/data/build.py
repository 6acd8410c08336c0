"""`build_datasets`: what the trainer calls to get its prompts.

    data.train_path empty  → the synthetic task of data.synthetic_task (arithmetic or the
                             worked chain; train + disjoint held-out)
    data.train_path set    → that file; data.eval_path, if set, the held-out file
                             (empty: no held-out set, evaluation is skipped)
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Dict, List, Optional, Tuple

from dapo_mega.data.problem import Problem, compute_dataset_revision, run_dataset_revision
from dapo_mega.data.readers import read_problems
from dapo_mega.data.synthetic import generate_synthetic_problems

logger = logging.getLogger(__name__)


def build_datasets(data_cfg: Any, report: Optional[Dict[str, Any]] = None) -> Tuple[List[Problem], List[Problem], str]:
    """(train problems, held-out problems, dataset revision) from a DataConfig.

    The revision is a 12-hex-digit sha256 of both splits' content (see
    `compute_dataset_revision`); the ledger records it with every sample.

    Args:
        data_cfg: a DataConfig (train_path, eval_path, dedup, on_bad_row, seed, synthetic_*).
        report: optional dict, filled with "train"/"eval" ReadReports (files) or counts
            (synthetic) and the per-split revisions.
    """
    info: Dict[str, Any] = {}
    if not data_cfg.train_path:
        train, held_out = generate_synthetic_problems(
            num_train=data_cfg.synthetic_num_train, num_eval=data_cfg.synthetic_num_eval,
            min_digits=data_cfg.synthetic_min_digits, max_digits=data_cfg.synthetic_max_digits,
            ops=data_cfg.synthetic_ops, num_operands=data_cfg.synthetic_num_operands, seed=data_cfg.seed,
            task=data_cfg.synthetic_task)
        info["source"] = "synthetic"
    else:
        train, info["train"] = read_problems(data_cfg.train_path, data_cfg.on_bad_row, data_cfg.dedup)
        held_out = []
        if data_cfg.eval_path:
            held_out, info["eval"] = read_problems(data_cfg.eval_path, data_cfg.on_bad_row, data_cfg.dedup)
        info["source"] = "files"
    info["train_revision"] = compute_dataset_revision(train)
    info["eval_revision"] = compute_dataset_revision(held_out)
    revision = run_dataset_revision(info["train_revision"], info["eval_revision"])
    info["revision"] = revision
    info["num_train"], info["num_eval"] = len(train), len(held_out)
    logger.info("data: %d train / %d held-out problems, revision %s", len(train), len(held_out), revision)
    if report is not None:
        report.update(info)
    return train, held_out, revision
