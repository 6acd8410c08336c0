"""bench/run.py's table and the committed end-to-end result, from hand-made result dicts."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import run as bench_run  # noqa: E402
import timing  # noqa: E402


def _results(benchmarks):
    return {"git": {"commit": "0123456789abcdef", "dirty": True, "dirty_paths": ["x.py"]},
            "machine": {"cpu": "Test CPU", "cores": 2, "torch": "2.x", "python": "3.11", "gpu": "none",
                        "load_average": 0.5, "date_utc": "2026-12-02 00:00:00"},
            "mode": "quick", "benchmarks": benchmarks}


def test_table_rows_carry_spread_ratio_of_medians_and_repeats():
    main = timing.throughput_figure("learner", "tokens/s", 100, [1.0, 2.0, 4.0], 100, [2.0, 2.0, 4.0],
                                    "HF, same packed rows", "HF transformers on the same rows")
    main["rows"] = [timing.throughput_figure("learner (padded rows)", "tokens/s", 10, [1.0], 10, [2.0], "HF padded",
                                             "one sample per row")]
    md = bench_run.render_markdown(_results({"learner": main, "engine": {"status": "failed", "error": "boom"}}))
    assert "Commit: 0123456789ab + uncommitted changes" in md and "2 cores (Test CPU)" in md
    lines = [line for line in md.splitlines() if line.startswith("| learner")]
    assert lines[0] == ("| learner | tokens/s | 100 (med 50; 25-100) | HF, same packed rows | 50 (med 50; 25-50) "
                        "| 2 (of medians 1) | 3 |")
    assert lines[1].startswith("| learner (padded rows) | tokens/s | 10 (med 10; 10-10) | HF padded |")
    assert "| engine | failed: boom |" in md
    assert "- learner: baseline = HF transformers on the same rows" in md


def test_a_row_without_spread_prints_its_figure_alone():
    row = {"name": "dynamic_sampling", "metric": "samples per trained", "ours": 1.333, "baseline": 1.267,
           "baseline_name": "minimum", "ratio": 0.95, "higher_is_better": False}
    assert bench_run.table_row(row) == "| dynamic_sampling | samples per trained | 1.333 | minimum | 1.267 | 0.95 | - |"


def _seed(seed, ours_step, trl_step, ours_s, trl_s, ours_sps, trl_sps):
    reached = ours_step is not None and trl_step is not None
    out = {"seed": seed, "ours_seconds_per_step": ours_sps, "trl_seconds_per_step": trl_sps,
           "per_step_ratio": trl_sps / ours_sps,
           "ours_reached": ours_step and {"step": ours_step, "train_s": ours_s},
           "trl_reached": trl_step and {"step": trl_step, "train_s": trl_s}}
    if reached:
        out["ratio"] = trl_s / ours_s
    return out


def test_committed_e2e_reports_what_the_file_supports():
    data = {"name": "e2e_trl", "baseline_name": "TRL GRPOTrainer (dapo)", "eval_interval": 4, "seeds_run": 3,
            "seeds_reached_by_both": 2, "unreached": [3], "ours": 5.0, "baseline": 7.0, "ratio": 1.4,
            "steps_to_target": {"ours": [24, 24], "trl": [28, 28]}, "ours_seconds_per_step": 0.2,
            "trl_seconds_per_step": 0.22, "per_step_ratio": 1.1,
            "ours_rollout_overrides": ["rollout.prompts_per_request=16"],
            "per_seed": [_seed(1, 24, 28, 4.0, 6.0, 0.2, 0.21), _seed(2, 24, 28, 6.0, 8.0, 0.2, 0.26),
                         _seed(3, 28, None, 6.0, None, 0.2, 0.2)]}
    out = bench_run.summarize_committed_e2e(data, committed_in="abc1234 2026-12-01")
    assert out["status"] == "from file" and out["measured_at"] == "commit unknown"
    assert out["repeats"] == 2 and out["repeats_unit"] == "seeds"
    assert out["ours_spread"] == {"min": 4.0, "median": 5.0, "max": 6.0}
    assert out["ratio_spread"]["min"] == pytest.approx(8 / 6) and out["ratio_spread"]["max"] == pytest.approx(1.5)
    notes = " ".join(out["notes"])
    assert "measured at commit unknown" in notes and "last committed in abc1234" in notes
    # the resolution: one eval interval of 4 steps, 28 / 24 = 1.167 from step counts alone
    assert "every 4 rollout steps" in notes and "1.167" in notes and "17%" in notes
    assert "3 run, 2 reached by both" in notes and "rollout.prompts_per_request=16" in notes
    per_step = out["rows"][0]
    assert per_step["ratio"] == 1.1 and per_step["repeats"] == 3
    assert per_step["ratio_spread"]["min"] == pytest.approx(1.0) and per_step["ratio_spread"]["max"] == pytest.approx(1.3)
    line = bench_run.table_row(per_step)
    assert "(per seed 1-1.3)" in line and line.endswith("| 3 seeds, from file |")


def test_committed_e2e_names_its_commit_when_the_file_has_one():
    out = bench_run.summarize_committed_e2e({"commit": "feedbeef", "per_seed": []})
    assert out["measured_at"] == "feedbeef" and "ours_spread" not in out and "rows" not in out
    dirty = bench_run.summarize_committed_e2e({"commit": "feedbeef", "dirty": True, "per_seed": []})
    assert dirty["measured_at"] == "feedbeef + uncommitted changes"


def test_git_state_and_machine_have_the_fields_the_table_reads():
    git = bench_run.git_state()
    assert set(git) == {"commit", "dirty", "dirty_paths"}
    machine = bench_run.machine_info()
    assert {"cpu", "cores", "torch", "python", "gpu", "load_average", "date_utc"} <= set(machine)
