"""Running `dapo-mega train` from a test, and what every run directory must hold.

`run_train` runs the real loop on the tiny config (SMALL, with the test's overrides) in its
own process group and returns its output; `check_records_of_run` checks a run directory
against DESIGN.md "Records" and against the ledger itself (versions and ages by the mode's
staleness bound, one metrics row and one ledger shard per step, per-step metrics recomputed
by hand from the ledger rows).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from dapo_mega.config import from_yaml
from dapo_mega.records.ledger import read_records
from dapo_mega.run_files.identity import read_run_id

REPO = Path(__file__).resolve().parents[2]
RUN_NAME = "run"
TRAIN_GROUPS, GROUP_SIZE = 4, 4

QUIET_RECORDS = ["trainer.plot=false", "trainer.wandb_mode=disabled"]
"""A test run's records without the figure and the wandb run: together ~7 s of a core per run
(wandb's import and its offline run ~3.4 s, matplotlib's import and two drawings of curves.png
~4 s), which most runs never read. `RECORDS_IN_FULL` turns them back on where a test reads them
(tests/trainer/test_trainer_modes.py's colocated run checks both, tests/records/ the recorder)."""
RECORDS_IN_FULL = ["trainer.plot=true", "trainer.wandb_mode=offline"]

# Single-digit sums, a short warm start (so some answers are right and rewards vary), 3
# steps of 4 groups x 4 samples. gen_batch_size = 8 > 4 leaves a surplus every step (carried
# in the asynchronous modes, back to `pending` in the synchronous ones).
SMALL = [*QUIET_RECORDS, 
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
    # whether the engines serve the learner's weights (driver/weight_probe.py): a run gets here only within limits
    "mismatch/logp_abs_mean", "mismatch/logp_abs_max", "mismatch/k3_kl", "probe/logp_abs_mean", "probe/engines",
]

LEDGER_FIELDS = ["run_id", "step", "prompt_id", "dataset_revision", "sample_index", "seed", "policy_version_min",
                 "policy_version_max", "learner_version", "age", "engine_id", "queue_delay_s",
                 "generation_latency_s", "response_length", "truncated", "reward", "correct", "reward_components",
                 "verifier", "verifier_version", "reject_reason"]


def cli_command(command: str, *args: str) -> list:
    """`dapo-mega <command> <args>` as this interpreter runs it."""
    return [sys.executable, "-m", "dapo_mega.cli", command, *args]


def run_cli(command: str, *args: str, timeout_s: float = 300, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """`dapo-mega <command> <args>` from the repository, one CPU thread per process, output
    captured; the caller checks the exit code (config errors are exit 2, by design)."""
    return subprocess.run(cli_command(command, *args), capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def train_command(output_dir: Path, *overrides: str) -> list:
    """SMALL with `overrides` replacing keys it already sets (Hydra rejects a key given twice)."""
    merged = dict(item.split("=", 1) for item in SMALL)
    merged.update(item.split("=", 1) for item in overrides)
    return cli_command("train", f"trainer.output_dir={output_dir}", *(f"{k}={v}" for k, v in merged.items()))


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
                         age_limit: Optional[int] = None, encoder: str = "template=raw;chat=off;tokenizer=") -> None:
    """What every mode must satisfy; versions and ages by the mode's staleness bound (the age
    limit: cluster.max_sample_age, default the staleness); `encoder`: how every row's encoder
    fingerprint begins."""
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
    assert len(encoders) == 1 and next(iter(encoders)).startswith(encoder), encoders
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
            parts = json.loads(r.reward_components)  # an environment's folded turn rewards add their part
            assert r.reward == pytest.approx(parts["correctness"] + parts["overlong_penalty"] + parts.get("environment", 0.0))
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

    cfg = from_yaml((run_dir / "config.yaml").read_text())
    model_dir = Path(cfg.model.hf_path) if cfg.model.hf_path else run_dir / "base_model"  # given, or the one built
    model_bytes = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            model_bytes += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert all(row["sync/bytes"] == model_bytes for row in rows)

    assert cfg.trainer.total_steps == total_steps and cfg.cluster.max_staleness == max_staleness
    if cfg.trainer.plot:
        assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if cfg.trainer.wandb_mode == "offline":
        assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run"
    assert (run_dir / "checkpoints" / f"step_{total_steps:06d}").is_dir()   # always saved at the end
