"""One GPU: `dapo-mega train` of the tiny model with the bf16 learner on the GPU (issue 28 item 6).

`bench/gpu_node.py` runs it as check e (and `bench/gpu_moe.py`, check g, runs the same run on
the tiny Qwen3-MoE): 2 rollout steps of 4 prompts x 4 samples, megatron=gpu_bf16, the step-1
checks on (checks.*: driver/weight_probe.py). The run must exit 0 and its metrics.jsonl rows
carry `mismatch/age_0/logp_abs_mean` and `probe/logp_abs_mean` under the limits (bf16: 0.5
nats, weight_probe.BF16_MAX_ABS_MEAN) with no probe errors. Engine: SGLang colocated when
sglang imports, else the embedded engine, which runs on the CPU beside the GPU learner
(`placement.engine_uses_gpu`, in float32: `resolve_engine_dtype`) and gets its weights as
shared-memory files. Its pure pieces (the overrides, the judge) are tested on the CPU in
tests/bench/test_gpu_node.py.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]

STEPS = 2
"""Rollout steps of a check's run."""

TINY_GPU_OVERRIDES = (
    f"trainer.total_steps={STEPS}", "trainer.save_interval=0", "trainer.sft_warmup_steps=0",
    "trainer.eval_interval=0", "trainer.wandb_mode=disabled", "trainer.plot=false", "algo.n_samples_per_prompt=4",
    "algo.train_batch_size=4", "algo.gen_batch_size=4", "algo.mini_batch_size=2", "algo.dynamic_sampling=false",
    "algo.max_response_length=12", "algo.overlong_buffer_length=4", "megatron=gpu_bf16",
    "megatron.micro_batch_tokens=512", "cluster.device=cuda", "cluster.num_learner_processes=1",
    "checks.probe=true", "checks.stop=true",
)
"""A GPU run of the tiny model: 2 rollout steps of 4 prompts x 4 samples, bf16 learner."""

RUN_NAME = "gpu_node_tiny"


def train_overrides(engine: str, te_imports: bool, gpus: int, out_dir: str, engine_python: str = "") -> List[str]:
    """`dapo-mega train` overrides of check e for `engine` (sglang or embedded); `engine_python`:
    the SGLang venv's interpreter (rollout.engine_python; empty: the learner's Python)."""
    engine_args = (["rollout=sglang", "rollout.num_engines=1", "rollout.mem_fraction_static=0.3",
                    "rollout.extra_server_args=[--max-total-tokens,4096]"]
                   + ([f"rollout.engine_python={engine_python}"] if engine_python else []) if engine == "sglang"
                   else ["rollout=embedded", "rollout.num_engines=1"])
    return [*TINY_GPU_OVERRIDES, f"megatron.transformer_impl={'transformer_engine' if te_imports else 'local'}",
            f"cluster.gpus_per_node={gpus}", f"trainer.output_dir={out_dir}", f"trainer.run_name={RUN_NAME}",
            *engine_args]


def judge_train_metrics(rows: Sequence[Dict[str, Any]], steps: int, limit: float) -> Tuple[bool, str, Dict[str, float]]:
    """The step-1 checks of a finished run, from its metrics.jsonl rows: every step 1..steps has
    `mismatch/age_0/logp_abs_mean` <= limit, some row carries `probe/logp_abs_mean` and every
    such row is <= limit with `probe/errors` 0. Returns (passed, reason, the worst values)."""
    worst = {"mismatch/age_0/logp_abs_mean": float("-inf"), "probe/logp_abs_mean": float("-inf")}
    seen_steps, probes = set(), 0
    for row in rows:
        for key in worst:
            if key in row:
                value = float(row[key])
                if not value <= limit:  # NaN fails
                    return False, f"step {row.get('step')}: {key} = {value:.4g} > {limit:g} nats", {key: value}
                worst[key] = max(worst[key], value)
        if "mismatch/age_0/logp_abs_mean" in row and "step" in row:
            seen_steps.add(int(row["step"]))
        if "probe/logp_abs_mean" in row:
            probes += 1
            if float(row.get("probe/errors", 0.0)) != 0.0:
                return False, f"step {row.get('step')}: probe/errors = {row['probe/errors']}", {}
    missing = sorted(set(range(1, steps + 1)) - seen_steps)
    if missing:
        return False, f"no mismatch/age_0/logp_abs_mean for steps {missing} in metrics.jsonl", {}
    if probes == 0:
        return False, "no probe/logp_abs_mean in metrics.jsonl: the post-sync probe did not run", {}
    return True, "", worst


def gpu_settings() -> Tuple[bool, int]:
    """(Transformer Engine imports, GPUs): what a run's overrides depend on here."""
    import torch

    from dapo_mega.backends.megatron.model import transformer_engine_import_error

    return transformer_engine_import_error() is None, torch.cuda.device_count()


def run_train(overrides: Sequence[str], timeout_s: float, env: Dict[str, str]) -> Optional[Dict[str, Any]]:
    """`dapo-mega train OVERRIDES` in a fresh process: None when it exited 0, else a failed
    check's {passed, reason, log_tail} (gpu_node's verdict adds the log's telling line)."""
    try:
        proc = subprocess.run([sys.executable, "-m", "dapo_mega.cli", "train", *overrides], capture_output=True,
                              text=True, timeout=timeout_s, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        return {"passed": False, "reason": f"dapo-mega train: no exit within {timeout_s:.0f} s",
                "log_tail": stderr[-3000:]}
    if proc.returncode != 0:
        return {"passed": False, "returncode": proc.returncode, "reason": f"dapo-mega train: exit {proc.returncode}",
                "log_tail": (proc.stdout + proc.stderr)[-3000:]}
    return None


def check_train_tiny(engine: str, engine_python: Optional[str], timeout_s: float, env: Dict[str, str]
                     ) -> Dict[str, Any]:
    """e) two steps of the tiny model in bf16 on the GPU; the run's own checks and the rows.
    `engine`: sglang, embedded or auto (sglang when `engine_python`, the interpreter SGLang
    imports in, is given)."""
    from dapo_mega.driver.weight_probe import BF16_MAX_ABS_MEAN
    from dapo_mega.records.metrics import read_metrics

    if engine == "auto":
        engine = "sglang" if engine_python is not None else "embedded"
    te_imports, gpus = gpu_settings()
    with tempfile.TemporaryDirectory(prefix="gpu_node_train_") as tmp:
        overrides = train_overrides(engine, te_imports, gpus, tmp,
                                    engine_python=engine_python if engine_python and engine_python != sys.executable
                                    else "")
        failed = run_train(overrides, timeout_s, env)
        rows = read_metrics(Path(tmp) / RUN_NAME)
    out: Dict[str, Any] = {"engine": engine, "overrides": overrides, "metric_rows": len(rows)}
    if failed is not None:
        return {**out, **failed, "reason": f"{failed['reason']} ({engine} engine)"}
    ok, reason, worst = judge_train_metrics(rows, steps=STEPS, limit=BF16_MAX_ABS_MEAN)
    return {**out, "passed": ok, "reason": reason, "worst": worst}
