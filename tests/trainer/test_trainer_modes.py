"""`dapo-mega train` end to end on the tiny config: colocated, disaggregated sync and async.

Each run is the real loop (Megatron learner, embedded engine process, weight sync, ledger,
records) in a subprocess, small enough to take well under a minute. The run directory is
then checked against what DESIGN.md "Records" promises and against the ledger itself:
versions and ages consistent with the mode, one metrics row and one ledger shard per step,
per-step metrics recomputed by hand from the ledger rows.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from dapo_mega.config import from_yaml
from dapo_mega.rollout.ledger import read_records
from dapo_mega.run_identity import read_run_id

REPO = Path(__file__).resolve().parents[2]
RUN_NAME = "run"
TRAIN_GROUPS, GROUP_SIZE = 4, 4

# Single-digit sums, a short warm start (so some answers are right and rewards vary), 3
# steps of 4 groups x 4 samples. gen_batch_size = 8 > 4 leaves a surplus every step (carried
# in the asynchronous modes, back to `pending` in the synchronous ones).
SMALL = [
    f"trainer.run_name={RUN_NAME}", "trainer.sft_warmup_steps=20", "trainer.sft_batch_size=32",
    "trainer.total_steps=3", "trainer.save_interval=0", "trainer.eval_interval=0",
    f"algo.train_batch_size={TRAIN_GROUPS}", "algo.gen_batch_size=8", "algo.mini_batch_size=2",
    f"algo.n_samples_per_prompt={GROUP_SIZE}", "algo.dynamic_sampling=false",
    "eval.n_samples=2", "eval.max_problems=8", "data.synthetic_max_digits=1", "data.synthetic_num_eval=40",
]

# DESIGN.md "Records": per-step metrics every training row must carry.
DESIGN_KEYS = [
    "rollout/reward_mean", "rollout/accuracy", "rollout/all_correct_rate", "rollout/all_wrong_rate",
    "rollout/kept_group_frac", "rollout/gen_batches", "rollout/response_length_mean",
    "rollout/response_length_p50", "rollout/response_length_p90", "rollout/response_length_max",
    "rollout/clip_rate", "loss/clip_frac_low", "loss/clip_frac_high", "actor/entropy", "actor/grad_norm",
    "verifier/num_errors", "time/rollout_s", "time/train_s", "time/sync_s", "sync/gbps",
    "rollout/tokens_per_s", "perf/train_tokens_per_s",
    "mem/rollout/rss_peak_gib", "mem/train/rss_peak_gib", "mem/sync/rss_peak_gib",  # the driver's, per phase
]

LEDGER_FIELDS = ["run_id", "step", "prompt_id", "dataset_revision", "sample_index", "seed", "policy_version_min",
                 "policy_version_max", "learner_version", "age", "engine_id", "queue_delay_s",
                 "generation_latency_s", "response_length", "truncated", "reward", "correct", "reward_components",
                 "verifier", "verifier_version", "reject_reason"]


def train_command(output_dir: Path, *overrides: str) -> list:
    """SMALL with `overrides` replacing keys it already sets (Hydra rejects a key given twice)."""
    merged = dict(item.split("=", 1) for item in SMALL)
    merged.update(item.split("=", 1) for item in overrides)
    return [sys.executable, "-m", "dapo_mega.cli", "train", f"trainer.output_dir={output_dir}",
            *(f"{k}={v}" for k, v in merged.items())]


def start_train(cmd: list, log_path: Path) -> subprocess.Popen:
    """The trainer in its own process group (its engine and torchrun ranks join it)."""
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def run_train(tmp_path: Path, *overrides: str, timeout_s: float = 240, tag: str = "train") -> str:
    """Run `dapo-mega train` to the end; returns its output (fails the test on a non-zero exit)."""
    log_path = tmp_path / f"{tag}.log"
    proc = start_train(train_command(tmp_path, *overrides), log_path)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        code = proc.poll()
        kill_group(proc)  # also reaps anything the trainer left behind
    output = log_path.read_text()
    assert code == 0, f"dapo-mega train exited with {code}:\n{output[-6000:]}"
    return output


def read_rows(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def records_by_step(run_dir: Path) -> dict:
    out: dict = {}
    for r in read_records(run_dir):
        out.setdefault(r.step, []).append(r)
    return out


def check_records_of_run(run_dir: Path, total_steps: int, max_staleness: int, first_row_step: int = 1,
                         age_limit: Optional[int] = None) -> None:
    """What every mode must satisfy; versions and ages by the mode's staleness bound (the age
    limit: cluster.max_sample_age, default the staleness)."""
    limit = max_staleness if age_limit is None else age_limit
    rows = [r for r in read_rows(run_dir) if r["step"] >= 1]
    assert [r["step"] for r in rows] == list(range(1, total_steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, total_steps + 1))   # +1 per step
    for row in rows:
        missing = [k for k in DESIGN_KEYS if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"

    shards = sorted(p.name for p in (run_dir / "ledger").glob("step_*.parquet"))
    assert shards == [f"step_{s:08d}.parquet" for s in range(1, total_steps + 1)]
    by_step = records_by_step(run_dir)
    # every row names the data it came from: one revision (not '')
    revisions = {r.dataset_revision for recs in by_step.values() for r in recs}
    assert len(revisions) == 1 and "" not in revisions, revisions
    # ... and what the model was given (one encoder), and who graded it (a derived version)
    encoders = {r.encoder for recs in by_step.values() for r in recs}
    assert len(encoders) == 1 and next(iter(encoders)).startswith("template=raw;chat=off;tokenizer="), encoders
    from dapo_mega.reward import build_verifier

    assert {r.verifier_version for recs in by_step.values() for r in recs} == {build_verifier("dapo").version}
    assert all(r.answer_found == (r.extracted_answer is not None) for recs in by_step.values() for r in recs)
    assert all(r.verifier_error is None for recs in by_step.values() for r in recs if r.reject_reason == "kept")
    for step, recs in by_step.items():
        for r in recs:
            for name in LEDGER_FIELDS:
                assert getattr(r, name) is not None, name
            assert r.run_name == RUN_NAME and r.verifier == "dapo" and r.engine_id.startswith("http://127.0.0.1:")
            assert r.run_id == read_run_id(run_dir) and r.run_id.startswith(RUN_NAME + "-")  # unique to the run
            assert r.age == r.learner_version - r.policy_version_min >= 0
            assert r.policy_version_min <= r.policy_version_max <= step - 1   # no engine ahead of the learner
            assert set(json.loads(r.reward_components)) >= {"correctness", "overlong_penalty"}
            assert r.reward == pytest.approx(json.loads(r.reward_components)["correctness"]
                                             + json.loads(r.reward_components)["overlong_penalty"])
        kept = [r for r in recs if r.reject_reason in ("kept", "verifier_error")]
        assert len(kept) == TRAIN_GROUPS * GROUP_SIZE                    # dynamic sampling off: full batch
        assert all(r.learner_version == step - 1 for r in kept)         # learner of step s holds version s-1
        assert all(0 <= r.age <= limit for r in kept)
        if limit == 0:
            # synchronous: everything the learner saw at step s was generated by version s-1;
            # surplus carried from an older version is recorded as stale, never trained on
            for r in recs:
                assert r.learner_version == step - 1
                assert (r.age == 0) == (r.reject_reason != "stale"), r
        # the step's metrics are the ledger's rows, recomputed by hand
        row = rows[step - 1]
        assert row["rollout/num_samples"] == len(recs)
        assert row["rollout/reward_mean"] == pytest.approx(sum(r.reward for r in recs) / len(recs))
        assert row["rollout/accuracy"] == pytest.approx(sum(r.correct for r in recs) / len(recs))
        assert row["rollout/response_length_max"] == max(r.response_length for r in recs)
        assert row["rollout/clip_rate"] == pytest.approx(sum(r.truncated for r in recs) / len(recs))

    # every weight of the model goes to the engine once per step, whatever the learner's TP
    from safetensors import safe_open

    with safe_open(str(run_dir / "base_model" / "model.safetensors"), "pt") as f:
        model_bytes = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert all(row["sync/bytes"] == model_bytes for row in rows)

    cfg = from_yaml((run_dir / "config.yaml").read_text())
    assert cfg.trainer.total_steps == total_steps and cfg.cluster.max_staleness == max_staleness
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run"
    assert (run_dir / "checkpoints" / f"step_{total_steps:06d}").is_dir()   # always saved at the end


def test_colocated_sync_end_to_end(tmp_path):
    output = run_train(tmp_path, "trainer.eval_interval=3")
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=3, max_staleness=0)
    by_step = records_by_step(run_dir)
    printed = re.search(r"held-out problems, revision (\S+);", output).group(1)
    assert {r.dataset_revision for recs in by_step.values() for r in recs} == {printed}  # was '' in every row
    # gen 8 prompts for 4 groups: synchronous rounds stream, decide groups in prompt order and
    # abort the requests in flight once 4 groups are kept; the prompts after the 4th go back to
    # `pending` (a finished request's samples discarded, counted), so nothing is carried and
    # nothing goes stale, and every step's rows are its 4 groups
    rows = read_rows(run_dir)
    by_row = {r["step"]: r for r in rows}
    stale = [sum(r.reject_reason == "stale" for r in by_step[s]) for s in (1, 2, 3)]
    assert stale == [0, 0, 0] and all(by_row[s]["rollout/carried_groups"] == 0 for s in (1, 2, 3))
    assert all(len(by_step[s]) == 4 * 4 == 4 * by_row[s]["rollout/groups_generated"] for s in (1, 2, 3))
    assert all(by_row[s]["rollout/prompts_requested"] >= by_row[s]["rollout/groups_generated"] for s in (1, 2, 3))
    assert all(by_row[s]["rollout/discarded_samples"] == 4 * by_row[s]["rollout/discarded_groups"] for s in (1, 2, 3))
    # evaluation before step 1 and after the last step, with the same problems
    evals = [r for r in rows if "eval/avg_at_k" in r]
    assert [r["step"] for r in evals] == [0, 3]
    for r in evals:
        result = json.loads((run_dir / "eval" / f"step_{r['step']:06d}.json").read_text())
        assert len(result["problems"]) == 8 and result["k"] == 2
        assert r["eval/avg_at_k"] == pytest.approx(sum(p["correct"] / 2 for p in result["problems"]) / 8)
    # the ledger report reads the same run back: its per-step numbers are the trainer's
    from dapo_mega.ledger_report import build_report

    report = build_report(run_dir)
    assert [d.step for d in report.steps] == [1, 2, 3]
    for d in report.steps:
        assert d.num_samples == by_row[d.step]["rollout/num_samples"]
        assert d.reward_mean == pytest.approx(by_row[d.step]["rollout/reward_mean"])
        assert d.length_p90 == pytest.approx(by_row[d.step]["rollout/response_length_p90"])
        assert d.metrics_verifier_errors == by_row[d.step]["verifier/num_errors"]
    assert {a.label for a in report.ages} == ({"0", "1"} if sum(stale) else {"0"})  # age 1: only the stale surplus
    # the ledger's seed is the request's sampling_seed, from (trainer.seed, step, round, prompt)
    from dapo_mega.rollout.manager import request_seed

    seed = from_yaml((run_dir / "config.yaml").read_text()).trainer.seed
    fresh = [r for r in by_step[3] if r.reject_reason != "stale"]
    assert fresh and all(r.seed == request_seed(seed, 3, r.gen_round, r.prompt_id) for r in fresh)
    # the console line: one fixed-format line per step; step 0 holds only the evaluation
    lines = [line for line in output.splitlines() if line.startswith("step ")]
    assert len(lines) == 4 and lines[-1].startswith("step     3 | v3 ")
    assert lines[0].startswith("step     0 | v0    | eval ") and not any(re.search(r"\bnan\b", x) for x in lines)
    # known library warnings are in the run's log, once each, not on the console
    assert "Apex is not installed" not in output and "all_gather_into_tensor" not in output
    logged = (run_dir / "logs" / "warnings.log").read_text()
    assert "Apex is not installed" in logged and len(logged.splitlines()) == len(set(logged.splitlines()))


@pytest.mark.slow
def test_disaggregated_sync_end_to_end(tmp_path):
    run_train(tmp_path, "cluster.mode=disaggregated", "cluster.max_staleness=0")
    check_records_of_run(tmp_path / RUN_NAME, total_steps=3, max_staleness=0)


@pytest.mark.slow
def test_disaggregated_async_staleness_one(tmp_path):
    run_train(tmp_path, "cluster.mode=disaggregated", "cluster.max_staleness=1", "algo.gen_batch_size=4")
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=3, max_staleness=1)
    by_step = records_by_step(run_dir)
    # generation of step s+1 starts while step s trains, on the weights of version s-1:
    # the first tokens of step 2 and 3 are one version behind the learner that trains on them
    assert any(r.age == 1 for s in (2, 3) for r in by_step[s] if r.reject_reason == "kept")
    rows = {r["step"]: r for r in read_rows(run_dir)}
    for step in (1, 2, 3):
        kept = [r for r in by_step[step] if r.reject_reason in ("kept", "verifier_error", "stale")]
        assert rows[step]["rollout/age_max"] == max(r.age for r in kept)
        ages = {}
        for r in kept:
            ages.setdefault(min(r.age, 3), []).append(r)
        for age, recs in ages.items():
            label = "3+" if age == 3 else str(age)
            assert rows[step][f"age/{label}/num_samples"] == len(recs)
            assert rows[step][f"age/{label}/accuracy"] == pytest.approx(sum(r.correct for r in recs) / len(recs))


@pytest.mark.slow
def test_tensor_parallel_two_learners(tmp_path):
    """`cluster.num_learner_processes=2`: the trainer spawns two torchrun ranks (TP = 2);
    rank 0 drives the engine, both ranks train and send their weight shards."""
    output = run_train(tmp_path, "cluster.num_learner_processes=2", "megatron.tensor_model_parallel_size=2",
                       "trainer.total_steps=2", "trainer.sft_warmup_steps=10", timeout_s=400)
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=2, max_staleness=0)
    assert sum(line.startswith("step ") for line in output.splitlines()) == 2   # rank 0 logs, once per step
    rows = read_rows(run_dir)
    assert all(math.isfinite(r["actor/grad_norm"]) for r in rows)


@pytest.mark.slow
def test_disaggregated_queue_of_one_with_an_age_limit_of_zero(tmp_path):
    """cluster.max_staleness=1 (generation runs a version ahead) and max_sample_age=0: what
    was generated ahead is dropped as stale when consumed and refilled at the learner's
    version, so every trained sample is on-policy, and the refills are in the metrics."""
    run_train(tmp_path, "cluster.mode=disaggregated", "cluster.max_staleness=1", "cluster.max_sample_age=0",
              "algo.gen_batch_size=4")
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=3, max_staleness=1, age_limit=0)
    by_step = records_by_step(run_dir)
    assert all(r.age == 0 for recs in by_step.values() for r in recs if r.reject_reason == "kept")
    rows = {r["step"]: r for r in read_rows(run_dir)}
    assert sum(rows[s]["rollout/refilled_groups"] for s in (2, 3)) > 0 and rows[1]["rollout/refilled_groups"] == 0
    assert sum(rows[s]["rollout/stale_groups"] for s in (2, 3)) > 0
