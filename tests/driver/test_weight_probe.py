"""The weight checks (driver/weight_probe.py): the probe's sequence and verdicts, the step
mismatch check, their limits; and a real run whose weight sync is broken on purpose
(tests/helpers/broken_sync.py) stopping before step 1 with a message that names it.

A correct run passing the checks is every whole-run test's business: the checks are on by
default, and `helpers.training.check_records_of_run` asks for their metrics in every row.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.training import REPO, RUN_NAME, SMALL

from dapo_mega.algo import compute_mismatch_stats
from dapo_mega.config import ConfigError, load_config, validate_config
from dapo_mega.driver.weight_probe import (
    BF16_MAX_ABS_MEAN,
    FP32_MAX_ABS_MEAN,
    judge_probe,
    probe_token_ids,
    resolve_limit,
    step_mismatch_failure,
)

URL = "http://127.0.0.1:30001"


def stats_of(learner, engine):
    learner, engine = torch.tensor([learner]), torch.tensor([engine])
    return compute_mismatch_stats(learner, engine, torch.ones_like(learner))


def test_probe_ids_are_the_text_then_fixed_ids_inside_the_vocabulary():
    ids = probe_token_ids(100, 12, text_ids=[5, 99, 7, 150])
    assert ids[:2] == [5, 7]  # ids at vocab_size - 1 or beyond are left out of the text
    assert len(ids) == 12 and all(0 <= t < 99 for t in ids)
    assert ids == probe_token_ids(100, 12, text_ids=[5, 99, 7, 150])  # the same on every rank and sync
    assert probe_token_ids(100, 3, text_ids=list(range(10))) == [0, 1, 2]


def test_probe_verdicts_name_the_engine_and_the_likely_cause():
    same = stats_of([-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0])
    assert judge_probe(1, URL, 4, "4", same, 0.01) is None
    version = judge_probe(1, URL, 4, "3", same, 0.01)
    assert f"engine 1 ({URL}) reports weight version '3', not '4'" in version and "did not reach it" in version
    off = stats_of([-1.0, -2.0, -3.0], [-1.3, -2.3, -3.3])  # 0.3 nats off
    message = judge_probe(1, URL, 4, "4", off, 0.01, previous=same)
    assert "sync of policy version 4 (before step 5): engine 1" in message and "= 0.3 nats" in message
    assert "previous weights (version 3): the weights did not arrive" in message
    assert "bucket skipped" in judge_probe(1, URL, 4, "4", off, 0.01, previous=off)
    garbage = stats_of([-1.0, -2.0, -3.0], [-9.0, -0.1, float("nan")])
    assert "wrong dtype" in judge_probe(0, URL, 4, "4", garbage, 0.01)
    assert judge_probe(1, URL, 4, "4", off, 0.5) is None  # within a bf16 limit


def test_step_mismatch_check():
    metrics = {"mismatch/age_0/logp_abs_mean": 0.2, "mismatch/age_0/logp_abs_max": 1.5,
               "mismatch/age_0/k3_kl": 0.03, "mismatch/age_0/tokens": 120.0}
    message = step_mismatch_failure(metrics, 0.01, step=1)
    assert message.startswith("step mismatch at step 1") and "= 0.2 nats" in message
    assert "> 0.01 (checks.step_max_abs_mean)" in message and "120 tokens" in message
    assert step_mismatch_failure(metrics, 0.5, step=1) is None
    assert step_mismatch_failure({}, 0.01, step=1) is None  # no engine log-probs: nothing to judge


def test_limits_follow_the_dtypes_unless_set():
    cpu = load_config([])
    assert resolve_limit(None, cpu, "float32") == FP32_MAX_ABS_MEAN
    assert resolve_limit(None, cpu, "bfloat16") == BF16_MAX_ABS_MEAN
    sglang = load_config(["rollout.backend=sglang"])  # auto: the checkpoint's dtype (bf16 for Qwen)
    assert resolve_limit(None, sglang, "float32") == BF16_MAX_ABS_MEAN
    assert resolve_limit(0.2, sglang, "float32") == 0.2
    for bad in ("checks.probe_tokens=1", "checks.probe_max_abs_mean=0", "checks.mismatch_age_buckets=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            validate_config(load_config([bad]))


FAULTS = {
    # fault: (overrides, engine named in the message, the check, words of the message)
    "skip_bucket": ((), 0, "weight checksum", "part of the weights did not arrive or arrived wrong"),
    "stale_engine": ((), 1, "weight checksum", "it kept the previous weights (the engine was left out"),
    # the probe, where the checksum is off (and for SGLang engines, whose layout it does not compare)
    "wrong_dtype": (("checks.checksum=false",), 0, "weight probe", "a tensor sent in the wrong dtype"),
}


def _run_broken(tmp_path, fault: str, overrides) -> subprocess.CompletedProcess:
    merged = dict(item.split("=", 1) for item in SMALL)
    merged.update({"trainer.total_steps": "1", "rollout.num_engines": "2"})
    merged.update(dict(item.split("=", 1) for item in overrides))
    cmd = [sys.executable, str(REPO / "tests" / "helpers" / "broken_sync.py"), fault,
           f"trainer.output_dir={tmp_path / fault}", *(f"{k}={v}" for k, v in merged.items())]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"})


def _rows(run_dir) -> list:
    rows = run_dir / RUN_NAME / "metrics.jsonl"
    return [json.loads(r) for r in rows.read_text().splitlines() if r.strip()] if rows.exists() else []


@pytest.mark.slow
def test_a_broken_weight_sync_stops_the_run_before_step_1(tmp_path):
    """Three runs of the tiny model (warm start, 2 engines), each with one sync defect: each
    stops at the sync before step 1, exit 1, naming the check, the engine and a likely cause."""
    for fault, (overrides, engine, check, cause) in FAULTS.items():
        proc = _run_broken(tmp_path, fault, overrides)
        assert proc.returncode == 1, f"{fault}: exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        line = [x for x in proc.stderr.splitlines() if x.startswith("dapo-mega: weight check failed:")]
        assert line, f"{fault}: no weight-check message\n{proc.stderr[-3000:]}"
        assert f"{check} after the sync of policy version 0 (before step 1)" in line[0], line[0]
        assert f": engine {engine} (http://127.0.0.1:" in line[0] and cause in line[0], (fault, line[0])
        assert not _rows(tmp_path / fault)  # the sync before step 1: no step's row to write


@pytest.mark.slow
def test_an_engine_left_on_the_previous_weights_stops_the_run_at_that_step(tmp_path):
    """Issue #37: at 32B and the paper's learning rate (1e-6) one step moves the probe's
    log-probs less than its 0.01 nats, so an engine that reports the new version and kept the
    previous weights passed. Scaled to the tiny model: lr 1e-8, at which one step moves its
    probe by less than the limit too (the run with the checksums off shows it). The checksums stop the run at
    step 1, naming engine 1 and its tensors, and step 1's row is in metrics.jsonl; with the
    checksums off the same run goes on."""
    # the engines keep a CPU copy of their weights while the learner trains (SGLang's
    # --enable-weights-cpu-backup): what is not sent again is the previous version, not zeros
    overrides = ("trainer.sft_warmup_steps=0", "algo.lr=1e-8", "algo.lr_warmup_steps=0",
                 "rollout.extra_server_args=[--enable-weights-cpu-backup]")
    proc = _run_broken(tmp_path, "stale_weights", overrides)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if x.startswith("dapo-mega: weight check failed:")]
    assert line and "weight checksum after the sync of policy version 1 (before step 2): engine 1 (" in line[0], \
        proc.stderr[-3000:]
    assert "model.embed_tokens.weight" in line[0] or "model.layers.0." in line[0], line[0]
    rows = _rows(tmp_path / "stale_weights")
    assert [r["step"] for r in rows] == [1] and rows[0]["check/weights_failed"] == 1.0, rows
    assert rows[0]["actor/grad_norm"] > 0
    unchecked = _run_broken(tmp_path / "off", "stale_weights", overrides + ("checks.checksum=false",))
    assert unchecked.returncode == 0, unchecked.stderr[-3000:]  # the probe alone does not see it
