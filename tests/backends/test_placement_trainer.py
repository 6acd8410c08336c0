"""The placement a running trainer uses, checked on a CPU.

Engines the trainer starts itself get their own GPUs (before: none, so `num_engines > 1`
all landed on GPUs 0..tp-1), and the weight transport follows the placement, not whether
the engines' URLs happen to be loopback addresses.
"""

from __future__ import annotations

from dapo_mega.backends.placement import CUDA_IPC, DISTRIBUTED, SHARED_MEMORY, trainer_placement
from dapo_mega.config import RolloutConfig, load_config
from dapo_mega.engines.fleet import EngineFleet


def test_engines_started_by_the_trainer_get_their_own_gpus(tmp_path):
    cfg = load_config(["rollout=sglang", "rollout.num_engines=3", "rollout.engine_tp_size=2",
                       "cluster.gpus_per_node=8"])
    engines = trainer_placement(cfg, 8, True, {}).engines
    assert [e.gpu_ids for e in engines] == [(0, 1), (2, 3), (4, 5)]
    fleet = EngineFleet(RolloutConfig(backend="sglang", engine_tp_size=2), "/m", tmp_path, device="cuda")
    visible = [fleet.child_env(e.index, e.gpu_ids)["CUDA_VISIBLE_DEVICES"] for e in engines]
    assert visible == ["0,1", "2,3", "4,5"]
    assert "--base-gpu-id" in fleet.command(30000, engines[0].base_gpu_id)
    # disaggregated on one node: the learners' GPUs come first
    disagg = load_config(["rollout=sglang", "cluster.mode=disaggregated", "rollout.num_engines=2",
                          "rollout.engine_tp_size=2"])
    assert [e.gpu_ids for e in trainer_placement(disagg, 4, True, {}).engines] == [(4, 5), (6, 7)]


def test_transport_follows_the_placement():
    local = load_config(["rollout=sglang"])
    assert trainer_placement(local, 1, False, {}).transport == SHARED_MEMORY
    assert trainer_placement(local, 1, True, {}).transport == CUDA_IPC  # never a NCCL group on one GPU
    slurm = load_config(["+experiment=tiny_cpu_slurm", "rollout.backend=sglang"])
    two_nodes = {"DAPO_MEGA_NODE_ADDRS": "n1=127.0.0.1,n2=127.0.0.1"}
    assert trainer_placement(slurm, 2, False, two_nodes).transport == DISTRIBUTED  # gloo across nodes
    assert trainer_placement(slurm, 2, True, two_nodes).transport == CUDA_IPC
    disagg = load_config(["rollout=sglang", "cluster.mode=disaggregated"])
    assert trainer_placement(disagg, 1, True, {}).transport == DISTRIBUTED
    # the embedded engine is a CPU engine beside GPU learners: shared-memory files, never CUDA IPC
    assert trainer_placement(load_config([]), 1, True, {}).transport == SHARED_MEMORY
