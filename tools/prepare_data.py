"""Turn the published DAPO-Math-17k and AIME 2024 parquet files into what the trainer reads.

    python tools/prepare_data.py --dapo-math dapo-math-17k.parquet --aime aime-2024.parquet --out data/

Reads each file with the trainer's own reader (dapo_mega.data.read_problems: schema checks,
bad-row handling, dedup of repeated prompts), drops training prompts that also appear in
the evaluation set, and writes `<out>/dapo_math_17k.parquet` and `<out>/aime_2024.parquet`
in the same schema (one row per problem), each with `<name>.revision.json` beside it: the
revision of its problems, the run revision (what a run on both files stamps into every ledger
row: `run_dataset_revision`, as the trainer computes it), the source file's sha256 and the
counts (rows, duplicates, skipped rows by reason). The revisions are printed at the end.
A file that yields no problem (empty, another schema, or a training file whose every prompt
is in the eval set: the AIME file given as --dapo-math) stops it with exit 1, naming the file
and the columns it expected; nothing is written for it.
The trainer's configs/data/dapo_math_17k.yaml reads `$DAPO_DATA_DIR` (default `data/`).

Further evaluation sets (for `eval.sets`), from their published files:

    python tools/prepare_data.py --aime-2025 aime2025-I.jsonl aime2025-II.jsonl --math-500 test.jsonl --out data/

AIME 2025 (opencompass/AIME2025 jsonl or yentinglin/aime_2025 parquet: `question` / `problem`
and `answer`) and MATH-500 (HuggingFaceH4/MATH-500 jsonl: `problem`, `answer`, `unique_id`, ...)
are written as `<out>/aime_2025.parquet` and `<out>/math_500.parquet` with their revision
records; each problem is wrapped in the DAPO prompt template, as the AIME 2024 and
DAPO-Math-17k prompts already are (the recipe reads them with data.prompt_template=raw).
`--dapo-math` may then be left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tqdm import tqdm

from dapo_mega.data import (
    DAPO_PROMPT_TEMPLATE,
    DataError,
    Problem,
    ReadReport,
    compute_dataset_revision,
    read_problems,
    run_dataset_revision,
)
from dapo_mega.data.readers import read_published_problems
from dapo_mega.run_files.checkpoints import atomic_path, write_text_atomic

AIME_2024_PROBLEMS = 30
PUBLISHED_EVAL_SETS = {"aime_2025": 30, "math_500": 500}
"""Eval sets read from their published files: name (file stem and data_source) -> problems it has."""
DAPO_COLUMNS = "data_source, prompt (a chat list), ability, reward_model ({ground_truth, style}), extra_info"
"""The published DAPO-Math-17k / AIME 2024 parquet schema (--dapo-math, --aime)."""
PUBLISHED_COLUMNS = {"aime_2025": "question (or problem) and answer",
                     "math_500": "problem, answer (and unique_id, subject, level)"}
"""What the published files of each of PUBLISHED_EVAL_SETS hold."""


def read_or_explain(read, path: Path, expected: str, *args, **kwargs) -> tuple:
    """`read(path, ...)`, a DataError (a wrong schema, a bad row, no problem at all) naming the
    columns the file should have held."""
    try:
        return read(path, *args, **kwargs)
    except DataError as exc:
        raise DataError(f"{exc}; expected the columns {expected}") from None


def require_problems(problems: Sequence[Problem], source: str, expected: str, why: str = "") -> None:
    """No dataset is written without a problem: a zero-row training or eval file is the wrong file."""
    if not problems:
        raise DataError(f"{source}: 0 problems to write{why}; expected rows with the columns {expected}. "
                        "Fix: check which file each option was given")


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


def write_dataset(problems: List[Problem], source: Path | Sequence[Path], report, out_path: Path,
                  ability: str) -> dict:
    """Write the parquet atomically and its revision record; returns the record (`source`: the
    file, or the files, read)."""
    import pyarrow.parquet as pq

    sources = [source] if isinstance(source, Path) else list(source)
    require_problems(problems, ", ".join(map(str, sources)), PUBLISHED_COLUMNS.get(out_path.stem, DAPO_COLUMNS))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_path) as tmp:
        pq.write_table(problems_to_table(problems, ability, desc=f"writing {out_path.name}"), tmp)
    record = {"file": out_path.name, "revision": compute_dataset_revision(problems), "num_problems": len(problems),
              "source": ", ".join(map(str, sources)), "source_sha256": ", ".join(map(file_sha256, sources)),
              "source_rows": report.num_rows,
              "duplicates_dropped": report.num_duplicates,
              "conflicting_duplicates": report.num_conflicting_duplicates,
              "skipped_rows": report.num_skipped, "skip_reasons": dict(report.skip_reasons)}
    write_text_atomic(out_path.with_suffix(".revision.json"), json.dumps(record, indent=2) + "\n")
    return record


def prepare(dapo_math: Path, aime: Optional[Path], out_dir: Path, on_bad_row: str = "error",
            keep_eval_overlap: bool = False) -> Dict[str, dict]:
    """Read, check, dedup and write both datasets; returns {name: revision record}."""
    records: Dict[str, dict] = {}
    eval_prompts = set()
    if aime is not None:
        eval_problems, eval_report = read_or_explain(read_problems, aime, DAPO_COLUMNS, on_bad_row=on_bad_row,
                                                     dedup=True)
        if len(eval_problems) != AIME_2024_PROBLEMS:
            print(f"warning: {aime} holds {len(eval_problems)} distinct problems, AIME 2024 has "
                  f"{AIME_2024_PROBLEMS}", file=sys.stderr)
        eval_prompts = {p.prompt for p in eval_problems}
        records["aime_2024"] = write_dataset(eval_problems, aime, eval_report, out_dir / "aime_2024.parquet", "MATH")
    train, train_report = read_or_explain(read_problems, dapo_math, DAPO_COLUMNS, on_bad_row=on_bad_row, dedup=True)
    overlap = [p for p in train if p.prompt in eval_prompts]
    if overlap and not keep_eval_overlap:
        train = [p for p in train if p.prompt not in eval_prompts]
        require_problems(train, str(dapo_math), DAPO_COLUMNS, f" for training: all {len(overlap)} of its problems are "
                         f"in the eval set {aime} (was the eval file given as --dapo-math?)")
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
        write_text_atomic(out_dir / f"{name}.revision.json", json.dumps(rec, indent=2) + "\n")
    return records


def read_published_set(paths: Sequence[Path], name: str, on_bad_row: str = "error") -> tuple:
    """(problems in the DAPO prompt template, the files' reports summed) of one published eval
    set given as one or more files (opencompass/AIME2025 has one per exam)."""
    problems: List[Problem] = []
    total = ReadReport(path=", ".join(map(str, paths)))
    for path in paths:
        read, report = read_or_explain(read_published_problems, path, PUBLISHED_COLUMNS[name], name,
                                       on_bad_row=on_bad_row, dedup=True)
        problems += read
        for field_name in ("num_rows", "num_skipped", "num_duplicates", "num_conflicting_duplicates"):
            setattr(total, field_name, getattr(total, field_name) + getattr(report, field_name))
        total.skip_reasons.update(report.skip_reasons)
    seen, distinct = set(), []
    for p in problems:  # the same problem in two files counts once
        if p.prompt not in seen:
            seen.add(p.prompt)
            distinct.append(Problem(id=p.id, prompt=DAPO_PROMPT_TEMPLATE.format(problem=p.prompt),
                                    ground_truth=p.ground_truth, data_source=p.data_source))
    total.num_duplicates += len(problems) - len(distinct)
    total.num_problems = len(distinct)
    return distinct, total


def prepare_eval_sets(sets: Dict[str, Sequence[Path]], out_dir: Path, on_bad_row: str = "error") -> Dict[str, dict]:
    """Read and write each published eval set of `sets` (name in PUBLISHED_EVAL_SETS -> its files)."""
    records: Dict[str, dict] = {}
    for name, paths in sets.items():
        problems, report = read_published_set(paths, name, on_bad_row)
        if len(problems) != PUBLISHED_EVAL_SETS[name]:
            print(f"warning: {', '.join(map(str, paths))} hold {len(problems)} distinct problems, {name} has "
                  f"{PUBLISHED_EVAL_SETS[name]}", file=sys.stderr)
        records[name] = write_dataset(problems, paths, report, out_dir / f"{name}.parquet", "MATH")
    return records


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dapo-math", type=Path, default=None, help="published DAPO-Math-17k parquet")
    parser.add_argument("--aime", type=Path, default=None, help="published AIME 2024 parquet (960 rows)")
    parser.add_argument("--out", type=Path, default=Path("data"), help="output directory ($DAPO_DATA_DIR)")
    parser.add_argument("--on-bad-row", choices=("error", "skip"), default="error")
    parser.add_argument("--keep-eval-overlap", action="store_true",
                        help="keep training prompts that also appear in the eval set")
    parser.add_argument("--aime-2025", type=Path, nargs="+", default=None,
                        help="published AIME 2025 file(s): opencompass/AIME2025 jsonl or yentinglin/aime_2025 parquet")
    parser.add_argument("--math-500", type=Path, nargs="+", default=None,
                        help="published MATH-500 jsonl (HuggingFaceH4/MATH-500 test.jsonl)")
    args = parser.parse_args(argv)
    published = {name: paths for name, paths in (("aime_2025", args.aime_2025), ("math_500", args.math_500)) if paths}
    if args.dapo_math is None and not published:
        parser.error("give --dapo-math (and --aime), or an eval set: --aime-2025 / --math-500")
    try:
        records = prepare_eval_sets(published, args.out, args.on_bad_row)
        if args.dapo_math is not None:
            records.update(prepare(args.dapo_math, args.aime, args.out, args.on_bad_row, args.keep_eval_overlap))
    except DataError as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 1
    for name, record in records.items():
        print(f"{name}: {record['num_problems']} problems from {record['source_rows']} rows "
              f"({record['duplicates_dropped']} duplicates, {record['skipped_rows']} skipped) "
              f"revision {record['revision']} -> {args.out / record['file']}")
    if args.dapo_math is not None:
        print(f"run revision {records['dapo_math_17k']['run_revision']} (what a run on these files stamps into "
              "every ledger row and prints at start, without eval.sets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
