"""eval.sets: the published AIME 2025 / MATH-500 formats read by tools/prepare_data.py, the
named sets' validation, their share of the run revision, the console line and the ablation
table's column per set."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.training import run_cli

from dapo_mega.config import ConfigError, load_config
from dapo_mega.data import DAPO_PROMPT_TEMPLATE, build_datasets, build_run_datasets, read_problems

REPO = Path(__file__).resolve().parents[2]
MATH_500_ROWS = [  # HuggingFaceH4/MATH-500 test.jsonl rows (fields as published)
    {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
     "solution": "We have that $r = 3$ ...", "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
     "subject": "Precalculus", "level": 2, "unique_id": "test/precalculus/807.json"},
    {"problem": "What is $1^{(2^{235423523})}$?", "solution": "One raised to any power is one.", "answer": "1",
     "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1747.json"},
]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prepare_data_reads_published_aime_2025_and_math_500(tmp_path):
    # opencompass/AIME2025: one jsonl per exam, `question` / `answer`; yentinglin/aime_2025: parquet
    # with `problem` and an integer `answer` and `id`
    part_1 = _jsonl(tmp_path / "aime2025-I.jsonl", [{"question": "Find the sum of all bases $b>9$ ...", "answer": "70"},
                                                    {"question": "On triangle ABC ...", "answer": "588"}])
    pq.write_table(pa.table({"id": [15, 16], "problem": ["Let N be the number ...", "On triangle ABC ..."],
                             "answer": [204, 588], "year": [2025, 2025]}), tmp_path / "aime2025-II.parquet")
    math = _jsonl(tmp_path / "test.jsonl", MATH_500_ROWS)
    out = tmp_path / "data"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_data.py"), "--aime-2025", str(part_1),
                           str(tmp_path / "aime2025-II.parquet"), "--math-500", str(math), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    aime, report = read_problems(out / "aime_2025.parquet", dedup=False)
    assert report.num_rows == 3  # the problem in both files once
    assert [p.ground_truth for p in aime] == ["70", "588", "204"]
    assert aime[2].id == "15" and {p.data_source for p in aime} == {"aime_2025"}
    assert aime[0].prompt == DAPO_PROMPT_TEMPLATE.format(problem="Find the sum of all bases $b>9$ ...")
    record = json.loads((out / "aime_2025.revision.json").read_text())
    assert (record["source_rows"], record["duplicates_dropped"], record["num_problems"]) == (4, 1, 3)
    assert "aime_2025 has 30" in proc.stderr  # the count is checked against the exam's
    math_problems, _ = read_problems(out / "math_500.parquet")
    assert [(p.id, p.ground_truth) for p in math_problems] == [(r["unique_id"], r["answer"]) for r in MATH_500_ROWS]
    assert math_problems[1].prompt == DAPO_PROMPT_TEMPLATE.format(problem=MATH_500_ROWS[1]["problem"])


def test_a_published_row_without_a_problem_names_the_field(tmp_path):
    bad = _jsonl(tmp_path / "bad.jsonl", [{"text": "no problem field", "answer": "1"}])
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_data.py"), "--math-500", str(bad),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "row 0: field problem: missing" in proc.stderr, proc.stderr


@pytest.mark.parametrize("override, message", [
    ("+eval.sets={aime-25:{path:x.jsonl}}", "eval.sets.aime-25: the set name 'aime-25' is not a plain identifier"),
    ("+eval.sets={aime:{path:x.jsonl,n_samples:0}}", "eval.sets.aime.n_samples: must be >= 1, got 0"),
    ("+eval.sets={aime:{n_samples:2}}", "eval.sets.aime.path: empty"),
    ("+eval.sets={eval:{path:x.jsonl}}", "eval.sets.eval: the name 'eval' is the unnamed held-out set's label"),
])
def test_named_set_config_errors(override, message):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert str(info.value).startswith(message) and "Fix:" in str(info.value) and "\n" not in str(info.value)


def test_a_missing_set_file_fails_before_any_model_is_built(tmp_path):
    missing = tmp_path / "nope.jsonl"
    proc = run_cli("train", f"trainer.output_dir={tmp_path}", f"+eval.sets={{math:{{path:'{missing}'}}}}",
                   timeout_s=120)
    assert proc.returncode != 0
    assert f"eval.sets.math.path: {missing} does not exist" in proc.stdout + proc.stderr
    # the run directory (trainer.output_dir / run_name) holds no model and no checkpoint
    assert not list(tmp_path.rglob("base_model")) and not list(tmp_path.rglob("checkpoints"))


def test_named_sets_defaults_and_their_revisions_join_the_run_revision(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", [{"id": i, "prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)])
    cfg = load_config(["eval.n_samples=3", "eval.max_problems=4", f"+eval.sets={{m:{{path:'{path}'}},"
                       f"n:{{path:'{path}',n_samples:2,max_response_length:9,max_problems:0}}}}"])
    _, held_out, plain_revision = build_datasets(cfg.data)
    _, sets, revision = build_run_datasets(cfg.data, cfg.eval)
    assert [(s.name, len(s.problems), s.n_samples, s.max_response_length) for s in sets] == [
        ("", 4, 3, None), ("m", 4, 3, None), ("n", 5, 2, 9)]
    assert sets[0].problems == held_out[:4] and sets[1].metric_prefix == "eval/m/"
    assert revision != plain_revision  # the named sets are part of what the run read
    assert build_run_datasets(cfg.data, load_config().eval)[2] == plain_revision  # none: as before


def test_console_line_and_ablation_table_show_each_named_set(tmp_path):
    from dapo_mega.ablation.report import render_table, rung_statistics, summarize_run
    from dapo_mega.records.console import format_console_line

    row = {"step": 2, "policy_version": 2, "eval/avg_at_k": 0.25, "eval/aime/avg_at_k": 0.125,
           "eval/aime/pass_at_k": 0.5, "eval/math/avg_at_k": 0.5}
    assert format_console_line(row) == "step     2 | v2    | eval 0.250 | eval/aime 0.125 | eval/math 0.500"
    runs = [summarize_run([{"step": 1, "eval/aime/avg_at_k": 0.1}, {"step": 2, "eval/aime/avg_at_k": v}], seed, "",
                          None) for seed, v in ((0, 0.2), (1, 0.4))]
    table = render_table([rung_statistics("base", runs, [], 0.95)], "ladder", 0.95, None).splitlines()
    head = [c.strip() for c in table[0].split("|")]
    cell = [c.strip() for c in table[2].split("|")][head.index("final avg@k (aime)")]
    assert cell.startswith("0.300 ± ")  # mean of the last evaluations 0.2 and 0.4


def test_curves_draw_each_named_set_in_the_accuracy_panel(tmp_path, monkeypatch):
    """curves.png's accuracy panel holds one line per named set, with that set's points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dapo_mega.records.curves import plot_curves

    rows = [{"step": s, "rollout/accuracy": 0.1 * s, "eval/avg_at_k": 0.2, "eval/aime_2025/avg_at_k": 0.05 * s,
             **({"eval/math_500/avg_at_k": 0.5} if s == 2 else {})} for s in (0, 1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    assert plot_curves(tmp_path).stat().st_size > 1000
    accuracy = next(ax for ax in drawn[0].axes if ax.get_title() == "accuracy")
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in accuracy.lines}
    assert lines["eval/aime_2025/avg_at_k"] == ([0, 1, 2], [0.0, 0.05, 0.1])
    assert lines["eval/math_500/avg_at_k"] == ([2], [0.5])
    assert {"rollout/accuracy", "eval/avg_at_k"} <= set(lines)
