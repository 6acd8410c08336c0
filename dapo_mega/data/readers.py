"""Readers for DAPO-Math-17k / AIME 2024 parquet files and JSONL, with validation.

Parquet schema (DAPO-Math-17k, AIME 2024):
    data_source  str                               optional, default: the file stem
    prompt       list of {"role", "content"}       required (chat list, one user message)
    ability      str                               ignored
    reward_model {"ground_truth": str, "style": …} required
    extra_info   {"index": int | str, …}           optional → Problem.id

JSONL: one JSON object per line, either the same fields as the parquet schema (`prompt`
may also be a plain string), or the simple form
    {"id": str | int, "prompt": str, "answer": str, "data_source"?: str, "answer_prefix"?: str}

Published evaluation sets (`read_published_problems`, what tools/prepare_data.py reads):
    AIME 2025  (opencompass/AIME2025 jsonl, yentinglin/aime_2025 parquet)
               {"question" | "problem": str, "answer": str | int, "id"?: …}
    MATH-500   (HuggingFaceH4/MATH-500 jsonl)
               {"problem", "solution", "answer", "subject", "level", "unique_id"}
each row mapped to the simple form (the problem text as the prompt, an integer answer as its
decimal string, `unique_id` / `id` as the id) and validated as above.

Validation: missing file, unreadable/truncated parquet, missing columns, and per row: a
prompt that is missing, empty or not text; a ground truth that is missing, empty or not a
string; the same id on two different prompts. With on_bad_row="error" the first bad row
raises DataError naming file, row and field; with "skip" it is dropped and counted by
reason in the ReadReport.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Tuple

from dapo_mega.data.problem import DataError, Problem

_PARQUET_BATCH_ROWS = 8192


@dataclass
class ReadReport:
    """What reading one file did (logged, and recorded with the dataset revision)."""

    path: str
    num_rows: int = 0
    num_problems: int = 0
    num_skipped: int = 0
    skip_reasons: Counter = field(default_factory=Counter)
    num_duplicates: int = 0
    num_conflicting_duplicates: int = 0
    """Duplicated prompts whose ground truths differ (the first one is kept)."""


class _BadRow(Exception):
    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field_name = field_name
        self.problem = problem


def _prompt_from(value: object) -> Tuple[str, Tuple[Dict[str, str], ...]]:
    """(prompt text, chat list) from a chat list or a plain string."""
    if isinstance(value, str):
        text, messages = value, ({"role": "user", "content": value},)
    elif isinstance(value, (list, tuple)) or hasattr(value, "tolist"):
        items = value.tolist() if hasattr(value, "tolist") else list(value)
        messages_list = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("content"), str):
                raise _BadRow("prompt", "chat list entries must be {'role': str, 'content': str}")
            messages_list.append({"role": str(item.get("role", "user")), "content": item["content"]})
        users = [m["content"] for m in messages_list if m["role"] == "user"]
        if not users:
            raise _BadRow("prompt", "chat list has no user message")
        text, messages = users[-1], tuple(messages_list)
    elif value is None:
        raise _BadRow("prompt", "missing")
    else:
        raise _BadRow("prompt", f"expected a chat list or a string, got {type(value).__name__}")
    if not text.strip():
        raise _BadRow("prompt", "empty")
    return text, messages


def _row_to_problem(row: Mapping[str, object], default_source: str) -> Problem:
    if "reward_model" in row and row["reward_model"] is not None:
        reward_model = row["reward_model"]
        if not isinstance(reward_model, dict):
            raise _BadRow("reward_model", f"expected a struct with ground_truth, got {type(reward_model).__name__}")
        truth, truth_field = reward_model.get("ground_truth"), "reward_model.ground_truth"
        extra = dict(row["extra_info"]) if isinstance(row.get("extra_info"), dict) else {}
        raw_id = extra.get("index")
    elif "answer" in row:
        truth, truth_field = row["answer"], "answer"
        raw_id = row.get("id")
        extra = dict(row["extra_info"]) if isinstance(row.get("extra_info"), dict) else {}
    else:
        raise _BadRow("reward_model.ground_truth", "missing (no reward_model or answer field)")
    if truth is None:
        raise _BadRow(truth_field, "missing")
    if not isinstance(truth, str):
        raise _BadRow(truth_field, f"must be a string, got {type(truth).__name__} {truth!r:.40}")
    if not truth.strip():
        raise _BadRow(truth_field, "empty")
    prompt, messages = _prompt_from(row.get("prompt"))
    source = row.get("data_source") or default_source
    if not isinstance(source, str):
        raise _BadRow("data_source", f"must be a string, got {type(source).__name__}")
    if raw_id is None or (isinstance(raw_id, str) and not raw_id):
        # stable across dedup and re-ordering: derived from the content
        raw_id = f"{source}-{hashlib.sha256(prompt.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"
    elif not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool):
        raise _BadRow("id", f"must be a string or an integer, got {type(raw_id).__name__}")
    prefix = row.get("answer_prefix", "") or ""
    if not isinstance(prefix, str):
        raise _BadRow("answer_prefix", f"must be a string, got {type(prefix).__name__}")
    return Problem(id=str(raw_id), prompt=prompt, ground_truth=truth, data_source=source,
                   messages=messages, answer_prefix=prefix, extra_info=extra)


def _iter_parquet_rows(path: Path) -> Iterator[Dict[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file (truncated or corrupt?): {exc}") from exc
    columns = set(parquet.schema_arrow.names)
    missing = [name for name in ("prompt", "reward_model") if name not in columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; expected the DAPO-Math-17k schema "
                        f"(data_source, prompt, ability, reward_model, extra_info), found {sorted(columns)}")
    wanted = [c for c in ("data_source", "prompt", "reward_model", "extra_info") if c in columns]
    try:
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=wanted):
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: parquet data unreadable (truncated or corrupt?): {exc}") from exc


def _iter_jsonl_rows(path: Path) -> Iterator[object]:
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle):
            if not raw.strip():
                yield None  # blank line: counted as a bad row
                continue
            try:
                yield json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                yield _BadRow("json", f"line {line_number + 1} is not valid JSON: {exc}")


def _published_row(row: object) -> object:
    """A row of a published eval set (see the module docstring) in the simple form."""
    if not isinstance(row, dict) or "prompt" in row or "reward_model" in row:
        return row  # a bad row, or already the project's form: validated as such
    text = row.get("problem") if row.get("problem") is not None else row.get("question")
    if text is None:
        return _BadRow("problem", f"missing (expected a problem or question field, found {sorted(row)})")
    answer = row.get("answer")
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)  # AIME answers are integers; some copies store them as numbers
    simple = {"prompt": text, "answer": answer}
    raw_id = row.get("unique_id") if row.get("unique_id") is not None else row.get("id")
    if raw_id is not None:
        simple["id"] = raw_id
    return simple


def _iter_raw_parquet_rows(path: Path) -> Iterator[Dict[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file (truncated or corrupt?): {exc}") from exc


def read_published_problems(path: str | Path, data_source: str, on_bad_row: str = "error",
                            dedup: bool = True) -> Tuple[List[Problem], ReadReport]:
    """Read a published eval set (AIME 2025, MATH-500: .jsonl or .parquet, see the module
    docstring) into problems of `data_source`, validated and deduplicated as `read_problems` does."""
    path = Path(path)
    raw = _iter_file_rows(path, _iter_raw_parquet_rows, "")
    rows = ({**r, "data_source": data_source} if isinstance(r, dict) else r for r in map(_published_row, raw))
    return _problems_from_rows(path, rows, on_bad_row, dedup)


def read_problems(path: str | Path, on_bad_row: str = "error", dedup: bool = True) -> Tuple[List[Problem], ReadReport]:
    """Read, validate and (optionally) deduplicate the problems of one file.

    Args:
        path: .parquet or .jsonl (.json lines) file.
        on_bad_row: "error" raises DataError on the first bad row; "skip" drops and counts it.
        dedup: keep only the first row of each prompt text (DAPO-Math-17k repeats each
            prompt many times; AIME 2024 repeats each problem 32 times).

    Returns:
        (problems in file order, report). Raises DataError for a missing or unreadable file,
        a wrong schema, a file with no valid row, and (in "error" mode) any bad row.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r} (data.on_bad_row)")
    path = Path(path)
    rows = _iter_file_rows(path, _iter_parquet_rows, " (check data.train_path / data.eval_path)")
    return _problems_from_rows(path, rows, on_bad_row, dedup)


def read_first_problem(path: str | Path) -> Tuple[Problem, int]:
    """(the first valid problem of a .parquet / .jsonl file, its row number): what a run's
    checks probe a reward function with before it starts. DataError when no row is valid."""
    path = Path(path)
    for row_number, row in enumerate(_iter_file_rows(path, _iter_parquet_rows, " (check data.train_path)")):
        if isinstance(row, dict):
            try:
                return _row_to_problem(row, default_source=path.stem), row_number
            except _BadRow:
                continue
    raise DataError(f"{path}: no valid row (check data.train_path)")


def _iter_file_rows(path: Path, parquet_rows: Callable[[Path], Iterator[object]], where: str) -> Iterator[object]:
    """The rows of a .parquet (through `parquet_rows`) or .jsonl file; DataError for a missing
    file (`where` says which setting names it) or another file type."""
    if not path.is_file():
        raise DataError(f"{path}: no such file{where}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return parquet_rows(path)
    if suffix in (".jsonl", ".json"):
        return _iter_jsonl_rows(path)
    raise DataError(f"{path}: unknown file type {suffix!r}; use .parquet or .jsonl")


def _problems_from_rows(path: Path, rows: Iterator[object], on_bad_row: str,
                        dedup: bool) -> Tuple[List[Problem], ReadReport]:
    """Validate, count and deduplicate rows read from `path` (see `read_problems`)."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r} (data.on_bad_row)")
    report = ReadReport(path=str(path))
    problems: List[Problem] = []
    first_by_prompt: Dict[str, Problem] = {}
    first_by_id: Dict[str, Tuple[int, str]] = {}  # id → (row, prompt)
    for row_number, row in enumerate(rows):
        report.num_rows += 1
        try:
            if isinstance(row, _BadRow):
                raise row
            if not isinstance(row, dict):
                raise _BadRow("row", "blank line" if row is None else f"expected an object, got {type(row).__name__}")
            problem = _row_to_problem(row, default_source=path.stem)
            seen = first_by_id.get(problem.id)
            if seen is not None and seen[1] != problem.prompt:
                raise _BadRow("id", f"duplicated id {problem.id!r} (first at row {seen[0]}) on a different prompt")
        except _BadRow as bad:
            if on_bad_row == "error":
                raise DataError(f"{path}: row {row_number}: field {bad.field_name}: {bad.problem}") from None
            report.num_skipped += 1
            report.skip_reasons[f"{bad.field_name}: {bad.problem.split(' (')[0][:60]}"] += 1
            continue
        first_by_id.setdefault(problem.id, (row_number, problem.prompt))
        if dedup:
            kept = first_by_prompt.get(problem.prompt)
            if kept is not None:
                report.num_duplicates += 1
                if kept.ground_truth != problem.ground_truth:
                    report.num_conflicting_duplicates += 1
                continue
            first_by_prompt[problem.prompt] = problem
        problems.append(problem)
    report.num_problems = len(problems)
    if not problems:
        raise DataError(f"{path}: no valid problem in {report.num_rows} row(s) "
                        f"(skipped: {dict(report.skip_reasons) or 'none'})")
    return problems, report
