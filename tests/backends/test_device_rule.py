"""The one device rule (`backends.placement`): every process that may touch a GPU takes its
device from it, checked on the CPU over a stated device count.

The rule as a pure function (blocks of a node, distinct, refused past the node's GPUs, in one
line); each entry point: conversion ranks (CPU unless told, their own GPU when told, the 32B
recipe's 16 ranks refused on 8 GPUs), the engines of `dapo-mega eval` and `dapo-mega audit`
(distinct GPUs of the node, refused when more than fit), the fleet itself (no GPU engine
without GPUs), a learner layout (no GPU chosen for it unless the caller says so), `verify`'s
forward (its ids on the model's device), and no module choosing LOCAL_RANK or
CUDA_VISIBLE_DEVICES on its own; every shipped experiment's conversion and eval engines.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from dapo_mega.backends.placement import (
    CPU,
    CUDA,
    DeviceRuleError,
    conversion_cuda_index,
    engines_fitting_node,
    gpu_block,
    node_engine_gpus,
    node_gpu_blocks,
)
from dapo_mega.config import ConfigError, RolloutConfig, load_config
from dapo_mega.engines.fleet import EngineFleet

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*.yaml"))


class _Started(Exception):
    """Raised by a stand-in for EngineFleet.start once it has recorded its arguments."""


# ------------------------------------------------------------------ the rule, pure
@pytest.mark.parametrize("gpus_per_task", [1, 2, 4, 8])
def test_blocks_are_distinct_within_the_node_and_refused_past_it(gpus_per_task):
    gpus = 8
    for tasks in range(0, 10):
        if tasks * gpus_per_task > gpus:
            with pytest.raises(DeviceRuleError) as err:
                node_gpu_blocks(tasks, gpus_per_task, gpus, "who", "the fix")
            assert "\n" not in str(err.value) and str(err.value).endswith("Fix: the fix")
            assert f"need {tasks * gpus_per_task} GPUs of one node, which has 8" in str(err.value)
            continue
        blocks = node_gpu_blocks(tasks, gpus_per_task, gpus, "who", "the fix")
        used = [g for b in blocks for g in b]
        assert len(blocks) == tasks and all(len(b) == gpus_per_task for b in blocks)
        assert len(set(used)) == len(used) and all(0 <= g < gpus for g in used)
        assert blocks == [gpu_block(k, gpus_per_task) for k in range(tasks)]


def test_conversion_runs_on_the_cpu_unless_told_and_then_one_gpu_per_rank():
    assert [conversion_cuda_index(r, 16, CPU, 8) for r in range(16)] == [None] * 16
    assert [conversion_cuda_index(r, 8, CUDA, 8) for r in range(8)] == list(range(8))
    with pytest.raises(DeviceRuleError, match=r"16 ranks, one GPU each, need 16 GPUs of one node, which has 8\. "
                                              r"Fix: --device cpu"):
        conversion_cuda_index(0, 16, CUDA, 8)  # the 32B import at --tp 8 --pp 2 on one 8-GPU node
    with pytest.raises(ConfigError, match="device 'gpu' is unknown"):
        conversion_cuda_index(0, 1, "gpu", 8)


def test_eval_engines_refused_past_the_node_with_the_count_that_fits():
    with pytest.raises(DeviceRuleError) as err:  # the documented by-hand eval: 32 TP-4 engines on one node
        node_engine_gpus(RolloutConfig(num_engines=32, engine_tp_size=4), 8, "dapo-mega eval")
    assert str(err.value) == ("dapo-mega eval: rollout.num_engines=32 engines of 4 GPUs (rollout.engine_tp_size=4) "
                              "need 128 GPUs of one node, which has 8. Fix: rollout.num_engines=2")
    assert node_engine_gpus(RolloutConfig(num_engines=2, engine_tp_size=4), 8, "x") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    with pytest.raises(DeviceRuleError, match="Fix: rollout.engine_tp_size <= 4"):
        node_engine_gpus(RolloutConfig(num_engines=1, engine_tp_size=8), 4, "x")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_conversion_and_eval_engines_follow_the_rule(name):
    """Conversion ranks of the recipe's TP x PP, and the pipeline's final-eval engines, on one
    node of the experiment's GPUs."""
    from dapo_mega.plan.clock import eval_stage_engines

    cfg = load_config([f"+experiment={name}"])
    gpus = cfg.cluster.gpus_per_node
    ranks = cfg.megatron.tensor_model_parallel_size * cfg.megatron.pipeline_model_parallel_size
    assert all(conversion_cuda_index(r, ranks, CPU, gpus) is None for r in range(ranks))  # the default
    if ranks <= gpus:
        assert sorted(conversion_cuda_index(r, ranks, CUDA, gpus) for r in range(ranks)) == list(range(ranks))
    else:
        with pytest.raises(DeviceRuleError, match="Fix: --device cpu"):
            conversion_cuda_index(0, ranks, CUDA, gpus)
    if cfg.cluster.device == "cpu":
        return
    engines = eval_stage_engines(cfg)
    assert engines == engines_fitting_node(cfg.rollout, gpus) >= 1
    rollout = RolloutConfig(num_engines=engines, engine_tp_size=cfg.rollout.engine_tp_size)
    used = [g for block in node_engine_gpus(rollout, gpus, "dapo-mega eval") for g in block]
    assert len(used) == len(set(used)) == engines * cfg.rollout.engine_tp_size <= gpus
    if cfg.rollout.num_engines * cfg.rollout.engine_tp_size > gpus:  # the run's own engines by hand: refused
        with pytest.raises(DeviceRuleError, match=f"Fix: rollout.num_engines={engines}"):
            node_engine_gpus(cfg.rollout, gpus, "dapo-mega eval")


# ------------------------------------------------------------------ the entry points
def _on_four_gpus(monkeypatch):
    """This machine as a node of 4 GPUs to the fleet; EngineFleet.start records its arguments."""
    calls = []

    def start(self, count=0, gpu_ids=(), base_gpu_ids=()):
        calls.append((count, [list(g) for g in gpu_ids], list(base_gpu_ids)))
        raise _Started()

    monkeypatch.setattr(EngineFleet, "on_gpu", lambda self: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(EngineFleet, "start", start)
    return calls


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from dapo_mega.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("hf"))


def test_eval_and_audit_start_their_engines_on_distinct_gpus_of_the_node(monkeypatch, tmp_path, tiny_hf):
    from dapo_mega.audit.run import roll_out
    from dapo_mega.evaluate import evaluate_checkpoint

    calls = _on_four_gpus(monkeypatch)
    cfg = load_config(["rollout.num_engines=2", "rollout.engine_tp_size=2", f"trainer.output_dir={tmp_path}"])
    with pytest.raises(_Started):
        evaluate_checkpoint(cfg, str(tiny_hf), tmp_path)
    with pytest.raises(_Started):
        roll_out(cfg, tiny_hf, [], None, 0, "rev", "run")
    assert calls == [(2, [[0, 1], [2, 3]], [0, 0])] * 2  # SGLang's --base-gpu-id 0 inside each engine's own GPUs
    calls.clear()
    cfg.rollout.num_engines = 3  # 6 GPUs on a node of 4: refused before any engine starts
    for entry in (lambda: evaluate_checkpoint(cfg, str(tiny_hf), tmp_path),
                  lambda: roll_out(cfg, tiny_hf, [], None, 0, "rev", "run")):
        with pytest.raises(DeviceRuleError, match=r"rollout.num_engines=3 engines of 2 GPUs .* need 6 GPUs of one "
                                                  r"node, which has 4\. Fix: rollout.num_engines=2"):
            entry()
    assert calls == []


def test_the_fleet_starts_no_gpu_engine_without_its_gpus(monkeypatch):
    monkeypatch.setattr(EngineFleet, "on_gpu", lambda self: True)
    spawned = []
    monkeypatch.setattr(EngineFleet, "spawn", lambda self, *a, **k: spawned.append(a) or (_ for _ in ()).throw(
        _Started()))
    fleet = EngineFleet(RolloutConfig(num_engines=2), "model")
    with pytest.raises(ValueError, match="2 engines on GPUs, GPUs given for 0.*never SGLang's default GPU 0"):
        fleet.start()
    assert spawned == []


def test_a_layout_takes_a_gpu_only_when_its_caller_chooses_one(monkeypatch):
    """With a GPU visible and no device chosen, initialize refuses before torch.distributed
    starts (today's code picked NCCL and cuda:LOCAL_RANK on its own); with one chosen, it
    selects that GPU and NCCL."""
    from megatron.core import parallel_state  # noqa: F401 - imported before CUDA is faked below

    from dapo_mega.backends.megatron.layout import ParallelLayout

    chosen, started = [], []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # as in a fresh learner process
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(d))

    def init_process_group(backend=None, **kwargs):
        started.append(backend)
        raise _Started()

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(ConfigError, match="8 GPU\\(s\\) visible but no cuda_device chosen"):
        ParallelLayout(world_size=1).initialize()
    assert chosen == [] and started == []
    with pytest.raises(_Started):
        ParallelLayout(world_size=1).initialize(cuda_device=3)
    assert chosen == [3] and started == ["nccl"]


def test_verify_feeds_its_ids_to_the_models_device(monkeypatch):
    """megatron_logits on a model whose weights live on another device than the ids (here
    `meta`, standing for a GPU): ids, positions and mask are moved to it."""
    import megatron.core.tensor_parallel as tp

    from dapo_mega.weights.verify import megatron_logits

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(3, device="meta"))

        def forward(self, ids, positions, mask):
            devices = {t.device.type for t in (ids, positions, mask)}
            assert devices == {"meta"}, f"inputs on {devices}, the model on meta"
            return torch.zeros(*ids.shape, 8, device="meta")

    monkeypatch.setattr(tp, "gather_from_tensor_model_parallel_region", lambda x: x)
    info = type("Info", (), {"shape": type("Shape", (), {"vocab_size": 5})()})()
    out = megatron_logits([Chunk()], info, torch.zeros(2, 4, dtype=torch.long))
    assert out.shape == (2, 4, 5) and out.device.type == "meta"


def _spawned_rank_env(rank, world_size):
    return os.environ.get("LOCAL_RANK"), os.environ.get("CUDA_VISIBLE_DEVICES")


def test_spawned_cpu_ranks_see_no_gpu_and_get_no_local_rank():
    from dapo_mega.weights.spawn import spawn_gloo

    assert spawn_gloo(_spawned_rank_env, 2, timeout_s=120) == [(None, ""), (None, "")]
    assert os.environ.get("CUDA_VISIBLE_DEVICES") != "" or "CUDA_VISIBLE_DEVICES" not in os.environ


# ------------------------------------------------------------------ nobody chooses a device on its own
DEVICE_VARIABLES = ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
SETS_DEVICE_VARIABLES = {
    "dapo_mega/launch.py": "the Slurm launcher: each learner task's LOCAL_RANK, checked by learner_cuda_index",
    "dapo_mega/driver/learner_ranks.py": "one process started by hand: LOCAL_RANK 0 of a world of one",
    "dapo_mega/engines/fleet.py": "an engine's CUDA_VISIBLE_DEVICES: its block of the placement (visible_devices)",
    "dapo_mega/backends/placement.py": "the rule itself (CPU_RANK_ENV)",
}


def _sets_device_variable(tree: ast.AST) -> list:
    """Lines that set LOCAL_RANK / CUDA_VISIBLE_DEVICES: `environ[...] = `, `update(NAME=...)`, a dict key."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant) \
                        and target.slice.value in DEVICE_VARIABLES:
                    lines.append(node.lineno)
        elif isinstance(node, ast.Call):
            lines += [node.lineno for k in node.keywords if k.arg in DEVICE_VARIABLES]
        elif isinstance(node, ast.Dict):
            lines += [node.lineno for k in node.keys if isinstance(k, ast.Constant) and k.value in DEVICE_VARIABLES]
    return lines


def test_no_process_chooses_its_device_variables_on_its_own():
    found = {}
    for folder in ("dapo_mega", "tools", "bench", "launch"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            lines = _sets_device_variable(ast.parse(path.read_text()))
            if lines and rel not in SETS_DEVICE_VARIABLES:
                found[rel] = lines
    assert found == {}, f"set LOCAL_RANK / CUDA_VISIBLE_DEVICES outside the device rule: {found}"


def test_the_embedded_engine_stays_on_the_cpu_beside_gpu_learners(monkeypatch):
    """The embedded engine has no GPU path: beside GPU learners it holds no GPU, sees none,
    and its weights come as shared-memory files (colocated) or through a gloo group
    (disaggregated), never as CUDA IPC handles or a NCCL broadcast it cannot receive."""
    from dapo_mega.backends.placement import CUDA_IPC, DISTRIBUTED, SHARED_MEMORY, ClusterShape, place

    for backend, colocated_transport, group_backend in (("embedded", SHARED_MEMORY, "gloo"),
                                                        ("sglang", CUDA_IPC, "nccl")):
        cfg = load_config([f"rollout={backend}", "cluster.mode=colocated", "rollout.num_engines=2"])
        on_one_node = place(cfg, ClusterShape(1, 8, "colocated", 1, 2, use_gpu=True))
        assert on_one_node.problems() == [] and on_one_node.transport == colocated_transport
        assert all(bool(e.gpu_ids) == (backend == "sglang") for e in on_one_node.engines)
        cfg = load_config([f"rollout={backend}", "cluster.mode=disaggregated", "rollout.num_engines=2"])
        two_nodes = place(cfg, ClusterShape(2, 8, "disaggregated", 1, 8, use_gpu=True))
        assert two_nodes.problems() == [] and two_nodes.transport == DISTRIBUTED
        assert two_nodes.weight_update_group(0).backend == group_backend
        fleet = EngineFleet(cfg.rollout, "model", device="cuda")
        assert fleet.on_gpu() == (backend == "sglang")
        env = fleet.child_env(0, parent_env={})
        assert ("CUDA_VISIBLE_DEVICES" in env) == (backend == "embedded") and env.get("CUDA_VISIBLE_DEVICES", "") == ""
