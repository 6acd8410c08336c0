"""`dapo-mega ablate`: statistics against published t-table values and hand computations,
config composition, rung expansion, resume skip, table rendering and the sbatch array
script. The runs themselves are exercised by tests/ablation/test_ablation_runs.py (slow)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from helpers.checkpoints import fake_checkpoint

from dapo_mega.ablation.report import (
    collect,
    format_difference,
    format_interval,
    render_table,
    summarize_run,
    write_report,
)
from dapo_mega.ablation.rungs import (
    AblationPlan,
    PlannedRun,
    build_plan,
    load_ablation_config,
    merge_overrides,
    rung_overrides,
    split_arguments,
)
from dapo_mega.ablation.runner import (
    array_script,
    is_finished,
    run_locally,
    task_arguments,
    topology_directives,
)
from dapo_mega.ablation.stats import Difference, Interval, mean_interval, t_cdf, t_quantile, welch_interval
from dapo_mega.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("df,expected", [  # two-sided 95% critical values of a printed t table
    (1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (10, 2.228), (30, 2.042), (120, 1.980)])
def test_t_quantile_matches_the_t_table(df, expected):
    assert round(t_quantile(0.975, df), 3) == expected


def test_t_quantile_other_levels_and_symmetry():
    assert round(t_quantile(0.95, 9), 3) == 1.833  # one-sided 95%, 9 df
    assert round(t_quantile(0.995, 4), 3) == 4.604  # two-sided 99%, 4 df
    assert t_quantile(0.025, 7) == pytest.approx(-t_quantile(0.975, 7))
    assert t_cdf(0.0, 3.3) == pytest.approx(0.5)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)  # -> the normal quantile


def test_t_quantile_fractional_df_against_scipy():
    from scipy import stats as scipy_stats  # the dev extra installs scipy
    for df in (1.5, 2.7, 3.574920297555792, 11.2):
        assert t_quantile(0.975, df) == pytest.approx(float(scipy_stats.t.ppf(0.975, df)), rel=1e-9)


def test_mean_interval_by_hand():
    # 0.3, 0.35, 0.32: mean 0.323333, s^2 = (0.000544+0.000711+0.000011)/2 = 0.00063333
    iv = mean_interval([0.3, 0.35, 0.32])
    assert iv.mean == pytest.approx(0.3233333333)
    assert iv.std == pytest.approx(math.sqrt(0.00063333333), rel=1e-6)
    assert iv.half_width == pytest.approx(4.302653 * math.sqrt(0.00063333333 / 3), rel=1e-6)
    one = mean_interval([0.4])
    assert one.mean == 0.4 and math.isnan(one.half_width)
    assert mean_interval([]) is None


def test_welch_interval_by_hand():
    a, b = [0.3, 0.35, 0.32], [0.4, 0.42, 0.47]
    # s_a^2/3 = 0.000211111, s_b^2 = ((−0.03)^2+(−0.01)^2+0.04^2)/2 = 0.0013, /3 = 0.000433333
    se2 = 0.00063333333 / 3 + 0.0013 / 3
    df = se2 ** 2 / ((0.00063333333 / 3) ** 2 / 2 + (0.0013 / 3) ** 2 / 2)
    d = welch_interval(a, b)
    assert d.df == pytest.approx(df, rel=1e-6) and d.df == pytest.approx(3.5749, abs=1e-4)
    assert d.diff == pytest.approx(0.1066666667)
    assert d.high - d.diff == pytest.approx(t_quantile(0.975, df) * math.sqrt(se2), rel=1e-9)
    assert d.excludes_zero
    assert not welch_interval([0.3, 0.4], [0.31, 0.41]).excludes_zero
    assert welch_interval([0.3], [0.4, 0.5]) is None
    assert welch_interval([0.5, 0.5], [0.5, 0.5]).excludes_zero is False  # identical constants: diff 0 exactly


# --------------------------------------------------------------------------- config and plan
def test_compose_ladder_default_and_quick():
    cfg = load_ablation_config([])
    assert cfg.name == "dapo_ladder" and cfg.mode == "ladder"
    assert [r.name for r in cfg.rungs] == ["naive_grpo", "+overlong_filtering", "+clip_higher",
                                           "+soft_overlong_punishment", "+token_level_loss", "+dynamic_sampling"]
    quick = load_ablation_config(["+ablation=dapo_ladder", "ablation.quick=true", "ablation.target=0.5"])
    assert quick.quick and quick.target == 0.5 and len(quick.active_seeds()) >= 2
    assert load_ablation_config(["ablation=one_factor"]).mode == "sweep"
    with pytest.raises(ConfigError, match="ablation"):
        load_ablation_config(["ablation.no_such_key=1"])
    with pytest.raises(ConfigError, match="quick_rungs"):
        load_ablation_config(["ablation.quick_rungs=[nope]"])


def test_split_arguments():
    ablation, train = split_arguments(["+ablation=one_factor", "ablation.quick=true", "algo.lr=1e-4",
                                       "+experiment=tiny_cpu_slurm"])
    assert ablation == ["+ablation=one_factor", "ablation.quick=true"]
    assert train == ["algo.lr=1e-4", "+experiment=tiny_cpu_slurm"]


def test_merge_overrides_later_value_wins():
    assert merge_overrides(["algo.lr=1", "algo=grpo"], ["+algo.lr=2", "trainer.seed=3"]) == \
        ["+algo.lr=2", "algo=grpo", "trainer.seed=3"]


def test_ladder_rungs_reproduce_the_paper_recipes():
    """The composed configs of the ladder's first and last rungs are naive GRPO and full DAPO."""
    cfg = load_ablation_config(["+ablation=dapo_ladder"])
    plan = build_plan(cfg, [], "/tmp/abl", sft_warmup_steps=0)
    first, last = load_config(plan.runs_of("naive_grpo")[0].overrides), load_config(plan.runs_of("+dynamic_sampling")[0].overrides)
    g, d = first.algo, last.algo
    assert (g.clip_ratio_low, g.clip_ratio_high, g.loss_agg_mode) == (0.2, 0.2, "seq-mean-token-mean")
    assert not g.dynamic_sampling and not g.overlong_buffer_enable and not g.overlong_filter
    assert g.gen_batch_size == g.train_batch_size
    default_dapo = load_config([]).algo
    for name in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "dynamic_sampling",
                 "overlong_buffer_enable", "overlong_filter"):
        assert getattr(d, name) == getattr(default_dapo, name), name
    assert d.gen_batch_size == d.train_batch_size  # every rung: the generation batch is the train batch
    assert first.data.synthetic_task == "chain"
    # each rung changes what its name says on top of the previous one
    algos = [load_config(plan.runs_of(n)[0].overrides).algo for n in plan.rungs]
    assert algos[1].overlong_filter and not algos[0].overlong_filter
    assert algos[2].clip_ratio_high == 0.28 and algos[2].overlong_filter
    assert algos[3].overlong_buffer_enable and not algos[3].overlong_filter
    assert algos[4].loss_agg_mode == "token-mean" and algos[4].clip_ratio_high == 0.28
    assert algos[5].dynamic_sampling


def test_sweep_changes_the_base_alone():
    cfg = load_ablation_config(["+ablation=one_factor"])
    assert rung_overrides(cfg, 2) == cfg.rungs[2].overrides
    plan = build_plan(cfg, [], "/tmp/abl", sft_warmup_steps=0)
    no_clip_higher = load_config(plan.runs_of("-clip_higher")[0].overrides).algo
    assert no_clip_higher.clip_ratio_high == 0.2 and no_clip_higher.dynamic_sampling
    assert no_clip_higher.loss_agg_mode == "token-mean" and no_clip_higher.overlong_buffer_enable


def test_the_python_tool_sweep_holds_every_rung_but_the_tool_fixed(tmp_path):
    """configs/ablation/python_tool.yaml (issue #39 item 5): each rung warms up on its own
    format (no shared warm start), the tool rung runs the python tool on the sum task and the
    other answers the same problems directly; both configs pass validation."""
    from dapo_mega.config import validate_config

    cfg = load_ablation_config(["+ablation=python_tool"])
    plan = build_plan(cfg, [], tmp_path, sft_warmup_steps=1200)
    assert plan.warm_start is None and len(plan.runs) == 6
    tool, plain = (load_config(plan.runs_of(name)[0].overrides) for name in ("tool", "no_tool"))
    for c in (tool, plain):
        validate_config(c)
    assert (tool.data.synthetic_task, tool.rollout.environment) == ("sum_tool", "python")
    assert (plain.data.synthetic_task, plain.rollout.environment) == ("sum", "")
    assert tool.algo == plain.algo and tool.trainer.sft_warmup_steps == plain.trainer.sft_warmup_steps > 0
    assert (tool.data.synthetic_min_digits, tool.data.synthetic_ops) == (5, "+")


def test_plan_runs_seeds_dirs_quick_and_warm_start(tmp_path):
    cfg = load_ablation_config(["ablation.quick=true", "ablation.quick_seeds=[5,6]"])
    plan = build_plan(cfg, ["trainer.total_steps=2", "algo.clip_ratio_high=0.3"], tmp_path, sft_warmup_steps=100)
    assert plan.rungs == cfg.quick_rungs
    assert [(r.rung, r.seed) for r in plan.runs] == [(n, s) for n in cfg.quick_rungs for s in (5, 6)]
    assert Path(plan.directory) == (tmp_path / "dapo_ladder_quick").resolve()
    assert len({r.run_dir for r in plan.runs}) == len(plan.runs)
    run = plan.runs_of("+clip_higher")[0]
    composed = load_config(run.overrides)
    # the rung's technique wins over the user's override of the same field; the user's steps win over quick's
    assert composed.algo.clip_ratio_high == 0.28 and composed.trainer.total_steps == 2
    assert composed.algo.overlong_filter  # a ladder keeps the rungs quick mode leaves out
    assert composed.trainer.seed == 5 and Path(composed.trainer.output_dir) / composed.trainer.run_name == Path(run.run_dir)
    assert composed.model.megatron_path == plan.warm_start.run_dir and composed.trainer.sft_warmup_steps == 0
    warm = load_config(plan.warm_start.overrides)
    assert warm.trainer.total_steps == 0 and warm.trainer.sft_warmup_steps == load_config(cfg.quick_overrides).trainer.sft_warmup_steps > 0
    plan.save()
    again = AblationPlan.load(plan.directory)
    assert again.runs == plan.runs and again.warm_start == plan.warm_start
    no_warm = build_plan(cfg, [], tmp_path, sft_warmup_steps=0)
    assert no_warm.warm_start is None and not any("megatron_path" in o for r in no_warm.runs for o in r.overrides)


# --------------------------------------------------------------------------- resume
FAKE_TRAIN = r"""
import json, sys
from pathlib import Path
args = dict(a.split("=", 1) for a in sys.argv[1:])
run = Path(args["trainer.output_dir"]) / args["trainer.run_name"]
steps = int(args["trainer.total_steps"])
d = run / "checkpoints" / f"step_{steps:06d}"
(d / "model_optim").mkdir(parents=True, exist_ok=True)
(d / "model_optim" / "metadata.json").write_text("{}")
(d / "trainer_state.json").write_text("{}")
(run / "checkpoints" / "latest").write_text(d.name)
(run / "started.txt").write_text(" ".join(sys.argv[1:]))
"""


def test_run_locally_skips_finished_runs_and_restarts_unfinished(tmp_path):
    cfg = load_ablation_config(["ablation.seeds=[1,2]", "ablation.quick_rungs=[]"])
    plan = build_plan(cfg, ["trainer.total_steps=3"], tmp_path, sft_warmup_steps=0)
    plan.runs = plan.runs[:3]
    fake_checkpoint(Path(plan.runs[0].run_dir) / "checkpoints", 3, latest=True)  # finished
    fake_checkpoint(Path(plan.runs[1].run_dir) / "checkpoints", 2, latest=True)  # killed after step 2: resumes
    assert is_finished(plan.runs[0].run_dir, 3) and not is_finished(plan.runs[1].run_dir, 3)
    messages = []
    outcomes = run_locally(plan, say=messages.append,
                           command=lambda run: [sys.executable, "-c", FAKE_TRAIN, *run.overrides])
    assert [o.status for o in outcomes] == ["skipped", "finished", "finished"]
    timings = (Path(plan.directory) / "logs" / "timings.jsonl").read_text().splitlines()
    assert [json.loads(t)["seed"] for t in timings] == [2, 1]  # the two runs that ran
    from dapo_mega.ablation.runner import total_run_seconds
    assert total_run_seconds(plan.directory) == pytest.approx(sum(json.loads(t)["seconds"] for t in timings))
    assert not (Path(plan.runs[0].run_dir) / "started.txt").exists()
    assert "resuming at step 2" in messages[1] and "finished" in messages[2] and "starting" in messages[3]
    again = run_locally(plan, say=messages.append, command=lambda run: ["false"])
    assert [o.status for o in again] == ["skipped"] * 3


def test_a_failed_run_is_reported_and_the_rest_go_on(tmp_path):
    cfg = load_ablation_config(["ablation.seeds=[1,2]"])
    plan = build_plan(cfg, ["trainer.total_steps=1"], tmp_path, sft_warmup_steps=0)
    plan.runs = plan.runs[:2]
    outcomes = run_locally(plan, say=lambda m: None,
                           command=lambda run: ["false"] if run.seed == 1 else
                           [sys.executable, "-c", FAKE_TRAIN, *run.overrides])
    assert [o.status for o in outcomes] == ["failed", "finished"]


# --------------------------------------------------------------------------- report
def _rows(evals, entropy=(1.0, 0.8, 0.6, 0.4, 0.2), kept=(8, 8, 4, 8, 8)):
    rows = [{"step": 0, "eval/avg_at_k": 0.1}]
    for i, (e, h, k) in enumerate(zip(evals, entropy, kept), start=1):
        rows.append({"step": i, "eval/avg_at_k": e, "rollout/entropy_mc": h, "rollout/num_samples": 16,
                     "rollout/kept_samples": k, "rollout/response_length_mean": 10.0 + i,
                     "loss/clip_frac_low": 0.01, "loss/clip_frac_high": 0.03, "rollout/clip_rate": 0.5})
    return rows


def test_summarize_run_by_hand():
    s = summarize_run(_rows([0.2, 0.5, 0.4, 0.6, 0.55]), seed=1, run_dir="r", target=0.5)
    assert s.final_avg_at_k == 0.55 and s.best_avg_at_k == 0.6 and s.steps_to_target == 2
    assert s.samples_per_trained == pytest.approx(80 / 36)
    assert s.response_length == pytest.approx(13.0) and s.entropy_end == pytest.approx(0.2)  # last 20% of 5 = 1
    assert s.clip_frac_high == pytest.approx(0.03) and s.truncated_frac == pytest.approx(0.5)
    assert summarize_run(_rows([0.2, 0.3]), 1, "r", target=0.9).steps_to_target is None
    assert s.curves["eval/avg_at_k"][0] == (0, 0.1)


def test_format_cells():
    assert format_interval(Interval(mean=0.41234, half_width=0.0311, n=3, std=0.01)) == "0.412 ± 0.031"
    assert format_interval(Interval(mean=0.4, half_width=math.nan, n=1, std=math.nan)) == "0.400"
    assert format_interval(None) == "–"
    assert format_difference(Difference(diff=0.05, low=0.01, high=0.09, df=3.0)) == "+0.050 [+0.010, +0.090] *"
    assert format_difference(Difference(diff=0.05, low=-0.01, high=0.11, df=3.0)) == "+0.050 [-0.010, +0.110]"


def _write_run(run: PlannedRun, rows) -> None:
    d = Path(run.run_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_rows_intervals_and_marks(tmp_path):
    cfg = load_ablation_config(["ablation.seeds=[1,2,3]", "ablation.target=0.5"])
    plan = build_plan(cfg, [], tmp_path, sft_warmup_steps=0)
    plan.rungs = plan.rungs[:3]
    plan.runs = [r for r in plan.runs if r.rung in plan.rungs]
    finals = {"naive_grpo": [0.30, 0.35, 0.32], "+overlong_filtering": [0.40, 0.42, 0.47],
              "+clip_higher": [0.41, 0.38, 0.45]}
    for run in plan.runs:
        if run.rung == "+clip_higher" and run.seed == 3:
            continue  # not finished: missing from its row
        _write_run(run, _rows([0.2, 0.25, 0.3, 0.3, finals[run.rung][run.seed - 1]]))
    done = lambda run: (Path(run.run_dir) / "metrics.jsonl").exists()  # noqa: E731
    results = collect(plan, is_done=done)
    assert [r.name for r in results] == plan.rungs
    assert results[2].missing_seeds == [3] and len(results[2].runs) == 2
    assert results[0].stats["final_avg_at_k"].mean == pytest.approx(0.3233333333)
    assert results[1].final_diff.excludes_zero and results[1].compared_with == "naive_grpo"
    assert not results[2].final_diff.excludes_zero and results[2].compared_with == "+overlong_filtering"
    table = render_table(results, "ladder", 0.95, 0.5)
    lines = table.splitlines()
    assert len([ln for ln in lines if ln.startswith("| ")]) == 1 + 3  # header + one row per rung
    assert "| naive_grpo | 3 | 0.323 ± 0.063 |" in table
    assert "+0.107 [+0.033, +0.181] *" in table
    assert "| +clip_higher | 2 (missing 3) |" in table
    md, _ = write_report(plan, elapsed_s=60.0, is_done=done)
    data = json.loads((tmp_path / "dapo_ladder" / "ablation.json").read_text())
    assert [r["name"] for r in data["rungs"]] == plan.rungs
    assert data["rungs"][1]["final_avg_at_k_difference"]["excludes_zero"] is True
    assert (tmp_path / "dapo_ladder" / "ablation.png").stat().st_size > 1000
    assert "Wall clock of this invocation: 1.0 min" in md.read_text()


# --------------------------------------------------------------------------- Slurm array script
def test_array_script_keeps_topology_only(tmp_path):
    topology = REPO / "slurm" / "colocated.sbatch"
    kept = topology_directives(topology.read_text())
    assert "#SBATCH --nodes=16" in kept and "#SBATCH --exclusive" in kept
    assert not any(("--dependency" in k) or ("--job-name" in k) or ("--output" in k) for k in kept)
    text = array_script(topology, REPO, "/usr/bin/python3")
    assert text.startswith("#!/bin/bash\n")
    assert f"exec bash {topology}" in text and '"${ARGS[@]}"' in text
    assert "dapo_mega.ablation task-args \"$1\" \"${SLURM_ARRAY_TASK_ID:-0}\"" in text
    for recipe_word in ("algo.", "trainer.", "data.", "clip", "seed"):
        assert recipe_word not in text  # every hyperparameter comes from the task file
    tasks = tmp_path / "runs.json"
    tasks.write_text(json.dumps([["algo.lr=1"], ["algo.lr=2", "trainer.run_name='a b'"]]))
    assert task_arguments(tasks, 1) == ["algo.lr=2", "trainer.run_name='a b'"]


def test_task_args_helper_prints_one_override_per_line(tmp_path, capsys):
    from dapo_mega.ablation.__main__ import main

    tasks = tmp_path / "t.json"
    tasks.write_text(json.dumps([["a=1", "b=2"]]))
    assert main(["task-args", str(tasks), "0"]) == 0
    assert capsys.readouterr().out.splitlines() == ["a=1", "b=2"]


def test_cli_config_error_is_one_line(capsys):
    from dapo_mega.cli import main

    assert main(["ablate", "ablation.mode=diagonal"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dapo-mega: config error: ablation.mode") and "\n" not in err


def test_slurm_prepare_runs_a_zero_step_warm_start_once(tmp_path):
    """The shared warm start is a run of 0 steps: the topology script's prepare step must
    start it while it has no checkpoint, and report it complete once step 0 is saved."""
    import io
    import shlex
    from contextlib import redirect_stdout

    from dapo_mega.launch import run_prepare

    def prepare():
        cfg = load_config(["+experiment=tiny_cpu_slurm", f"trainer.output_dir={tmp_path}", "trainer.run_name=w",
                           "trainer.total_steps=0"])
        out = io.StringIO()
        with redirect_stdout(out):
            assert run_prepare(cfg, "colocated", 2, "5") == 0
        return dict(shlex.split(line)[0].split("=", 1) for line in out.getvalue().splitlines())

    assert prepare()["RUN_COMPLETE"] == "0"
    fake_checkpoint(tmp_path / "w" / "checkpoints", 0, latest=True)
    assert prepare()["RUN_COMPLETE"] == "1"


def test_submit_slurm_chains_warm_start_array_and_report(tmp_path):
    """With a stand-in `sbatch` that records its arguments: warm start, then the array after it
    succeeded, then the report after every task ended; finished runs are left out."""
    import os

    from dapo_mega.ablation.runner import submit_slurm

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.jsonl"
    fake = bin_dir / "sbatch"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"lines = open({str(calls)!r}).read().splitlines() if __import__('os').path.exists({str(calls)!r}) else []\n"
                    f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                    "print(100 + len(lines))\n")
    fake.chmod(0o755)
    cfg = load_ablation_config(["ablation.quick=true"])
    plan = build_plan(cfg, ["trainer.total_steps=2"], tmp_path / "out", sft_warmup_steps=10)
    fake_checkpoint(Path(plan.runs[0].run_dir) / "checkpoints", 2, latest=True)  # finished: not in the array
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    sub = submit_slurm(plan, "colocated.sbatch", ["--nodes=1", "--mem=4000"], max_parallel=2, repo=REPO, env=env,
                       say=lambda m: None)
    warm, array, report = [json.loads(line) for line in calls.read_text().splitlines()]
    assert (sub.warm_start_job, sub.array_job, sub.report_job, sub.num_tasks) == (100, 101, 102, len(plan.runs) - 1)
    assert "--array=0" in warm and warm[-1].endswith("warm_start.json") and "--nodes=1" in warm
    assert f"--array=0-{len(plan.runs) - 2}%2" in array and "--dependency=afterok:100" in array
    assert report[-1].endswith("report.sbatch") and "--dependency=afterany:101" in report and "--mem=4000" in report
    tasks = json.loads((Path(plan.directory) / "slurm" / "runs.json").read_text())
    assert tasks == [r.overrides for r in plan.runs[1:]]
    assert "dapo_mega.ablation report" in (Path(plan.directory) / "slurm" / "report.sbatch").read_text()


def test_the_resource_envelope_sits_beside_each_run(tmp_path):
    """Rollouts per step, the length limit (the run's config.yaml) and the peak memory of its
    phases (CUDA reserved where recorded, else RSS) are in every run's summary and the table."""
    from dapo_mega.config import DapoConfig, to_yaml

    cfg = DapoConfig()
    cfg.algo.max_response_length = 40
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    rows = _rows([0.2, 0.5])
    rows[1].update({"mem/rollout/rss_peak_gib": 1.5, "mem/train/rss_peak_gib": 2.25})
    rows[2].update({"mem/train/rss_peak_gib": 2.0})
    s = summarize_run(rows, seed=1, run_dir=str(tmp_path), target=None)
    assert (s.rollouts_per_step, s.length_limit, s.peak_memory_gib) == (16.0, 40.0, 2.25)
    rows[2]["mem/train/cuda_reserved_peak_gib"] = 60.0
    assert summarize_run(rows, seed=1, run_dir="nowhere", target=None).peak_memory_gib == 60.0
