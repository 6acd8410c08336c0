"""`build_datasets`: what the trainer calls to get its prompts.

    data.train_path empty  → the synthetic task of data.synthetic_task (arithmetic or the
                             worked chain; train + disjoint held-out)
    data.train_path set    → that file; data.eval_path, if set, the held-out file
                             (empty: no held-out set, evaluation is skipped)

`build_run_datasets` adds the named held-out sets of `eval.sets` (each its own file, k and
length limit) beside the unnamed one (data.eval_path or the synthetic split), as the
`EvalSet`s the evaluation runs; their revisions join the run's dataset revision.
`first_training_problem` is the one row the run's checks probe a reward function with.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from dapo_mega import log
from dapo_mega.config import DataConfig, EvalConfig
from dapo_mega.data.problem import Problem, compute_dataset_revision, run_dataset_revision
from dapo_mega.data.readers import read_first_problem, read_problems
from dapo_mega.data.synthetic import generate_synthetic_problems

logger = log.get(__name__)


@dataclass
class EvalSet:
    """One held-out set as the evaluation runs it."""

    name: str
    """"" for the unnamed set (data.eval_path, or the synthetic held-out split), else its key in eval.sets."""
    problems: List[Problem]
    """The problems evaluated (max_problems applied)."""
    n_samples: int
    """k of avg@k."""
    max_response_length: Optional[int]
    """Length limit (None: the training max_response_length)."""

    @property
    def metric_prefix(self) -> str:
        """`eval/` for the unnamed set (its keys stay `eval/avg_at_k`), else `eval/<name>/`."""
        return f"eval/{self.name}/" if self.name else "eval/"


def build_datasets(data_cfg: DataConfig, report: Optional[Dict[str, object]] = None,
                   named_eval: Optional[Mapping[str, Sequence[Problem]]] = None
                   ) -> Tuple[List[Problem], List[Problem], str]:
    """(train problems, held-out problems, dataset revision) from a DataConfig.

    The revision is a 12-hex-digit sha256 of both splits' content (see
    `compute_dataset_revision`); the ledger records it with every sample.

    Args:
        data_cfg: a DataConfig (train_path, eval_path, dedup, on_bad_row, seed, synthetic_*).
        report: optional dict, filled with "train"/"eval" ReadReports (files) or counts
            (synthetic) and the per-split revisions.
        named_eval: the problems of each named held-out set (`read_named_eval_sets`); their
            revisions (`eval_set_revisions`) join the held-out revision of the run revision.
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
    eval_revision = info["eval_revision"]
    if named_eval:  # without named sets the revision is what it always was
        info["eval_set_revisions"] = {name: compute_dataset_revision(list(p)) for name, p in named_eval.items()}
        eval_revision = hashlib.sha256(":".join([eval_revision, *(f"{n}={r}" for n, r in sorted(
            info["eval_set_revisions"].items()))]).encode()).hexdigest()[:12]
    revision = run_dataset_revision(info["train_revision"], eval_revision)
    info["revision"] = revision
    info["num_train"], info["num_eval"] = len(train), len(held_out)
    logger.debug("data: %d train / %d held-out problems, revision %s", len(train), len(held_out), revision)
    if report is not None:
        report.update(info)
    return train, held_out, revision


def first_training_problem(data_cfg: DataConfig) -> Tuple[Problem, str]:
    """(the first problem of the training data, where it is: "data.train_path row 3 of FILE" or
    "the synthetic task's first training problem"): the row a run's checks call its reward
    function on, so that a function reading its row's fields (verl's `extra_info["split"]`)
    sees what the run will give it."""
    if data_cfg.train_path:
        problem, row = read_first_problem(data_cfg.train_path)
        return problem, f"data.train_path row {row} (id {problem.id!r}) of {data_cfg.train_path}"
    train, _, _ = build_datasets(data_cfg)
    return train[0], f"the synthetic task's first training problem (id {train[0].id!r})"


def read_named_eval_sets(eval_cfg: EvalConfig, data_cfg: DataConfig,
                         report: Optional[Dict[str, object]] = None) -> Dict[str, List[Problem]]:
    """name -> problems of each `eval.sets` file (read as data.eval_path is: data.on_bad_row,
    data.dedup); `report` gets each ReadReport as "eval/<name>"."""
    named: Dict[str, List[Problem]] = {}
    for name, set_cfg in eval_cfg.sets.items():
        named[name], read_report = read_problems(set_cfg.path, data_cfg.on_bad_row, data_cfg.dedup)
        if report is not None:
            report[f"eval/{name}"] = read_report
    return named


def eval_sets_of(eval_cfg: EvalConfig, held_out: Sequence[Problem], named: Mapping[str, Sequence[Problem]]) -> List[EvalSet]:
    """The unnamed set (when there are held-out problems) first, then the named ones in config
    order; a named set's null n_samples / max_response_length / max_problems are eval.*'s."""
    def first(problems: Sequence[Problem], limit: int) -> List[Problem]:
        return list(problems[:limit] if limit else problems)

    sets = [EvalSet("", first(held_out, eval_cfg.max_problems), eval_cfg.n_samples,
                    eval_cfg.max_response_length)] if held_out else []
    for name, problems in named.items():
        s = eval_cfg.sets[name]
        sets.append(EvalSet(name, first(problems, eval_cfg.max_problems if s.max_problems is None else s.max_problems),
                            s.n_samples or eval_cfg.n_samples,
                            eval_cfg.max_response_length if s.max_response_length is None else s.max_response_length))
    return sets


def build_run_datasets(data_cfg: DataConfig, eval_cfg: EvalConfig, report: Optional[Dict[str, object]] = None
                       ) -> Tuple[List[Problem], List[EvalSet], str]:
    """(train problems, the evaluation sets, run dataset revision): what the trainer and
    `dapo-mega eval` call (`build_datasets` plus the named sets of eval.sets)."""
    named = read_named_eval_sets(eval_cfg, data_cfg, report)
    train, held_out, revision = build_datasets(data_cfg, report, named_eval=named)
    return train, eval_sets_of(eval_cfg, held_out, named), revision
