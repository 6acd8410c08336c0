"""The Qwen3-30B-A3B recipe (configs/experiment/dapo_qwen3_30b_a3b.yaml, issue #38 item 7): it
differs from the 32B recipe only where its header says, its layout divides the published
Qwen3-30B-A3B config (heads over TP, 128 experts over EP 8, EP over the stage's ranks), the plan
fits it in an H100's 80 GiB, and the launch pipeline's dry run converts and verifies it at EP 8."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from test_recipe_pins import check_run_pins, check_variant_of_32b

from dapo_mega.config import load_config
from dapo_mega.plan.memory import compute_plan

REPO = Path(__file__).resolve().parents[2]
# Qwen/Qwen3-30B-A3B config.json (Hugging Face hub), the fields a shape reads.
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "router_aux_loss_coef": 0.001, "vocab_size": 151936, "rope_theta": 1000000.0,
                 "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "max_position_embeddings": 40960,
                 "attention_bias": False, "use_sliding_window": False}


def test_the_30b_a3b_recipe_differs_only_where_it_says_and_fits():
    cfg = load_config(["+experiment=dapo_qwen3_30b_a3b"])
    text = check_variant_of_32b(load_config(["+experiment=dapo_qwen2.5_32b"]), cfg, "dapo_qwen3_30b_a3b",
                                {"model.name", "model.hf_path", "model.megatron_path", "cluster.num_nodes",
                                 "rollout.num_engines", "megatron.tensor_model_parallel_size",
                                 "megatron.pipeline_model_parallel_size", "megatron.expert_model_parallel_size",
                                 "trainer.run_name"})
    assert "run-qwen3-30B-A3B.sh" in text  # the peer layout it cites
    check_run_pins(cfg)
    m = cfg.megatron
    assert QWEN3_30B_A3B["num_experts"] % m.expert_model_parallel_size == 0
    assert QWEN3_30B_A3B["num_key_value_heads"] % m.tensor_model_parallel_size == 0
    plan = compute_plan(cfg)
    assert round(plan.total_params / 1e9, 1) == 30.5 and 3.3 <= plan.active_params / 1e9 < 3.4
    assert max(s.total_bytes for s in plan.learner_memory.stages) < 80 * 2**30


def test_the_pipeline_converts_and_verifies_the_30b_a3b_at_ep8(tmp_path):
    """The dry run (nothing submitted, nothing written) of the recipe on the published config:
    import, verify and export carry --ep 8 and ask a CPU per conversion rank (TP 4 x EP 8 / 4)."""
    hf = tmp_path / "Qwen3-30B-A3B"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    data = tmp_path / "d.parquet"
    data.write_text("")
    out = subprocess.run([sys.executable, "launch/pipeline.py", "--experiment", "dapo_qwen3_30b_a3b", "--hf-model",
                          str(hf), "--dapo-math", str(data), "--aime", str(data), "--output-dir", str(tmp_path / "o"),
                          "--from", "import", "--dry-run", "--", "rollout.engine_python=/opt/sglang/bin/python"],
                         capture_output=True, text=True, cwd=REPO, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {}
    for ln in out.stdout.splitlines():
        if ln.startswith("sbatch "):
            args = shlex.split(ln)
            lines[next(a for a in args if a.startswith("--job-name=")).rsplit("-", 1)[-1]] = args
    for stage in ("import", "verify", "export"):
        line = lines[stage]
        assert line[line.index("--ep") + 1] == "8", line
        assert "--cpus-per-task=8" in line, line
    assert not (tmp_path / "o").exists()
