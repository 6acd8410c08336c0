"""The twins run (configs/twin/, held to "sizes only" by tests/launch/test_twins.py): each through its
recipe's launch path on the local two-node Slurm cluster, the one the pipeline's training links
submit (`slurm/<mode>.sbatch +experiment=X`, a heterogeneous job when disaggregated), learners that
attach to real SGLang 0.5.23 CPU servers through the job's engine registry, for 2 steps; each
asserts the recipe's step-1 alarms and metrics (the weights check, the mismatch, and what its
feature must show: router agreement for the mixture of experts).

These replace the Slurm and real-SGLang tests they cover (the trainer-started MoE run on SGLang,
the heterogeneous SGLang job of tests/launch/test_slurm_jobs.py), so the lane's time does not grow.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from sglang_venv import sglang_python_or_skip

from dapo_mega.config import load_config
from dapo_mega.distributed import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.sglang]

REPO = Path(__file__).resolve().parents[2]
TWIN_JOB_TIMEOUT_S = 1500
"""A bound, not a timed claim: two SGLang servers start beside four learner ranks on 2 shared cores."""
JOB_MEM = "--mem=6000"


def twin_job_args(experiment: str) -> Tuple[List[str], Dict[str, str], str]:
    """(sbatch node options, the job's environment, the batch script) of a twin's training job,
    as launch/pipeline_stages.py's training link builds them from the config: the nodes (learner
    nodes : engine nodes, heterogeneous, when disaggregated) and the learner tasks per node."""
    cfg = load_config([f"+experiment={experiment}", f"+twin={experiment}"])
    c = cfg.cluster
    if c.mode == "disaggregated":
        nodes = [f"--nodes={c.num_nodes - c.engine_nodes}", JOB_MEM, ":", f"--nodes={c.engine_nodes}", JOB_MEM]
    else:
        nodes = [f"--nodes={c.num_nodes}", JOB_MEM]
    env = {"LEARNERS_PER_NODE": str(c.gpus_per_node), "MASTER_PORT": str(free_port()), "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1"}
    return nodes, env, f"slurm/{c.mode}.sbatch"


WARM_START_STEPS = 200
"""Supervised steps of the twin's tiny model in one process before its job (~20 s here), so that
its groups are mixed (~0.2 accuracy) and dynamic sampling fills the batch; the same warm start
inside the job, on 4 ranks of 2 shared cores, took ~1.4 s a step."""


def warm_model(experiment: str, out: Path) -> Path:
    """The twin's tiny model, warm-started in one process and exported to HF (the recipe itself
    starts from a pretrained HF checkpoint): the twin's model, task, prompt format and lengths."""
    from helpers.training import QUIET_RECORDS, run_cli

    cfg = load_config([f"+experiment={experiment}", f"+twin={experiment}"])
    m, d, a, r = cfg.model, cfg.data, cfg.algo, cfg.rollout
    dense = "null" if m.tiny_moe_dense_layers is None else f"[{','.join(map(str, m.tiny_moe_dense_layers))}]"
    overrides = [f"model.tiny_architecture={m.tiny_architecture}", f"model.tiny_chat_template={str(m.tiny_chat_template).lower()}",
                 f"model.tiny_moe_dense_layers={dense}", f"data.synthetic_task={d.synthetic_task}",
                 f"data.synthetic_max_digits={d.synthetic_max_digits}", f"data.synthetic_num_eval={d.synthetic_num_eval}",
                 f"data.prompt_template={d.prompt_template}", f"data.apply_chat_template={str(d.apply_chat_template).lower()}",
                 f"algo.max_prompt_length={a.max_prompt_length}", f"algo.max_response_length={a.max_response_length}",
                 f"algo.overlong_buffer_length={a.overlong_buffer_length}", "algo.dynamic_sampling=false",
                 f"trainer.sft_warmup_steps={WARM_START_STEPS}", "trainer.sft_batch_size=32", "trainer.total_steps=1",
                 "trainer.eval_interval=0", "trainer.hf_export_interval=1", "trainer.hf_export_dtype=float32",
                 f"trainer.output_dir={out}", "trainer.run_name=warm", *QUIET_RECORDS]
    overrides += [f"rollout.environment={r.environment}"] if r.environment else []
    proc = run_cli("train", *overrides, timeout_s=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    model = out / "warm" / "hf" / "step_000001"
    assert (model / "config.json").is_file(), sorted(p.name for p in (out / "warm").iterdir())
    return model


def run_twin(cluster, experiment: str, out: Path, overrides=(), env=None) -> Tuple[Path, List[dict]]:
    """Submit the twin's training job from its warm-started tiny model, wait for it, check it
    completed; (run dir, metrics rows)."""
    sglang = sglang_python_or_skip()
    model = warm_model(experiment, out / "warm_start")
    overrides = [f"model.hf_path={model}", "trainer.sft_warmup_steps=0", *overrides]
    nodes, job_env, script = twin_job_args(experiment)
    run_name = experiment.replace(".", "_")
    args = [f"--output={out}/slurm-%j.out", f"-J{run_name}", *nodes, str(REPO / script),
            f"+experiment={experiment}", f"+twin={experiment}", f"trainer.output_dir={out}",
            f"trainer.run_name={run_name}", f"rollout.engine_python={sglang}", *overrides]
    job = cluster.sbatch(args, extra_env={**job_env, **(env or {})}, cwd=REPO)
    info = cluster.wait_job(job, TWIN_JOB_TIMEOUT_S)
    run_dir = out / run_name
    batch = (out / f"slurm-{job}.out")
    logs = run_dir / "logs" / f"job-{job}"
    everything = (batch.read_text(errors="replace") if batch.exists() else "(no batch log)") + "".join(
        f"\n===== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(logs.glob("*.log")))
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", everything[-12000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "policy_version" in r]
    assert [r["step"] for r in steps] == [1, 2], everything[-6000:]
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "engines").glob("engine-*.json"))]
    assert len(records) == load_config([f"+experiment={experiment}", f"+twin={experiment}"]).rollout.num_engines
    served = {r["engine_id"] for r in _ledger_rows(run_dir)}
    assert served and served <= {r["url"] for r in records}, (served, records)  # attached through the registry
    for row in steps:  # the step-1 checks of every recipe: the engines serve the learner's weights
        assert math.isfinite(row["mismatch/logp_abs_mean"]) and row["mismatch/logp_abs_max"] < 1e-2, row
        assert row["probe/engines"] == len(records), row
    engine_logs = sorted(run_dir.glob("logs/job-*/engine-*.log"))
    assert len(engine_logs) == len(records), engine_logs
    for log in engine_logs:  # the job's first push and each step's sync, in weight-update sessions that all ended
        text = log.read_text(errors="replace")
        begins, ends = (text.count(f"POST /{what}_weight_update ") for what in ("begin", "end"))
        assert begins == ends >= 2, (log, begins, ends)
    return run_dir, steps


def assert_checksums_on_every_engine(run_dir: Path, engines: int) -> None:
    """The weights check of a dense model: after each sync every engine's weights hashed equal to the learner's."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    checked = [r for r in rows if "checksum/tensors" in r]
    assert checked and all(r["checksum/engines"] == engines and r["checksum/errors"] == 0
                           and r["checksum/tensors"] > 10 for r in checked), checked


def _ledger_rows(run_dir: Path) -> List[dict]:
    import pyarrow.parquet as pq

    return [r for shard in sorted((run_dir / "ledger").glob("step_*.parquet")) for r in pq.read_table(shard).to_pylist()]


def test_the_moe_twin_replays_the_engines_experts_at_every_step_under_slurm(slurm_cluster, tmp_path):
    """dapo_qwen3_30b_a3b's twin: a tiny every-layer-sparse Qwen3-MoE at EP 2 x DP 2, colocated on
    two nodes, its learners attached to SGLang through the registry, with routing replay on (the
    recipe keeps it off until measured; on, every sample must carry its experts). Before the
    registry recorded the engines' routed-expert flag, no request asked for experts: step 1
    stopped ("the engines reported no routed experts"), and with replay off router agreement was
    NaN at every step."""
    import base64

    from dapo_mega.backends.megatron.routing import decode_routed_experts
    from dapo_mega.models.shape import ModelShape

    run_dir, steps = run_twin(slurm_cluster, "dapo_qwen3_30b_a3b", tmp_path,
                              overrides=["algo.routing_replay=true", "trainer.ledger_routed_experts=true"])
    for row in steps:
        assert row["moe/unreported_samples"] == 0 and row["moe/router_choices_compared"] > 0, row
        assert row["moe/router_agreement"] > 0.9 and row["moe/routing_replay"] == 1.0, row
    shape = ModelShape.from_hf_config(str(tmp_path / "warm_start" / "warm" / "hf" / "step_000001"))
    assert shape.is_moe and all(shape.is_sparse_layer(i) for i in range(shape.num_layers))
    choices = shape.num_layers * shape.num_experts_per_tok
    for row in _ledger_rows(run_dir):  # the experts each engine chose, kept with the sample
        positions = len(base64.b64decode(row["routed_experts"].partition(":")[2])) // choices
        experts = decode_routed_experts(row["routed_experts"], positions, shape.num_layers, shape.num_experts_per_tok)
        assert experts is not None and positions > row["response_length"] and int(experts.max()) < shape.num_experts


def test_the_disaggregated_twin_runs_as_its_heterogeneous_job(slurm_cluster, tmp_path):
    """dapo_qwen2.5_32b_disagg's twin: learners (TP 2 x PP 2) on one component, two SGLang servers
    on the other, weights over the weight-update group, one version of staleness, TIS."""
    run_dir, steps = run_twin(slurm_cluster, "dapo_qwen2.5_32b_disagg", tmp_path)
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "engines").glob("engine-*.json"))]
    learner_logs = sorted((run_dir / "logs").glob("job-*/learner-*.log"))
    assert len(learner_logs) == 4 and len({r["node"] for r in records}) == 1, (learner_logs, records)
    assert len({r["sync/bytes"] for r in steps}) == 1 and steps[0]["sync/bytes"] > 0
    assert_checksums_on_every_engine(run_dir, len(records))
    for log in sorted(run_dir.glob("logs/job-*/engine-*.log")):  # each pipeline stage broadcast on a group of its own
        assert "group_name=dapo_weight_sync_pp1" in log.read_text(errors="replace"), log
    for row in _ledger_rows(run_dir):  # one version of staleness: what SGLang's replies carried
        assert 0 <= row["age"] <= 1, row


def test_the_retool_twin_runs_its_tools_on_a_112_core_stand_in(slurm_cluster, tmp_path):
    """dapo_retool_qwen2.5_32b's twin on a node that reads as the recipe's 112 cores
    (DAPO_MEGA_NODE_CPUS, every process of the job): the sandbox at the recipe's isolation and
    limits, the tools at max_concurrent, partial rollouts on (the synchronous mode's default), and
    no sample closed with its tool call pending."""
    run_dir, steps = run_twin(slurm_cluster, "dapo_retool_qwen2.5_32b", tmp_path, env={"DAPO_MEGA_NODE_CPUS": "112"})
    for row in steps:
        assert row["rollout/tool_calls"] > 0 and row["rollout/turns_mean"] > 1.0, row
        assert row["rollout/closed_with_pending_tool"] == 0, row
        assert row["rollout/sandbox_isolation"] == 2.0, row  # full, as the recipe requires
        assert row["mismatch/logp_abs_max"] < 1e-3, row  # SGLang and the learner saw the same contexts
    # the round's tool calls ran max_concurrent at once (asyncio's default pool would have run 6 on
    # this machine's 2 cores, whatever the node's 112 say): the plan's clock counts on it
    assert max(row["rollout/sandbox_runs_at_once"] for row in steps) == 16, steps
    twin = load_config(["+experiment=dapo_retool_qwen2.5_32b", "+twin=dapo_retool_qwen2.5_32b"])
    assert_checksums_on_every_engine(run_dir, twin.rollout.num_engines)
    used = [r for r in _ledger_rows(run_dir) if r["tool_calls"]]
    # every turn stopped at `</code>`, the sandbox's answer went back into the context, and a turn
    # followed each answer unless the answer spent the budget (then the sample ends truncated)
    assert used and all((r["turns"] == r["tool_calls"] + 1 or r["truncated"] and r["turns"] == r["tool_calls"])
                        and json.loads(r["env_spans"]) and "<interpreter>" in r["response_text"] for r in used)
    sandbox = json.loads((run_dir / "run.json").read_text())["environment"]["sandbox"]
    assert sandbox["required"] == "full" and sandbox["level"] == "full" and sandbox["node_cpus"] == 112, sandbox
    assert sandbox["max_concurrent"] == 16
    # numpy in the recipe's sandbox on a node of the cluster: OpenBLAS would start 112 threads
    # against the process limit without the sandbox's one-thread settings
    code = ("import sys; from dapo_mega.config import load_config; "
            "from dapo_mega.environments.base import build_environment; "
            "r = load_config(sys.argv[1:]).rollout; env = build_environment(r.environment, r.environment_kwargs); "
            "env.reset(None); print(env.step('<code>import numpy as np\\nprint(int(np.ones((64, 64)) @ "
            "np.ones(64) @ np.ones(64)))</code>').observation)")
    out = slurm_cluster.run(["srun", "-N1", "-n1", JOB_MEM, "--chdir", str(REPO), sys.executable, "-c", code,
                             "+experiment=dapo_retool_qwen2.5_32b", "+twin=dapo_retool_qwen2.5_32b"],
                            timeout_s=300, extra_env={"DAPO_MEGA_NODE_CPUS": "112", "PYTHONPATH": str(REPO)})
    assert "4096" in out.stdout, out.stdout + out.stderr
