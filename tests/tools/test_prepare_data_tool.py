"""tools/prepare_data.py on small generated DAPO-Math / AIME parquet files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dapo_mega.data import compute_dataset_revision, read_problems

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the "
            "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
            "Remember to put your answer on its own line after \"Answer:\".")


def _write(path: Path, problems, repeats: int, source: str) -> None:
    rows = {"data_source": [], "prompt": [], "ability": [], "reward_model": [], "extra_info": []}
    for _ in range(repeats):
        for index, (question, answer) in enumerate(problems):
            rows["data_source"].append(source)
            rows["prompt"].append([{"role": "user", "content": TEMPLATE.format(problem=question)}])
            rows["ability"].append("MATH")
            rows["reward_model"].append({"ground_truth": answer, "style": "rule-lean"})
            rows["extra_info"].append({"index": f"{source}-{index}"})
    pq.write_table(pa.table(rows), path)


def test_prepare_dedups_drops_eval_overlap_and_records_revision(tmp_path):
    train = [(f"What is {i} + {i}?", str(2 * i)) for i in range(12)]
    aime = [(f"AIME problem {k}: compute {k} squared.", str(k * k)) for k in range(30)]
    train.append(aime[3])  # a leaked eval problem in the training set
    _write(tmp_path / "dapo.parquet", train, repeats=5, source="math_dapo")  # published file repeats prompts
    _write(tmp_path / "aime.parquet", aime, repeats=32, source="aime")       # 30 x 32 = 960 rows
    out = tmp_path / "data"
    result = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_data.py"), "--dapo-math",
                             str(tmp_path / "dapo.parquet"), "--aime", str(tmp_path / "aime.parquet"),
                             "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "writing dapo_math_17k.parquet" in result.stderr  # tqdm progress

    prepared, report = read_problems(out / "dapo_math_17k.parquet", dedup=False)
    assert report.num_rows == 12  # 13 distinct prompts, 1 eval overlap dropped, 65 rows in
    assert [p.ground_truth for p in prepared] == [str(2 * i) for i in range(12)]
    record = json.loads((out / "dapo_math_17k.revision.json").read_text())
    assert (record["source_rows"], record["duplicates_dropped"], record["eval_overlap_dropped"]) == (65, 52, 1)
    assert record["revision"] == compute_dataset_revision(prepared)
    assert f"revision {record['revision']}" in result.stdout

    eval_problems, eval_report = read_problems(out / "aime_2024.parquet", dedup=False)
    assert eval_report.num_rows == 30 and eval_problems[5].ground_truth == "25"
    aime_record = json.loads((out / "aime_2024.revision.json").read_text())
    assert aime_record["source_rows"] == 960 and aime_record["num_problems"] == 30
    # the prepared file reads back to the same problems (and revision) as the source
    source_problems, _ = read_problems(tmp_path / "aime.parquet", dedup=True)
    assert aime_record["revision"] == compute_dataset_revision(source_problems)
    # the run revision it prints is the one a run on these files stamps (the trainer's own build)
    from dapo_mega.config import DataConfig
    from dapo_mega.data import build_datasets

    _, _, run_revision = build_datasets(DataConfig(train_path=str(out / "dapo_math_17k.parquet"),
                                                   eval_path=str(out / "aime_2024.parquet")))
    assert record["run_revision"] == aime_record["run_revision"] == run_revision
    assert f"run revision {run_revision}" in result.stdout


def test_prepare_reports_a_bad_row_and_exits_nonzero(tmp_path):
    _write(tmp_path / "dapo.parquet", [("What is 1 + 1?", "2"), ("What is 2 + 2?", "")], 1, "math_dapo")
    result = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_data.py"), "--dapo-math",
                             str(tmp_path / "dapo.parquet"), "--out", str(tmp_path / "data")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "prepare_data: error:" in result.stderr and "row 1" in result.stderr
    assert not (tmp_path / "data" / "dapo_math_17k.parquet").exists()


def _prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "prepare_data.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_zero_training_or_eval_problems_exit_nonzero_naming_the_file_and_columns(tmp_path):
    """The wrong file (the AIME file as --dapo-math, an empty file) is not a 0-problem dataset."""
    aime = [(f"AIME problem {k}: compute {k} squared.", str(k * k)) for k in range(30)]
    _write(tmp_path / "aime.parquet", aime, repeats=32, source="aime")
    _write(tmp_path / "empty.parquet", [], repeats=1, source="math_dapo")  # the schema, no row
    (tmp_path / "empty.jsonl").write_text("")
    columns = "data_source, prompt (a chat list), ability, reward_model ({ground_truth, style}), extra_info"
    cases = [  # (arguments, the file the error names, the columns it names)
        (["--dapo-math", "aime.parquet", "--aime", "aime.parquet"], "aime.parquet", columns),
        (["--dapo-math", "empty.parquet", "--aime", "aime.parquet"], "empty.parquet", columns),
        (["--dapo-math", "aime.parquet", "--aime", "empty.parquet"], "empty.parquet", columns),
        (["--math-500", "empty.jsonl"], "empty.jsonl", "problem, answer"),
    ]
    errors = []
    for args, culprit, expected in cases:
        out = tmp_path / "out"
        result = _prepare(*[str(tmp_path / a) if a.endswith((".parquet", ".jsonl")) else a for a in args],
                          "--out", str(out))
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        error = result.stderr.strip().splitlines()[-1]
        assert error.startswith(f"prepare_data: error: {tmp_path / culprit}:") and expected in error, (args, error)
        assert not (out / "dapo_math_17k.parquet").exists() and not (out / "math_500.parquet").exists()
        errors.append(error)
    assert "all 30 of its problems are in the eval set" in errors[0]
