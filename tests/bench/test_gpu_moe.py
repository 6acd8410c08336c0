"""bench/gpu_moe.py (bench/gpu_node.py check g, issue #46 item 5) on the CPU: the overrides, the
judges of metrics rows and ledger rows against hand-made rows (and rows that must fail), and
the check itself with the CPU learner in place of the bf16 GPU one."""

import base64
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_moe  # noqa: E402

LAYERS, TOP_K, EXPERTS = 2, 2, 8


def test_the_overrides_compose_into_check_es_run_on_a_sparse_mixture_with_replay(tmp_path):
    from dapo_mega.config import load_config
    from dapo_mega.engines.sglang.commands import resolve_engine_dtype
    from dapo_mega.models.shape import ModelShape
    from dapo_mega.models.tiny import tiny_hf_config

    cfg = load_config(gpu_moe.moe_train_overrides(te_imports=False, gpus=1, out_dir=str(tmp_path)))
    assert (cfg.model.tiny_architecture, cfg.model.tiny_moe_dense_layers) == ("qwen3_moe", [])
    assert cfg.algo.routing_replay and cfg.trainer.ledger_routed_experts and not cfg.algo.dynamic_sampling
    assert cfg.trainer.total_steps == gpu_moe.STEPS == 2 and cfg.trainer.sft_warmup_steps == gpu_moe.WARM_START_STEPS
    assert (cfg.megatron.params_dtype, cfg.cluster.device, cfg.cluster.num_learner_processes) == ("bf16", "cuda", 1)
    assert cfg.rollout.backend == "embedded" and resolve_engine_dtype(cfg.rollout.dtype, "embedded") == "float32"
    assert cfg.checks.probe and cfg.run_dir == tmp_path / "gpu_node_moe"
    shape = ModelShape.from_hf_config(tiny_hf_config(cfg.model))
    assert all(shape.is_sparse_layer(i) for i in range(shape.num_layers))  # every layer sparse
    assert (shape.num_layers, shape.num_experts_per_tok, shape.num_experts) == (LAYERS, TOP_K, EXPERTS)


def _metrics(**change):
    rows = [{"step": s, "moe/router_agreement": a, "moe/router_choices_compared": 1200.0,
             "moe/unreported_samples": 0.0, "moe/routing_replay": 1.0} for s, a in ((1, 0.998), (2, 0.9931))]
    rows[1].update(change)
    return [{"step": 0, "eval/avg_at_k": 0.1}, *rows]


def test_the_metrics_judge_passes_every_step_routed_and_compared():
    assert gpu_moe.judge_moe_metrics(_metrics(), 2, 0.9) == (True, "", [0.998, 0.9931])


@pytest.mark.parametrize("change,said", [
    ({"moe/unreported_samples": 1.0}, "step 2: moe/unreported_samples = 1"),
    ({"moe/router_choices_compared": 0.0}, "step 2: moe/router_choices_compared = 0"),
    ({"moe/router_agreement": math.nan}, "step 2: moe/router_agreement = nan"),
    ({"moe/router_agreement": None}, "step 2: moe/router_agreement = nan"),  # NaN as json.dumps writes it
    ({"moe/router_agreement": 0.25}, "step 2: moe/router_agreement = 0.25 < 0.9 over 1200 choices"),  # chance
    ({"moe/routing_replay": 0.0}, "step 2: moe/routing_replay = 0.0, not 1"),
    ({"step": 3}, "no moe/router_agreement for steps [2]"),
])
def test_the_metrics_judge_fails_a_step_that_lacks_experts_or_disagrees(change, said):
    ok, reason, _ = gpu_moe.judge_moe_metrics(_metrics(**change), 2, 0.9)
    assert not ok and reason.startswith(said), reason


def _report(experts: np.ndarray, compact: bool = True) -> str:
    """An engine's report of [positions, layers, top_k] experts: SGLang's int32 base64, or as a
    sample (and the ledger) keeps it."""
    from dapo_mega.rollout.samples import compact_routed_experts

    sglang = base64.b64encode(experts.astype(np.int32).tobytes()).decode()
    return compact_routed_experts(sglang) if compact else sglang


def _routes(positions: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(LAYERS)] for _ in range(positions)])


def _ledger(**change):
    rows = [{"step": 1, "prompt_id": "p0", "sample_index": j, "response_length": 5,
             "routed_experts": _report(_routes(20, seed=j))} for j in range(3)]
    rows.append({"step": 2, "prompt_id": "p1", "sample_index": 0, "response_length": 7,
                 "routed_experts": _report(_routes(24, seed=9), compact=False)})  # SGLang's own form decodes too
    rows[1].update(change)
    return rows


def _judge_ledger(rows):
    return gpu_moe.judge_ledger_experts(rows, LAYERS, TOP_K, EXPERTS, sparse_layers=range(LAYERS))


def test_the_ledger_judge_decodes_every_rows_experts():
    ok, reason, figures = _judge_ledger(_ledger())
    assert ok and reason == "", reason
    assert figures["rows"] == 4 and figures["positions"] == [20, 24] and figures["experts_seen"] == EXPERTS


def test_a_reports_positions_are_read_from_its_bytes():
    routes = _routes(6)
    assert gpu_moe.report_positions(_report(routes), LAYERS, TOP_K) == 6
    assert gpu_moe.report_positions(_report(routes, compact=False), LAYERS, TOP_K) == 6
    u16 = "u16:" + base64.b64encode(routes.astype(np.uint16).tobytes()).decode()
    assert gpu_moe.report_positions(u16, LAYERS, TOP_K) == 6
    assert gpu_moe.report_positions(_report(routes), LAYERS, 5) == -1  # not whole positions of another shape
    assert gpu_moe.report_positions("u8:not base64!", LAYERS, TOP_K) == -1
    assert gpu_moe.report_positions("i4:" + _report(routes)[3:], LAYERS, TOP_K) == -1  # an unknown form


@pytest.mark.parametrize("change,said", [
    ({"routed_experts": None}, "ledger step 1 sample p0/1: no routed_experts"),
    ({"routed_experts": _report(_routes(20))[:-8]}, "is no [positions, 2, 2] report"),
    ({"response_length": 20}, "20 positions, not more than its 20 response tokens"),  # no prompt in it
    ({"routed_experts": _report(_routes(20) + 1)}, "expert id 8 >= num_experts 8"),
    ({"routed_experts": _report(np.zeros((20, LAYERS, TOP_K)))}, "routed to the same expert twice"),
])
def test_the_ledger_judge_fails_a_row_whose_experts_do_not_decode_to_its_sample(change, said):
    ok, reason, _ = _judge_ledger(_ledger(**change))
    assert not ok and said in reason, reason


def test_the_ledger_judge_fails_an_empty_ledger():
    assert _judge_ledger([])[:2] == (False, "the ledger has no rows")


def test_the_checks_run_passes_here_with_the_cpu_learner():
    """Check g as the GPU node runs it, with megatron=cpu / cluster.device=cpu in place of the bf16
    GPU learner (fp32 both sides): the overrides start a run (35 s here on 2 cores: a 50-step
    warm start, 2 steps) whose metrics and ledger the judges pass."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    t0 = time.perf_counter()
    out = gpu_moe.check_train_moe(240, env, extra_overrides=("megatron=cpu", "cluster.device=cpu"))
    assert out["passed"], {k: v for k, v in out.items() if k != "overrides"}
    assert out["router_agreement"] == [1.0, 1.0] and out["metric_rows"] == 2  # fp32 learner, fp32 engine
    assert out["ledger"]["rows"] == 2 * 4 * 4 and out["ledger"]["positions"][0] > 1
    assert out["worst"]["mismatch/age_0/logp_abs_mean"] < 1e-3
    print(f"check g on the CPU: {time.perf_counter() - t0:.0f} s, {out['ledger']}, note: {out['note']}")
