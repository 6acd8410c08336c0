"""One GPU: a tiny Qwen3-MoE learner step and its routed-expert reports (issue #46 item 5).

Check e's run (`bench/gpu_train.py`: `dapo-mega train`, bf16 learner on the GPU, 2 steps of 4
prompts x 4 samples, dynamic sampling off, the step-1 checks on) on the tiny Qwen3-MoE, every
layer sparse as Qwen3-30B-A3B (model.tiny_moe_dense_layers=[]: 8 experts, 2 per token), after
a short warm start (50 supervised steps, the routing-replay ablation's quick one: the routes
are a trained router's), with routing replay (algo.routing_replay) and the ledger keeping each
sample's experts (trainer.ledger_routed_experts). The embedded engine runs on the CPU beside the
GPU learner, in float32, and reports the experts it routed each token to (the fleet passes
--enable-return-routed-experts for a mixture). It passes when the run exits 0 and

* every step's metrics.jsonl row has `moe/unreported_samples` 0, `moe/router_choices_compared`
  > 0, `moe/routing_replay` 1 and a finite `moe/router_agreement` >= MIN_ROUTER_AGREEMENT, and
  the log-prob mismatch and the post-sync probe are under check e's bf16 limit;
* every ledger row carries its experts, which decode (`decode_routed_experts`) to positions >
  its response length, expert ids < num_experts, and k distinct experts per token and layer.

What it exercises: routed-expert reports used to ride in the pickled sample broadcast; now the
driver hands each data-parallel rank its share as one packed shard over a gloo group and the
samples travel on a gloo group (driver/expert_handover.py, backends/megatron/expert_shards.py,
distributed.host_group). On a GPU the learner's default group is NCCL: this check is where the
gloo host group is first made beside it, and where the reports first reach a CUDA router
(`routing.RouterWatch`, replay). One GPU allows world size 1 (DP 1) only (NCCL refuses two
ranks on one GPU): there the driver's samples keep their reports (`ExpertHandOver.build` is
None for one process) and the learner packs its shard from them in-process
(`RoutedExperts.of_samples`, the same format); the shards' gloo point-to-point and broadcast
between ranks need 2 GPUs (2 learner processes), and are tested on the CPU at EP 2
(tests/trainer/test_train_moe.py, tests/driver/).

`bench/gpu_node.py` runs it as check g; alone, on a node with one GPU:

    python bench/gpu_node.py --part train_moe_bf16

Its pure pieces (the overrides, the judges of metrics rows and ledger rows) are tested on the
CPU in tests/bench/test_gpu_moe.py, and its run with the CPU learner too.
"""

from __future__ import annotations

import base64
import binascii
import math
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gpu_train import STEPS, gpu_settings, judge_train_metrics, run_train, train_overrides

RUN_NAME = "gpu_node_moe"
WARM_START_STEPS = 50
"""Supervised steps before RL step 1 (11 s of the CPU learner, less on a GPU)."""

MOE_OVERRIDES = (
    "model.tiny_architecture=qwen3_moe", "model.name=tiny-qwen3-moe", "model.tiny_moe_dense_layers=[]",
    "algo.routing_replay=true", "trainer.ledger_routed_experts=true",
    f"trainer.sft_warmup_steps={WARM_START_STEPS}", f"trainer.run_name={RUN_NAME}",
)
"""What check g adds to check e's run with the embedded engine (later overrides win)."""

MIN_ROUTER_AGREEMENT = 0.9
"""The least share of the engine's token-expert choices the bf16 learner's own router must make
too. The two sides route alike but for tokens near a tie between experts, which precision moves:
bf16 engine weights beside the fp32 learner agree on 0.993-1.0 of the choices of this run on the
CPU (0.997 in docs/ablations.md, 400-step warm start); the bf16 learner rounds its activations
too, a larger gap, for which this bound leaves over 10x the room. A report handed to the wrong sample
or token agrees by chance only: k / num_experts = 2/8 = 0.25."""

EXPERT_BYTES = {"u8": 1, "u16": 2}
"""Bytes of an expert id in a report's compact form (`rollout.samples.compact_routed_experts`);
SGLang's own form (no prefix) is int32."""


def moe_train_overrides(te_imports: bool, gpus: int, out_dir: str) -> List[str]:
    """`dapo-mega train` overrides of check g: check e's with the embedded engine, and the MoE's."""
    return [*train_overrides("embedded", te_imports, gpus, out_dir), *MOE_OVERRIDES]


def judge_moe_metrics(rows: Sequence[Dict[str, Any]], steps: int, min_agreement: float
                      ) -> Tuple[bool, str, List[float]]:
    """A mixture's routing in each step 1..steps, from metrics.jsonl rows (module docstring).
    Returns (passed, reason, each step's moe/router_agreement)."""
    by_step = {int(r["step"]): r for r in rows if "moe/router_agreement" in r and "step" in r}
    missing = sorted(set(range(1, steps + 1)) - set(by_step))
    if missing:
        return False, f"no moe/router_agreement for steps {missing} in metrics.jsonl: the learner saw no mixture", []
    agreements = []
    for step in range(1, steps + 1):
        row = by_step[step]
        unreported = float(row.get("moe/unreported_samples", math.nan))
        compared = float(row.get("moe/router_choices_compared", 0.0))
        agreement = float(row["moe/router_agreement"] if row["moe/router_agreement"] is not None else math.nan)
        if unreported != 0.0:
            return False, (f"step {step}: moe/unreported_samples = {unreported:g}: the learner lacked samples' "
                           "experts"), agreements
        if not compared > 0:
            return False, f"step {step}: moe/router_choices_compared = {compared:g}: nothing compared", agreements
        if float(row.get("moe/routing_replay", 0.0)) != 1.0:
            return False, f"step {step}: moe/routing_replay = {row.get('moe/routing_replay')}, not 1", agreements
        if not (math.isfinite(agreement) and agreement >= min_agreement):
            return False, (f"step {step}: moe/router_agreement = {agreement:.4g} < {min_agreement:g} over "
                           f"{compared:.0f} choices"), agreements
        agreements.append(agreement)
    return True, "", agreements


def report_positions(data: str, num_layers: int, top_k: int) -> int:
    """Positions a report holds, from its byte count (-1 when that is no whole number of them)."""
    kind, sep, body = data.partition(":")
    itemsize = EXPERT_BYTES.get(kind, 0) if sep else 4
    try:
        size = len(base64.b64decode(body if sep else data, validate=True))
    except (binascii.Error, ValueError):
        return -1
    per_position = itemsize * num_layers * top_k
    return size // per_position if itemsize and size and size % per_position == 0 else -1


def judge_ledger_experts(rows: Sequence[Dict[str, Any]], num_layers: int, top_k: int, num_experts: int,
                         sparse_layers: Sequence[int]) -> Tuple[bool, str, Dict[str, Any]]:
    """The ledger's routed experts (module docstring), from its rows (`read_ledger(...).to_pylist()`).
    Returns (passed, reason, figures: rows, positions range, experts seen)."""
    from dapo_mega.backends.megatron.routing import decode_routed_experts

    if not rows:
        return False, "the ledger has no rows", {}
    positions_seen, experts_seen = [], set()
    for row in rows:
        where = f"ledger step {row.get('step')} sample {row.get('prompt_id')}/{row.get('sample_index')}"
        data: Optional[str] = row.get("routed_experts")
        if not data:
            return False, f"{where}: no routed_experts", {}
        positions = report_positions(data, num_layers, top_k)
        experts = decode_routed_experts(data, positions, num_layers, top_k)
        if experts is None:
            return False, f"{where}: routed_experts is no [positions, {num_layers}, {top_k}] report", {}
        if positions <= int(row["response_length"]):
            return False, f"{where}: {positions} positions, not more than its {row['response_length']} response tokens", {}
        if int(experts.max()) >= num_experts:
            return False, f"{where}: expert id {int(experts.max())} >= num_experts {num_experts}", {}
        sparse = experts[:, list(sparse_layers)].reshape(-1, top_k)
        if any(len(set(choice)) != top_k for choice in sparse.tolist()):
            return False, f"{where}: a token routed to the same expert twice in one layer", {}
        positions_seen.append(positions)
        experts_seen.update(int(e) for e in sparse.reshape(-1).tolist())
    return True, "", {"rows": len(rows), "positions": [min(positions_seen), max(positions_seen)],
                      "experts_seen": len(experts_seen)}


def check_train_moe(timeout_s: float, env: Dict[str, str], extra_overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """g) two steps of the tiny Qwen3-MoE in bf16 on the GPU; its routing metrics and ledger.
    `extra_overrides` go last (they win): the CPU test's learner (megatron=cpu, cluster.device=cpu)."""
    from dapo_mega.driver.weight_probe import BF16_MAX_ABS_MEAN
    from dapo_mega.models.shape import ModelShape
    from dapo_mega.records.ledger import read_ledger
    from dapo_mega.records.metrics import read_metrics

    te_imports, gpus = gpu_settings()
    with tempfile.TemporaryDirectory(prefix="gpu_node_moe_") as tmp:
        overrides = [*moe_train_overrides(te_imports, gpus, tmp), *extra_overrides]
        failed = run_train(overrides, timeout_s, env)
        run_dir = Path(tmp) / RUN_NAME
        rows = read_metrics(run_dir)
        out: Dict[str, Any] = {"engine": "embedded", "overrides": overrides, "metric_rows": len(rows)}
        if failed is not None:
            return {**out, **failed}
        ledger = read_ledger(run_dir).to_pylist()
        shape = ModelShape.from_hf_config(str(run_dir / "base_model"))  # the model the run trained
    ok, reason, agreements = judge_moe_metrics(rows, STEPS, MIN_ROUTER_AGREEMENT)
    out["router_agreement"] = agreements
    if ok:
        ok, reason, worst = judge_train_metrics(rows, steps=STEPS, limit=BF16_MAX_ABS_MEAN)
        out["worst"] = worst
    if ok:
        sparse = [i for i in range(shape.num_layers) if shape.is_sparse_layer(i)]
        ok, reason, out["ledger"] = judge_ledger_experts(ledger, shape.num_layers, shape.num_experts_per_tok,
                                                         shape.num_experts, sparse)
    out.update(passed=ok, reason=reason)
    if ok:
        out["note"] = (f"router agreement {', '.join(f'{a:.4f}' for a in agreements)} (>= {MIN_ROUTER_AGREEMENT:g}); "
                       "world 1: no shard crossed gloo between ranks (that needs 2 GPUs)")
    return out
