"""Parquet / JSONL readers: schema, validation errors naming file/row/field, skip mode,
deduplication, revisions. Every file is written here, in tmp_path."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_mega.config import DataConfig
from dapo_mega.data import DataError, Problem, build_datasets, compute_dataset_revision, read_problems


def dapo_row(index, problem, answer, source="math_dapo"):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": problem}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_parquet_schema_and_deduplication(tmp_path):
    # 5 rows, 3 distinct prompts (DAPO-Math-17k repeats prompts with new ids)
    rows = [dapo_row("a", "What is 1+1?", "2"), dapo_row("b", "What is 2+2?", "4"),
            dapo_row("c", "What is 1+1?", "2"), dapo_row("d", "What is 3+3?", "6"),
            dapo_row("e", "What is 2+2?", "5")]
    path = write_parquet(tmp_path / "dapo.parquet", rows)
    problems, report = read_problems(path)
    assert [p.id for p in problems] == ["a", "b", "d"]
    assert problems[0] == Problem(id="a", prompt="What is 1+1?", ground_truth="2", data_source="math_dapo")
    assert problems[0].messages == ({"role": "user", "content": "What is 1+1?"},)
    assert (report.num_rows, report.num_problems, report.num_duplicates) == (5, 3, 2)
    assert report.num_conflicting_duplicates == 1  # "2+2" once with answer 4, once 5
    everything, report = read_problems(path, dedup=False)
    assert len(everything) == 5 and report.num_duplicates == 0


def test_aime_style_repeats_with_integer_index(tmp_path):
    # AIME 2024: 30 problems x 32 repeats; here 2 x 3 with integer indexes repeated
    rows = [dapo_row(i, f"problem {i}", str(i * 10), source="aime") for _ in range(3) for i in range(2)]
    problems, report = read_problems(write_parquet(tmp_path / "aime.parquet", rows))
    assert [(p.id, p.ground_truth) for p in problems] == [("0", "0"), ("1", "10")]
    assert report.num_duplicates == 4
    # without dedup the repeats stay: same id on the same prompt is allowed
    problems, _ = read_problems(tmp_path / "aime.parquet", dedup=False)
    assert len(problems) == 6


def test_jsonl_both_forms(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"id": "q1", "prompt": "2*3=?", "answer": "6"},
        {"id": 7, "prompt": "Q: 1+1\nAnswer:", "answer": "2", "data_source": "toy", "answer_prefix": "Answer:"},
        dapo_row("z", "What is 5+5?", "10"),
        {"prompt": "no id here", "answer": "1"},
    ])
    problems, _ = read_problems(path)
    assert [p.id for p in problems[:3]] == ["q1", "7", "z"]
    assert problems[0].data_source == "mixed"  # default: the file stem
    assert problems[1].answer_prefix == "Answer:" and problems[1].data_source == "toy"
    assert problems[2].prompt == "What is 5+5?"
    # a missing id is derived from the content: stable across reads
    again, _ = read_problems(path)
    assert problems[3].id == again[3].id and problems[3].id.startswith("mixed-")


@pytest.mark.parametrize("bad_row, field, row_number", [
    ({"id": "x", "prompt": "", "answer": "1"}, "prompt: empty", 1),
    ({"id": "x", "prompt": "   \n", "answer": "1"}, "prompt: empty", 1),
    ({"id": "x", "answer": "1"}, "prompt: missing", 1),
    ({"id": "x", "prompt": "p"}, "reward_model.ground_truth: missing", 1),
    ({"id": "x", "prompt": "p", "answer": 3}, "answer: must be a string", 1),
    ({"id": "x", "prompt": "p", "answer": None}, "answer: missing", 1),
    ({"id": "x", "prompt": [{"role": "system", "content": "s"}], "answer": "1"}, "prompt: chat list has no user", 1),
    ({"id": "good", "prompt": "another prompt", "answer": "2"}, "id: duplicated id 'good' (first at row 0)", 1),
    ("{not json", "json: line 2 is not valid JSON", 1),
    ("[1, 2]", "row: expected an object", 1),
])
def test_bad_jsonl_rows_name_file_row_and_field(tmp_path, bad_row, field, row_number):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"id": "good", "prompt": "p0", "answer": "0"}, bad_row,
                                                {"id": "later", "prompt": "p2", "answer": "2"}])
    with pytest.raises(DataError) as info:
        read_problems(path)
    message = str(info.value)
    assert str(path) in message and f"row {row_number}" in message and field in message
    # skip mode: the bad row is dropped and counted, the others kept
    problems, report = read_problems(path, on_bad_row="skip")
    assert [p.id for p in problems] == ["good", "later"]
    assert report.num_skipped == 1 and sum(report.skip_reasons.values()) == 1


def test_bad_parquet_rows(tmp_path):
    rows = [dapo_row("a", "ok", "1"), dapo_row("b", "int answer", "2"), dapo_row("c", "fine", "3")]
    rows[1]["reward_model"] = {"ground_truth": None, "style": "x"}
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=r"bad\.parquet: row 1: field reward_model\.ground_truth: missing"):
        read_problems(path)
    problems, report = read_problems(path, on_bad_row="skip")
    assert [p.id for p in problems] == ["a", "c"] and report.num_skipped == 1


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_problems(tmp_path / "missing.parquet")
    wrong = write_parquet(tmp_path / "wrong.parquet", [{"question": "q", "solution": "s"}])
    with pytest.raises(DataError, match=r"wrong\.parquet: missing column\(s\) \['prompt', 'reward_model'\]"):
        read_problems(wrong)
    # truncated parquet: the footer is gone
    good = write_parquet(tmp_path / "good.parquet", [dapo_row(i, f"p{i}", str(i)) for i in range(50)])
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError, match="truncated or corrupt"):
        read_problems(truncated)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1" + b"\x00" * 100 + b"PAR1")
    with pytest.raises(DataError, match="garbage.parquet"):
        read_problems(garbage)
    with pytest.raises(DataError, match="unknown file type"):
        read_problems(write_jsonl(tmp_path / "x.csv", ["a"]))
    with pytest.raises(DataError, match="no valid problem"):
        read_problems(write_jsonl(tmp_path / "allbad.jsonl", [{"prompt": "", "answer": "1"}]), on_bad_row="skip")


def test_revision_tracks_content_and_order(tmp_path):
    a = Problem("1", "p", "1", "s")
    b = Problem("2", "q", "2", "s")
    rev = compute_dataset_revision([a, b])
    assert len(rev) == 12 and int(rev, 16) >= 0
    assert compute_dataset_revision([a, b]) == rev
    assert compute_dataset_revision([b, a]) != rev
    assert compute_dataset_revision([a, Problem("2", "q", "3", "s")]) != rev
    # duplicates removed → the same revision as the deduplicated file
    once = write_parquet(tmp_path / "once.parquet", [dapo_row("a", "x", "1"), dapo_row("b", "y", "2")])
    twice = write_parquet(tmp_path / "twice.parquet", [dapo_row("a", "x", "1"), dapo_row("c", "x", "1"),
                                                       dapo_row("b", "y", "2")])
    assert compute_dataset_revision(read_problems(once)[0]) == compute_dataset_revision(read_problems(twice)[0])


def test_build_datasets_from_files(tmp_path):
    train = write_parquet(tmp_path / "train.parquet", [dapo_row(i, f"p{i % 3}", str(i % 3)) for i in range(9)])
    held = write_parquet(tmp_path / "aime.parquet", [dapo_row(i, f"h{i}", str(i)) for i in range(2)])
    report = {}
    tr, ev, rev = build_datasets(DataConfig(train_path=str(train), eval_path=str(held)), report=report)
    assert (len(tr), len(ev)) == (3, 2)
    assert report["train"].num_duplicates == 6 and report["revision"] == rev
    tr2, ev2, rev2 = build_datasets(DataConfig(train_path=str(train)))
    assert ev2 == [] and rev2 != rev
