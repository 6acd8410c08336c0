"""Turn the published DAPO-Math-17k and AIME 2024 parquet files into what the trainer reads.

    python tools/prepare_data.py --dapo-math dapo-math-17k.parquet --aime aime-2024.parquet --out data/

Reads each file with the trainer's own reader (dapo_mega.data.read_problems: schema checks,
bad-row handling, dedup of repeated prompts), drops training prompts that also appear in
the evaluation set, and writes `<out>/dapo_math_17k.parquet` and `<out>/aime_2024.parquet`
in the same schema (one row per problem), each with `<name>.revision.json` beside it: the
revision of its problems, the run revision (what a run on both files stamps into every ledger
row: `run_dataset_revision`, as the trainer computes it), the source file's sha256 and the
counts (rows, duplicates, skipped rows by reason). The revisions are printed at the end.
The trainer's configs/data/dapo_math_17k.yaml reads `$DAPO_DATA_DIR` (default `data/`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tqdm import tqdm

from dapo_mega.data import DataError, Problem, compute_dataset_revision, read_problems, run_dataset_revision

AIME_2024_PROBLEMS = 30


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def problems_to_table(problems: Sequence[Problem], ability: str, desc: str):
    """The DAPO parquet schema, one row per problem (tqdm progress over rows)."""
    import pyarrow as pa

    rows: Dict[str, list] = {"data_source": [], "prompt": [], "ability": [], "reward_model": [], "extra_info": []}
    for problem in tqdm(problems, desc=desc, unit="problem"):
        messages = [dict(m) for m in problem.messages] or [{"role": "user", "content": problem.prompt}]
        rows["data_source"].append(problem.data_source)
        rows["prompt"].append(messages)
        rows["ability"].append(ability)
        rows["reward_model"].append({"ground_truth": problem.ground_truth, "style": "rule-lean"})
        rows["extra_info"].append({"index": str(problem.id)})
    return pa.table(rows)


def write_dataset(problems: List[Problem], source: Path, report, out_path: Path, ability: str) -> dict:
    """Write the parquet atomically and its revision record; returns the record."""
    import pyarrow.parquet as pq

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".parquet.tmp")
    pq.write_table(problems_to_table(problems, ability, desc=f"writing {out_path.name}"), tmp)
    os.replace(tmp, out_path)
    record = {"file": out_path.name, "revision": compute_dataset_revision(problems), "num_problems": len(problems),
              "source": str(source), "source_sha256": file_sha256(source), "source_rows": report.num_rows,
              "duplicates_dropped": report.num_duplicates,
              "conflicting_duplicates": report.num_conflicting_duplicates,
              "skipped_rows": report.num_skipped, "skip_reasons": dict(report.skip_reasons)}
    out_path.with_suffix(".revision.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def prepare(dapo_math: Path, aime: Optional[Path], out_dir: Path, on_bad_row: str = "error",
            keep_eval_overlap: bool = False) -> Dict[str, dict]:
    """Read, check, dedup and write both datasets; returns {name: revision record}."""
    records: Dict[str, dict] = {}
    eval_prompts = set()
    if aime is not None:
        eval_problems, eval_report = read_problems(aime, on_bad_row=on_bad_row, dedup=True)
        if len(eval_problems) != AIME_2024_PROBLEMS:
            print(f"warning: {aime} holds {len(eval_problems)} distinct problems, AIME 2024 has "
                  f"{AIME_2024_PROBLEMS}", file=sys.stderr)
        eval_prompts = {p.prompt for p in eval_problems}
        records["aime_2024"] = write_dataset(eval_problems, aime, eval_report, out_dir / "aime_2024.parquet", "MATH")
    train, train_report = read_problems(dapo_math, on_bad_row=on_bad_row, dedup=True)
    overlap = [p for p in train if p.prompt in eval_prompts]
    if overlap and not keep_eval_overlap:
        train = [p for p in train if p.prompt not in eval_prompts]
    bad_answers = sum(1 for p in train if not p.ground_truth.strip())
    if bad_answers:
        raise DataError(f"{dapo_math}: {bad_answers} problems with an empty ground truth")
    record = write_dataset(train, dapo_math, train_report, out_dir / "dapo_math_17k.parquet", "MATH")
    record["eval_overlap"] = len(overlap)
    record["eval_overlap_dropped"] = 0 if keep_eval_overlap else len(overlap)
    records["dapo_math_17k"] = record
    # what the trainer stamps into every ledger row when it reads both files (data.train_path
    # and data.eval_path): one definition, `run_dataset_revision`
    run_revision = run_dataset_revision(record["revision"], records["aime_2024"]["revision"] if aime is not None
                                        else compute_dataset_revision([]))
    for name, rec in records.items():
        rec["run_revision"] = run_revision
        (out_dir / f"{name}.revision.json").write_text(json.dumps(rec, indent=2) + "\n")
    return records


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dapo-math", type=Path, required=True, help="published DAPO-Math-17k parquet")
    parser.add_argument("--aime", type=Path, default=None, help="published AIME 2024 parquet (960 rows)")
    parser.add_argument("--out", type=Path, default=Path("data"), help="output directory ($DAPO_DATA_DIR)")
    parser.add_argument("--on-bad-row", choices=("error", "skip"), default="error")
    parser.add_argument("--keep-eval-overlap", action="store_true",
                        help="keep training prompts that also appear in the eval set")
    args = parser.parse_args(argv)
    try:
        records = prepare(args.dapo_math, args.aime, args.out, args.on_bad_row, args.keep_eval_overlap)
    except DataError as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 1
    for name, record in records.items():
        print(f"{name}: {record['num_problems']} problems from {record['source_rows']} rows "
              f"({record['duplicates_dropped']} duplicates, {record['skipped_rows']} skipped) "
              f"revision {record['revision']} -> {args.out / record['file']}")
    print(f"run revision {next(iter(records.values()))['run_revision']} (what a run on these files stamps into "
          "every ledger row and prints at start)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
