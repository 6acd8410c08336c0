"""Checks that run before anything is built: what `dapo-mega train` and `dapo-mega eval` do
first, so a config that cannot work fails in a second with one `config error` line (the
CLI prints it) instead of after the base model was built, or with a traceback.

    check_before_start(cfg)     every config rule (`validate_config`), the parallel layout
                                against the learner world size and the model's shape (its
                                config.json, or the tiny model's fields), the model provider's
                                choices on this machine (layer spec, dtype, FP8), the data files,
                                and that the checkpoint a resume would load fits this layout
    check_data_paths(cfg.data)  data.train_path / data.eval_path exist
    check_chat_template(cfg)    data.apply_chat_template has a template to apply
    check_verifier(cfg.algo, cfg.data) algo.verifier resolves; a reward plugin imports, has the
                                signature and returns a valid result on the training data's
                                first row (its ground truth, data source and extra_info)
    check_eval_set_paths(cfg.eval) the files of eval.sets exist
    check_engine_python(cfg.rollout) SGLang engines this process starts have a Python with SGLang
    check_nccl_agreement(cfg)   the learner's and the engines' Pythons load one NCCL release
                                where weight-update groups join them (disaggregated; plan/nccl.py)
    check_eval_inputs(cfg)      `dapo-mega eval`: data files, a held-out set, the checkpoints

Nothing here opens a process group or writes a file; the processes it may start are a
reward plugin's probe worker (killed at algo.verifier_timeout_s) and `rollout.engine_python`
asked whether it finds sglang (`python_has_sglang`) and which NCCL it loads (`nccl.nccl_version`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from dapo_mega.config import (
    AlgoConfig,
    ConfigError,
    DapoConfig,
    DataConfig,
    EngineKind,
    EvalConfig,
    RolloutConfig,
    validate_config,
)
from dapo_mega.plan.nccl import check_nccl_agreement

if TYPE_CHECKING:
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.models.shape import HfConfigSource


def learner_world_size(cfg: DapoConfig) -> int:
    """Learner processes of this run: WORLD_SIZE when launched by torchrun / srun, else
    `cluster.num_learner_processes` (what `dapo-mega train` spawns)."""
    if "RANK" in os.environ and os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    return cfg.cluster.num_learner_processes


def model_hf_config(cfg: DapoConfig) -> HfConfigSource:
    """The model's HF config without building anything: `model.hf_path` (a directory with
    config.json) or the tiny model's config from its fields."""
    if cfg.model.hf_path:
        path = Path(cfg.model.hf_path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.hf_path: {path} has no config.json. Fix: point model.hf_path at a Hugging "
                              "Face checkpoint directory (or leave it empty for the tiny model)")
        return str(path)
    from dapo_mega.models.tiny import tiny_hf_config

    return tiny_hf_config(cfg.model)


def check_data_paths(data_cfg: DataConfig) -> None:
    """Each configured data file exists (empty paths mean the synthetic task / no held-out set)."""
    for name in ("train_path", "eval_path"):
        value = getattr(data_cfg, name)
        if value and not Path(value).is_file():
            raise ConfigError(f"data.{name}: {value} does not exist. Fix: point data.{name} at a .parquet or "
                              ".jsonl file (tools/prepare_data.py writes them), or leave data.train_path empty "
                              "for the synthetic task")


def check_chat_template(cfg: DapoConfig) -> None:
    """`data.apply_chat_template` with a tokenizer that has a template: checked on every rank
    before any process group forms (the driver's encoder found it only after the other ranks
    had started, which then died waiting for it). The tiny model has one with
    `model.tiny_chat_template`; an HF directory's tokenizer is asked as the encoder asks it."""
    if not cfg.data.apply_chat_template:
        return
    if not cfg.model.hf_path:
        if not cfg.model.tiny_chat_template:
            raise ConfigError("data.apply_chat_template: true, but the tiny model's tokenizer has no chat template. "
                              "Fix: model.tiny_chat_template=true (Qwen's ChatML), or data.apply_chat_template=false")
        return
    from dapo_mega.data.encoder import PromptEncoder

    PromptEncoder.from_pretrained(cfg.model.hf_path, cfg.data)  # ConfigError naming the field and the fix


def check_eval_set_paths(eval_cfg: EvalConfig) -> None:
    """Each named eval set's file exists (`eval.sets.<name>.path`)."""
    for name, eval_set in eval_cfg.sets.items():
        if not Path(eval_set.path).is_file():
            raise ConfigError(f"eval.sets.{name}.path: {eval_set.path} does not exist. Fix: point it at a .parquet "
                              "or .jsonl file (tools/prepare_data.py writes AIME 2025 and MATH-500), or drop the set")


SGLANG_PROBE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sglang') else 3)"
"""What `python_has_sglang` runs in another interpreter: finds the package without importing it
(a second, not SGLang's start-up)."""


def python_has_sglang(python: str) -> bool:
    """Whether the interpreter `python` (a path or a name on PATH) finds the sglang package."""
    if python == sys.executable:
        return importlib.util.find_spec("sglang") is not None
    try:
        return subprocess.run([python, "-c", SGLANG_PROBE], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_engine_python(rollout: RolloutConfig, starts_engines: bool = False) -> None:
    """The SGLang engines start from `rollout.engine_python`, or this Python when it is empty; on a
    cluster the learner's environment has no SGLang (its torch pins would replace the learner's)
    and the engines run from a venv of their own (docs/cluster.md section 1). Every command that
    starts engines calls this before it allocates or starts anything: `dapo-mega train`, eval and
    audit, the Slurm job's prepare and engines roles (`starts_engines=True` where the engines
    are started whatever `engine_urls` / `engine_registry` say; the trainer with either set
    attaches to engines someone else started, which are not checked here)."""
    if rollout.backend != EngineKind.SGLANG or (not starts_engines and (rollout.engine_urls or rollout.engine_registry)):
        return
    if rollout.engine_python and shutil.which(rollout.engine_python) is None:
        raise ConfigError(f"rollout.engine_python: {rollout.engine_python} is not an executable Python. Fix: "
                          "point it at the bin/python of the SGLang venv (docs/cluster.md section 1)")
    if python_has_sglang(rollout.engine_python or sys.executable):
        return
    if rollout.engine_python:
        raise ConfigError(f"rollout.engine_python: {rollout.engine_python} cannot import sglang, so no SGLang "
                          "engine can start. Fix: point it at the bin/python of the SGLang venv (docs/cluster.md "
                          "section 1: python -m venv /opt/sglang && /opt/sglang/bin/pip install sglang==0.5.23)")
    raise ConfigError(f"rollout.engine_python: empty, so the SGLang engines would start from this Python "
                      f"({sys.executable}), which cannot import sglang (the learner's environment keeps it out: "
                      "docs/cluster.md section 1). Fix: set rollout.engine_python=<the SGLang venv>/bin/python")


def check_verifier(algo_cfg: AlgoConfig, data_cfg: DataConfig) -> None:
    """`algo.verifier` names a verifier that can run: a built-in name, or a reward plugin that
    imports, takes (response, ground_truth, metadata) and returns a RewardResult of finite
    numbers on the training data's first row (its ground truth, data source and extra_info,
    as the run gives them), in a worker like the run's (reward.check_verifier)."""
    from dapo_mega.data.build import first_training_problem
    from dapo_mega.reward import VERIFIERS
    from dapo_mega.reward import check_verifier as check

    if algo_cfg.verifier in VERIFIERS:  # built-ins are not probed: no data read for them
        check(algo_cfg.verifier, algo_cfg.verifier_timeout_s, algo_cfg.reward_kwargs)
        return
    check_data_paths(data_cfg)
    problem, where = first_training_problem(data_cfg)
    check(algo_cfg.verifier, algo_cfg.verifier_timeout_s, algo_cfg.reward_kwargs, probe=problem, probe_where=where)


def check_environment(cfg: DapoConfig) -> None:
    """`rollout.environment` (multi-turn samples) loads, takes rollout.environment_kwargs and
    has stop strings (environments.base.build_environment: ConfigError naming the field), and
    so does `rollout.agent` with its kwargs."""
    from dapo_mega.config import partial_rollout_enabled
    from dapo_mega.environments.agent import build_agent
    from dapo_mega.environments.base import build_environment

    build_agent(cfg.rollout.agent, cfg.rollout.agent_kwargs)  # rollout.agent loads and takes its kwargs

    env = build_environment(cfg.rollout.environment, cfg.rollout.environment_kwargs)
    if env is not None and not getattr(env, "resumable", True) and partial_rollout_enabled(cfg):
        raise ConfigError(f"rollout.partial_rollout: on, but rollout.environment {cfg.rollout.environment!r} says its "
                          "episodes cannot be resumed (resumable = False: their state is not rebuilt by reset). Fix: "
                          "set rollout.partial_rollout=false")


def check_eval_inputs(cfg: DapoConfig) -> None:
    """What `dapo-mega eval` needs before it starts engines: the data files, a held-out set
    (the synthetic task has one; a training file needs data.eval_path), the checkpoints
    (eval.checkpoint empty is answered by the command's own usage line) and a Python its
    SGLang engines can start from (it starts its own, whatever rollout.engine_urls says)."""
    check_engine_python(cfg.rollout, starts_engines=True)
    check_data_paths(cfg.data)
    check_eval_set_paths(cfg.eval)
    check_verifier(cfg.algo, cfg.data)
    check_environment(cfg)
    if cfg.data.train_path and not cfg.data.eval_path and not cfg.eval.sets:
        raise ConfigError("data.eval_path: empty, so there are no held-out problems to evaluate. Fix: set "
                          "data.eval_path to the held-out .parquet / .jsonl file (AIME 2024 for the recipe), "
                          "or name sets in eval.sets")
    for name in ("checkpoint", "compare_checkpoint"):
        value = getattr(cfg.eval, name)
        if value and not Path(value).exists():
            raise ConfigError(f"eval.{name}: {value} does not exist. Fix: point it at an HF directory, a Megatron "
                              "checkpoint or a run directory")


def check_before_start(cfg: DapoConfig, world_size: Optional[int] = None) -> None:
    """Every check that needs no process group, model or engine; ConfigError names the field and the fix."""
    import torch

    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import check_learner_supports
    from dapo_mega.backends.megatron.model import plan_transformer_config, transformer_engine_import_error
    from dapo_mega.models.shape import ModelShape

    world = learner_world_size(cfg) if world_size is None else world_size
    validate_config(cfg, world_size=world)
    check_verifier(cfg.algo, cfg.data)
    check_environment(cfg)
    hf_config = model_hf_config(cfg)
    layout = ParallelLayout.from_config(cfg.megatron, world, hf_config=hf_config).validate()
    check_learner_supports(layout)
    # What the model provider will decide on this machine (layer spec, dtype, FP8), as build_model does;
    # on a GPU, TE's import error stops the run here.
    shape = ModelShape.from_hf_config(hf_config)
    plan_transformer_config(shape, cfg.megatron, layout, torch.cuda.is_available(),
                            transformer_engine_import_error(), cfg.algo.routing_replay)
    check_routing_replay(cfg)
    check_engine_serves_model(cfg, shape)
    check_data_paths(cfg.data)
    check_chat_template(cfg)
    check_eval_set_paths(cfg.eval)
    check_engine_python(cfg.rollout)
    check_nccl_agreement(cfg)
    check_resume_layout(cfg, layout)


def check_routing_replay(cfg: DapoConfig) -> None:
    """Routing replay with full activation recompute under pipeline parallelism would replay a
    later micro-batch's experts in a recomputed forward (backends/megatron/routing.py)."""
    m = cfg.megatron
    if cfg.algo.routing_replay and m.recompute_granularity == "full" and m.pipeline_model_parallel_size > 1:
        raise ConfigError("algo.routing_replay: with megatron.recompute_granularity=full and PP "
                          f"{m.pipeline_model_parallel_size}, the recomputed forward in backward would route by "
                          "another micro-batch's experts. Fix: megatron.recompute_granularity=selective, "
                          "megatron.pipeline_model_parallel_size=1, or algo.routing_replay=false")


def check_engine_serves_model(cfg: DapoConfig, shape) -> None:
    """SGLang 0.5.23 builds every layer of a Qwen3-MoE (and Qwen2-MoE) sparse: its
    `Qwen3MoeDecoderLayer` sets `is_layer_sparse = True` whatever `mlp_only_layers` and
    `decoder_sparse_step` say, and its weight loader skips the dense layers' MLP tensors that
    have no parameter, leaving those layers' experts uninitialised. The engine would serve
    another model than the learner trains, silently (a tiny model with one dense layer: other
    greedy tokens, log-probs off by 0.04). Qwen3-30B-A3B and -235B-A22B have no dense layer."""
    if cfg.rollout.backend != EngineKind.SGLANG or not shape.is_moe:
        return
    dense = [i for i in range(shape.num_layers) if not shape.is_sparse_layer(i)]
    if dense:
        raise ConfigError(f"rollout.backend: SGLang 0.5.23 serves every layer of a mixture of experts as sparse, but "
                          f"this model's layers {dense} are dense (mlp_only_layers / decoder_sparse_step): SGLang "
                          "would drop their MLP weights and serve another model. Fix: rollout.backend=embedded, "
                          "or a model whose every layer is sparse")


def check_resume_layout(cfg: DapoConfig, layout: ParallelLayout) -> None:
    """The checkpoint this run would resume from holds optimizer state this layout can load."""
    from dapo_mega.backends.megatron.checkpoint import layout_record, resume_layout_problem
    from dapo_mega.run_files.checkpoints import find_latest_checkpoint, read_trainer_state

    latest = find_latest_checkpoint(cfg.run_dir) if cfg.trainer.resume else None
    if latest is None:
        return
    state, here = read_trainer_state(latest), layout_record(layout)
    problem = resume_layout_problem(state, here, latest)
    if problem:
        raise ConfigError("megatron.tensor_model_parallel_size / pipeline_model_parallel_size / "
                          f"expert_model_parallel_size: {problem}")
