"""Every shipped experiment has a launcher and a twin (DESIGN.md "Shapes: the recipe, its twin, and
the node"): `configs/twin/<experiment>.yaml`, applied after the recipe (`+experiment=X +twin=X`),
keeps every switch of the recipe and changes only sizes, so a twin run on the local Slurm cluster
fails where the recipe would.

Here, without running anything: each experiment in configs/experiment/ has launch/<name>.sh and a
twin; the twin's resolved config differs from the recipe's only in the fields listed below as sizes
(counts, lengths, paths, timeouts, the tiny model of the same family) or as what a CPU cannot run
(Transformer Engine, FP8, bf16 kernels), each with the value it must take; a parallel degree above 1
stays above 1; the ratios the recipe is built on stay (3x over-sampling, the overlong buffer's share
of the response); and the twin plans on its CPU cluster with no blocking warning. The twins run on
Slurm in tests/launch/test_twin_runs.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Dict

import pytest

from dapo_mega.config import load_config

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*.yaml"))

SIZES = {
    # the model: a tiny one of the recipe's family (model.tiny_architecture is checked below)
    "model.name", "model.hf_path", "model.megatron_path", "model.tiny_architecture", "model.tiny_moe_dense_layers",
    "model.tiny_chat_template",
    # data: the synthetic task instead of the published files
    "data.train_path", "data.eval_path", "data.synthetic_task", "data.synthetic_max_digits",
    "data.synthetic_num_eval", "data.synthetic_num_train",
    # the cluster's size and the bounds of its clock
    "cluster.num_nodes", "cluster.gpus_per_node", "cluster.engine_nodes", "cluster.gpu_memory_gib",
    "cluster.num_learner_processes", "cluster.dist_timeout_s", "cluster.driver_stall_timeout_s",
    # counts and lengths
    "algo.n_samples_per_prompt", "algo.train_batch_size", "algo.gen_batch_size", "algo.mini_batch_size",
    "algo.max_prompt_length", "algo.max_response_length", "algo.overlong_buffer_length",
    "rollout.num_engines", "rollout.engine_tp_size", "rollout.max_running_requests", "rollout.weight_sync_bucket_mb",
    "rollout.health_timeout_s", "rollout.environment_kwargs.max_concurrent",
    "megatron.tensor_model_parallel_size", "megatron.pipeline_model_parallel_size",
    "megatron.expert_model_parallel_size", "megatron.context_parallel_size", "megatron.micro_batch_tokens",
    "eval.n_samples", "eval.max_problems",
    "trainer.total_steps", "trainer.save_interval", "trainer.eval_interval", "trainer.keep_every",
    "trainer.sft_warmup_steps", "trainer.sft_batch_size", "trainer.plot",
}
"""Fields a twin may change: sizes, not switches."""

ON_A_CPU = {
    "cluster.device": "cpu",
    "megatron.transformer_impl": "local",  # Transformer Engine has no CPU build
    "megatron.fp8.enabled": False,  # FP8 needs TE on an FP8 GPU; its rules are the plan's pure functions
    "rollout.dtype": "float32",  # SGLang's CPU path runs with its AMX bf16 kernels off (tools/sglang_cpu)
    "megatron.params_dtype": "float32",
    "megatron.sequence_parallel": False,  # the local spec's torch norms refuse it (backends/megatron/model.py)
}
"""Fields a twin may change only to what a CPU runs, with that value."""

CPU_LAYOUT = {("dapo_qwen3_30b_a3b", "tensor_model_parallel_size"):
              "megatron-core's MoE layer trains at TP > 1 only with sequence parallelism, which a CPU cannot run"}
"""Parallel degrees a twin folds to 1 on a CPU, each with the reason (the plan still checks the recipe's)."""

FAMILIES = {"qwen2.5-32b": "qwen2", "qwen2.5-7b": "qwen2", "qwen3-8b": "qwen3", "qwen3-30b-a3b": "qwen3_moe"}
"""The recipe's model (configs/model/<name>.yaml, its `name` lower-cased) -> the tiny architecture of its family."""


def _flat(d: Dict, prefix: str = "") -> Dict[str, object]:
    out: Dict[str, object] = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _resolved(*overrides: str) -> Dict[str, object]:
    return _flat(dataclasses.asdict(load_config(list(overrides))))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_has_a_launcher_and_a_twin(experiment):
    launcher = REPO / "launch" / f"{experiment}.sh"
    assert launcher.is_file() and os.access(launcher, os.X_OK), f"no executable launch/{experiment}.sh"
    assert f"--experiment {experiment} " in launcher.read_text(), launcher.read_text()
    assert (REPO / "configs" / "twin" / f"{experiment}.yaml").is_file(), \
        f"no twin: write configs/twin/{experiment}.yaml (the recipe's switches at tiny size)"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_a_twin_keeps_every_switch_of_its_recipe_and_changes_only_sizes(experiment):
    recipe = _resolved(f"+experiment={experiment}")
    twin = _resolved(f"+experiment={experiment}", f"+twin={experiment}")
    changed = sorted(k for k in set(recipe) | set(twin) if recipe.get(k) != twin.get(k))
    switches = [f"{k}: {recipe.get(k)!r} -> {twin.get(k)!r}" for k in changed if k not in SIZES and k not in ON_A_CPU]
    assert not switches, f"the twin of {experiment} changes switches, not sizes: {switches}"
    cpu = [f"{k} -> {twin[k]!r} (a CPU runs {ON_A_CPU[k]!r})" for k in changed if k in ON_A_CPU and twin[k] != ON_A_CPU[k]]
    assert not cpu, cpu
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                "context_parallel_size"):
        degree, small = recipe[f"megatron.{key}"], twin[f"megatron.{key}"]
        folded = (experiment, key) in CPU_LAYOUT and small == 1
        assert ((degree > 1) == (small > 1) or folded) and small <= degree, f"megatron.{key}: {degree} -> {small}"
    if recipe["model.hf_path"]:  # a real model: the twin's tiny one is of its family
        assert twin["model.tiny_architecture"] == FAMILIES[recipe["model.name"].lower()], (recipe["model.name"], twin)
    assert recipe["algo.gen_batch_size"] * twin["algo.train_batch_size"] == \
        twin["algo.gen_batch_size"] * recipe["algo.train_batch_size"], "the over-sampling ratio"
    if recipe["algo.overlong_buffer_enable"]:
        share = recipe["algo.overlong_buffer_length"] / recipe["algo.max_response_length"]
        assert abs(twin["algo.overlong_buffer_length"] / twin["algo.max_response_length"] - share) < 0.05 * share + 1e-9
    assert twin["trainer.total_steps"] <= 3 and twin["cluster.device"] == "cpu"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_a_twin_plans_on_its_cpu_cluster_without_a_blocking_warning(experiment):
    from dapo_mega.plan.memory import compute_plan
    from dapo_mega.plan.types import blocking_warnings

    cfg = load_config([f"+experiment={experiment}", f"+twin={experiment}"])
    plan = compute_plan(cfg)
    assert not blocking_warnings(plan.warnings, engines_take_gpus=False), plan.warnings


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_a_twin_builds_on_a_cpu_as_its_learners_would(experiment):
    """The model provider's rules on a CPU (layer spec, dtype, sequence parallelism, MoE layout),
    for the learner world the twin's Slurm job starts: what killed the MoE twin's first Slurm job
    (sequence parallelism on the local spec's torch norms) fails here in milliseconds."""
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.model import plan_transformer_config
    from dapo_mega.models.shape import ModelShape
    from dapo_mega.plan.preflight import model_hf_config

    cfg = load_config([f"+experiment={experiment}", f"+twin={experiment}"])
    c = cfg.cluster
    world = (c.num_nodes - (c.engine_nodes if c.mode == "disaggregated" else 0)) * c.gpus_per_node
    hf = model_hf_config(cfg)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf_config=hf).validate()
    plan_transformer_config(ModelShape.from_hf_config(hf), cfg.megatron, layout, has_gpu=False,
                            te_error="no GPU", routing_replay=cfg.algo.routing_replay)
