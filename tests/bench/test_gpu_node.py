"""bench/gpu_node.py's pure pieces on the CPU: the part list, the budget, the verdicts, the
table, the refusal and metrics judges (check e's: bench/gpu_train.py), and the order of a run
with the parts faked. Check g's pieces: test_gpu_moe.py."""

import argparse
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_node  # noqa: E402
import gpu_train  # noqa: E402


def test_the_checks_come_first_in_the_issues_order_and_each_part_has_a_function():
    names = [p.name for p in gpu_node.PARTS]
    checks = [p.name for p in gpu_node.PARTS if p.kind == "check"]
    assert checks == ["convert_gpu", "convert_tp2", "eval_two_engines", "handover_sglang", "train_tiny_bf16",
                      "nccl_loaded", "train_moe_bf16"]  # f, g: issue #46
    assert names[:7] == checks and len(set(names)) == len(names)
    assert set(names) == set(gpu_node.PART_FUNCTIONS)
    assert {p.kind for p in gpu_node.PARTS} == {"check", "measure"}
    assert gpu_node.parse_args([]).budget_s <= 600  # the one call fits in 10 minutes


def test_budget_clips_checks_and_skips_measurements_that_no_longer_fit():
    check = gpu_node.Part("c", "check", 200, "")
    measure = gpu_node.Part("m", "measure", 240, "")
    assert gpu_node.part_timeout(check, 500) == (200, "")
    assert gpu_node.part_timeout(check, 90) == (90, "")
    timeout, why = gpu_node.part_timeout(check, gpu_node.MIN_CHECK_S - 1)
    assert timeout is None and "--budget-s" in why
    assert gpu_node.part_timeout(measure, 240) == (240, "")
    timeout, why = gpu_node.part_timeout(measure, 239)
    assert timeout is None and "239 s left" in why and "240 s" in why


@pytest.mark.parametrize("result,expected", [
    ({"kind": "check", "skipped": "no TE"}, ("skipped", "no TE")),
    ({"kind": "check", "error": "Traceback ...\n  File x\nValueError: bad\n"}, ("fail", "ValueError: bad")),
    ({"kind": "check", "passed": False, "reason": "verify: exit 1"}, ("fail", "verify: exit 1")),
    ({"kind": "check", "passed": False, "reason": "dapo-mega train: exit 1 (embedded engine)",
      "log_tail": "[trainer] step 1\nTraceback ...\nRuntimeError: gloo\n  raised here\n"},
     ("fail", "dapo-mega train: exit 1 (embedded engine): RuntimeError: gloo")),
    ({"kind": "check", "passed": True, "note": "SGLang half skipped"}, ("pass", "SGLang half skipped")),
    ({"kind": "check"}, ("fail", "the check returned no verdict")),
    ({"kind": "measure", "gbps": 3.0}, ("pass", "")),
])
def test_verdict(result, expected):
    assert gpu_node.verdict(result) == expected


def test_table_has_one_row_per_part_with_its_reason_and_the_exit_code_follows_failures():
    rows = [("convert_gpu", "pass", 41.2, ""), ("convert_tp2", "fail", 12.0, "exit 1, not 2"),
            ("sglang", "skipped", None, "sglang does not import")]
    text = gpu_node.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["part", "verdict", "seconds", "reason"] and set(lines[1]) == {"-"}
    assert lines[2].split() == ["convert_gpu", "PASS", "41"]
    assert lines[3].split()[:3] == ["convert_tp2", "FAIL", "12"] and lines[3].endswith("exit 1, not 2")
    assert lines[4].split()[:3] == ["sglang", "SKIPPED", "-"] and lines[4].endswith("sglang does not import")
    assert gpu_node.exit_code(rows) == 1 and gpu_node.exit_code([rows[0], rows[2]]) == 0


def test_a_run_keeps_going_after_a_failure_and_spends_its_budget_on_checks_first(monkeypatch):
    now = [0.0]
    ran = []

    def fake_run(name, argv, timeout):
        ran.append((name, timeout))
        now[0] += 80.0  # every part takes 80 s
        return {"error": "exit 1: RuntimeError: boom"} if name == "convert_gpu" else {"passed": True}

    monkeypatch.setattr(gpu_node, "_run_part", fake_run)
    args = gpu_node.parse_args(["--budget-s", "570"])
    results = gpu_node.run_parts(args, [], te_error="No module named 'transformer_engine'", sglang=False,
                                 clock=lambda: now[0])
    # every check ran although the first failed; after them no time is left: no measurement fits
    assert [n for n, _ in ran] == ["convert_gpu", "convert_tp2", "eval_two_engines", "handover_sglang",
                                   "train_tiny_bf16", "nccl_loaded", "train_moe_bf16"]
    assert ran[5] == ("nccl_loaded", 170.0) and ran[6] == ("train_moe_bf16", 90.0)  # clipped to what was left
    verdicts = {n: gpu_node.verdict(r) for n, r in results.items()}
    assert verdicts["convert_gpu"] == ("fail", "exit 1: RuntimeError: boom")
    assert "transformer_engine" in verdicts["learner_fp8"][1] and verdicts["learner_fp8"][0] == "skipped"
    assert verdicts["sglang"] == ("skipped", "sglang does not import: no weight sync into SGLang, no rollout tokens/s")
    assert verdicts["learner_bf16"][0] == "skipped" and "--budget-s" in verdicts["learner_bf16"][1]
    assert [r[0] for r in gpu_node.table_rows(results)] == [p.name for p in gpu_node.PARTS]

    ran.clear()
    now[0] = 0.0
    gpu_node.run_parts(gpu_node.parse_args(["--checks-only", "--budget-s", "5000"]), [], None, True,
                       clock=lambda: now[0])
    assert [n for n, _ in ran] == [p.name for p in gpu_node.PARTS if p.kind == "check"]


def test_the_refusal_judge_accepts_the_real_tools_one_line_refusal(tmp_path):
    from dapo_mega.models.tiny import build_tiny_model_dir

    hf = build_tiny_model_dir(tmp_path / "hf")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "import", "--hf-path",
                           str(hf), "--megatron-path", str(tmp_path / "mg"), "--tp", "2", "--device", "cuda"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    ok, line = gpu_node.judge_refusal(proc.returncode, proc.stderr, ["need 2 GPUs", "has 0"])
    assert ok, line
    assert line.startswith("error: conversion --device cuda")


@pytest.mark.parametrize("rc,stderr,why", [
    (1, "error: need 2 GPUs, which has 1. Fix: x", "exit 1, not 2"),
    (2, "Traceback (most recent call last):\nerror: need 2 GPUs, which has 1. Fix: x", "traceback"),
    (2, "error: need 2 GPUs, which has 1. Fix: x\nerror: again", "2 'error:' lines"),
    (2, "error: need 2 GPUs, which has 1.", "does not say ['Fix:']"),
])
def test_the_refusal_judge_rejects_what_is_not_a_one_line_refusal(rc, stderr, why):
    ok, reason = gpu_node.judge_refusal(rc, stderr, ["need 2 GPUs", "has 1"])
    assert not ok and why in reason


def _rows(mismatch=(0.02, 0.03), probe=(0.01, 0.02), errors=0.0):
    rows = [{"step": s, "mismatch/age_0/logp_abs_mean": m} for s, m in zip((1, 2), mismatch)]
    for row, p in zip(rows, probe):
        if p is not None:
            row.update({"probe/logp_abs_mean": p, "probe/errors": errors})
    return rows


def test_train_metrics_judge():
    ok, reason, worst = gpu_train.judge_train_metrics(_rows(), steps=2, limit=0.5)
    assert ok and reason == "" and worst == {"mismatch/age_0/logp_abs_mean": 0.03, "probe/logp_abs_mean": 0.02}
    ok, reason, _ = gpu_train.judge_train_metrics(_rows(mismatch=(0.02, 3.1)), 2, 0.5)
    assert not ok and reason == "step 2: mismatch/age_0/logp_abs_mean = 3.1 > 0.5 nats"
    ok, reason, _ = gpu_train.judge_train_metrics(_rows(probe=(math.nan, 0.01)), 2, 0.5)
    assert not ok and "probe/logp_abs_mean = nan" in reason
    ok, reason, _ = gpu_train.judge_train_metrics(_rows()[:1], 2, 0.5)
    assert not ok and "steps [2]" in reason
    ok, reason, _ = gpu_train.judge_train_metrics(_rows(probe=(None, None)), 2, 0.5)
    assert not ok and "probe did not run" in reason
    ok, reason, _ = gpu_train.judge_train_metrics(_rows(errors=1.0), 2, 0.5)
    assert not ok and "probe/errors" in reason


@pytest.mark.parametrize("engine", ["embedded", "sglang"])
def test_the_train_overrides_compose_into_a_bf16_gpu_run_checked_at_the_bf16_limit(engine, tmp_path):
    from dapo_mega.config import load_config
    from dapo_mega.driver.weight_probe import BF16_MAX_ABS_MEAN, resolve_limit

    cfg = load_config(gpu_train.train_overrides(engine, te_imports=False, gpus=1, out_dir=str(tmp_path)))
    assert (cfg.megatron.params_dtype, cfg.megatron.transformer_impl, cfg.cluster.device) == ("bf16", "local", "cuda")
    assert cfg.trainer.total_steps == 2 and cfg.rollout.backend == engine and cfg.rollout.num_engines == 1
    assert cfg.checks.probe and cfg.checks.stop and cfg.run_dir == tmp_path / "gpu_node_tiny"
    # the judge's limit is the one the run itself stops at
    assert resolve_limit(cfg.checks.probe_max_abs_mean, cfg, "bfloat16") == BF16_MAX_ABS_MEAN


def test_without_a_gpu_it_exits_saying_so():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_node.py")], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout


def test_part_function_flags_parse():
    args = gpu_node.parse_args(["--train-engine", "embedded", "--budget-s", "100"])
    assert isinstance(args, argparse.Namespace) and args.train_engine == "embedded" and args.budget_s == 100


LEARNER_TIMING = """
import json, random, sys
sys.path.insert(0, sys.argv[1])
import gpu_node
from dapo_mega.algo.train_sample import TrainSample
from dapo_mega.config import DapoConfig
from dapo_mega.models.tiny import tiny_hf_config
cfg = DapoConfig()
cfg.model.tiny_num_layers = 2
cfg.megatron.micro_batch_tokens = 64
cfg.algo.lr_warmup_steps = 0
hf = tiny_hf_config(cfg.model)
rng = random.Random(0)
samples = [TrainSample(prompt_ids=[rng.randrange(3, 90) for _ in range(6)],
                       response_ids=[rng.randrange(3, 90) for _ in range(10)], advantage=(-1) ** i) for i in range(4)]
out = gpu_node.time_learner_updates(cfg, hf, samples, 2, impl="local", fp8=False)
print(json.dumps(out))
"""


def test_the_learner_measurement_runs_its_updates_here_on_the_cpu():
    """learner_bf16's timing (the part that broke on the first GPU run: a lost import) through
    the real learner, at world size 1 on the CPU."""
    proc = subprocess.run([sys.executable, "-c", LEARNER_TIMING, str(REPO / "bench")], capture_output=True,
                          text=True, timeout=240, cwd=REPO, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["update_seconds"]) == 2 and all(s > 0 for s in out["update_seconds"])
    assert out["seconds"] == pytest.approx(sum(out["update_seconds"]))
    assert out["layer_spec"] == "local" and out["micro_batches"] >= 1 and out["computed_tokens"] >= 4 * 16, out


def test_sglang_runs_from_its_own_venv_as_the_docs_install_it(tmp_path, monkeypatch):
    """Issue #37 item 5: the SGLang parts use `--sglang-python` (the venv of docs/cluster.md),
    not the learner's Python: check e's run gets it as rollout.engine_python (and so its NCCL
    preflight), the server and the hand-over receiver run in it. An interpreter without sglang
    is passed over (the learner's Python, where sglang imports, else none: parts skipped)."""
    from sglang_venv import sglang_python_or_skip

    from dapo_mega.config import load_config

    venv = str(sglang_python_or_skip())
    args = gpu_node.parse_args(["--sglang-python", venv])
    assert gpu_node.sglang_python(args) == venv
    monkeypatch.delenv("DAPO_MEGA_SGLANG_PYTHON", raising=False)
    assert gpu_node.parse_args([]).sglang_python == ""
    import dapo_mega.plan.preflight as preflight

    has = {venv}  # which interpreters find sglang (in the full suite a stand-in may be importable here)
    monkeypatch.setattr(preflight, "python_has_sglang", lambda python: python in has)
    assert gpu_node.sglang_python(gpu_node.parse_args(["--sglang-python", "/no/such/python"])) is None
    has.add(sys.executable)
    assert gpu_node.sglang_python(gpu_node.parse_args(["--sglang-python", "/no/such/python"])) == sys.executable
    cfg = load_config(gpu_train.train_overrides("sglang", te_imports=False, gpus=1, out_dir=str(tmp_path),
                                               engine_python=venv))
    assert cfg.rollout.engine_python == venv and cfg.rollout.backend == "sglang"
