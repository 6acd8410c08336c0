"""Run records: metrics.jsonl cut back on resume, fixed console line, curves.png."""

import json

from dapo_mega.records.console import format_console_line
from dapo_mega.records.metrics import read_metrics
from dapo_mega.records.recorder import RunRecorder


def _metrics(step):
    return {"policy_version": step, "rollout/reward_mean": 0.1 * step, "rollout/accuracy": 0.5,
            "rollout/kept_group_frac": 0.75, "rollout/response_length_mean": 7.0, "loss/pg": -0.01,
            "actor/grad_norm": 0.5, "time/rollout_s": 1.0, "time/train_s": 2.0, "time/sync_s": 0.1,
            "loss/nan_example": float("nan")}


def test_resume_truncates_and_appends(tmp_path, capsys):
    rec = RunRecorder(tmp_path, "r", {}, resume_step=0, wandb_mode="disabled", plot=True)
    for step in (1, 2, 3):
        rec.log_step(step, _metrics(step))
    rec.close()
    assert (tmp_path / "curves.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "step     2 | v2" in out and "reward +0.200" in out
    # Crash after step 3, last checkpoint at step 2: step 3 must appear once after the rerun.
    rec = RunRecorder(tmp_path, "r", {}, resume_step=2, wandb_mode="disabled", plot=False)
    rec.log_step(3, _metrics(3))
    rec.close()
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == [1, 2, 3]
    assert read_metrics(tmp_path)[0]["loss/nan_example"] is None  # NaN is not valid JSON


def test_curves_are_redrawn_at_most_once_per_interval_and_at_the_end(tmp_path, monkeypatch):
    """A drawing costs about a second of a core: steps within plot_interval_s of the last
    drawing are drawn together later, at the next step past the interval or at close."""
    from dapo_mega.records import recorder as recorder_module

    now = [1000.0]
    monkeypatch.setattr(recorder_module.time, "monotonic", lambda: now[0])
    drawn = []
    monkeypatch.setattr(recorder_module, "plot_curves",
                        lambda run_dir: drawn.append([r["step"] for r in read_metrics(run_dir)]))
    rec = RunRecorder(tmp_path, "r", {}, resume_step=0, wandb_mode="disabled", plot=True, plot_interval_s=60.0)
    for step, seconds in ((1, 0.0), (2, 20.0), (3, 20.0), (4, 25.0), (5, 10.0)):
        now[0] += seconds
        rec.log_step(step, _metrics(step))
    assert drawn == [[1], [1, 2, 3, 4]]  # the first step; then 65 s after it
    rec.close()
    assert drawn[-1] == [1, 2, 3, 4, 5]  # the end draws what came since
    rec = RunRecorder(tmp_path / "every", "r", {}, resume_step=0, wandb_mode="disabled", plot=True,
                      plot_interval_s=0.0)
    rec.log_step(1, _metrics(1))
    rec.log_step(2, _metrics(2))
    rec.close()
    assert drawn[-2:] == [[1], [1, 2]]  # 0: every step, and nothing left for close


def test_torn_line_ignored(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n{\"step\": 2, \"x\"")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_console_line_missing_values():
    # the step-0 row holds only the evaluation: no column of nans
    assert format_console_line({"step": 0, "eval/avg_at_k": 0.25}) == "step     0 | v0    | eval 0.250"
    line = format_console_line({"step": 4, "policy_version": 4, "rollout/reward_mean": float("nan")})
    assert line == "step     4 | v4    | reward +nan | eval   -  "  # a NaN the run produced is shown


def test_console_line_of_a_training_step():
    row = {"step": 20, "policy_version": 20, "rollout/reward_mean": -0.484, "rollout/accuracy": 0.258,
           "rollout/kept_group_frac": 0.51, "rollout/response_length_mean": 4.2, "rollout/entropy_mc": 0.412,
           "loss/pg": 0.0005,
           "actor/grad_norm": 3.618, "time/rollout_s": 0.3, "time/train_s": 0.3, "time/sync_s": 0.0,
           "eval/avg_at_k": 0.318}
    # the line the README shows
    assert format_console_line(row) == ("step    20 | v20   | reward -0.484 | acc 0.258 | kept 0.51 | len    4.2 | "
                                        "ent 0.412 | loss +0.0005 | gnorm 3.618 | gen   0.3s train   0.3s sync  0.0s | eval 0.318")


def test_wandb_offline_resume_same_id(tmp_path):
    rec = RunRecorder(tmp_path, "r", {"a": 1}, resume_step=0, wandb_mode="offline", plot=False)
    run_id = rec.wandb_run_id
    rec.log_step(1, _metrics(1))
    rec.close()
    rec = RunRecorder(tmp_path, "r", {"a": 1}, resume_step=1, wandb_mode="offline", wandb_run_id=run_id, plot=False)
    assert rec.wandb_run_id == run_id
    rec.close()
    assert any(p.name.startswith("offline-run") and run_id in p.name for p in (tmp_path / "wandb").iterdir())
