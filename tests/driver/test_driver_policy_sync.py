"""`PolicySync.start` with pipeline stages: the stages' sources join their weight-update groups
one after the other. Each engine (SGLang 0.5.23: a FIFO communicator into one scheduler)
serves `/init_weights_update_group` in arrival order and blocks in that group's rendezvous
until every member joined; two stages joining at once could enter engine A as pp0 and engine
B as pp1 and wait for each other forever. Two gloo learner ranks (PP 2), the engines'
side recorded instead of contacted."""

import json
import time
from pathlib import Path
from types import SimpleNamespace

from dist_helpers import run_distributed

JOIN_S = 1.0
"""How long one stage's join takes here (an engine blocked in the rendezvous)."""


def _start_two_stages(rank: int, world_size: int, record_dir: str) -> None:
    import torch

    from dapo_mega.config import load_config
    from dapo_mega.driver.gate import DriverGate
    from dapo_mega.driver.policy_sync import PolicySync
    from dapo_mega.driver.roles import LearnerRankRole
    from dapo_mega.weights.sync import WeightSyncer

    torch.distributed.init_process_group("gloo")
    joins = []

    def init_group(self, master_port, stage=0):  # the engines' side: a rendezvous that takes JOIN_S
        start = time.time()
        time.sleep(JOIN_S)
        joins.append({"stage": stage, "start": start, "end": time.time(), "engines": list(self.engine_urls)})

    WeightSyncer.init_group = init_group
    cfg = load_config(["cluster.mode=disaggregated", "rollout.num_engines=2", "cluster.num_learner_processes=2",
                       "megatron.pipeline_model_parallel_size=2",
                       "rollout.engine_urls=[http://127.0.0.1:1,http://127.0.0.1:2]"])
    layout = SimpleNamespace(pp=2, pp_rank=rank, dp_rank=0, rank=rank, world_size=2, is_weight_source=True)
    role = LearnerRankRole(DriverGate(is_driver=rank == 0))  # rank 0 hands over, as the driver does
    role.is_driver = rank == 0
    sync = PolicySync.start(cfg, layout, role, list(cfg.rollout.engine_urls) if rank == 0 else None)
    try:
        assert sync.syncer is not None and sync.syncer.mode == "distributed"
    finally:
        sync.close()
    Path(record_dir, f"rank{rank}.json").write_text(json.dumps(joins))
    torch.distributed.destroy_process_group()


def test_pipeline_stages_join_their_weight_update_groups_in_turn(tmp_path):
    run_distributed(_start_two_stages, world_size=2, args=(str(tmp_path),), timeout_s=180)
    joins = [j for rank in (0, 1) for j in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    assert sorted(j["stage"] for j in joins) == [0, 1]
    assert all(j["engines"] == ["http://127.0.0.1:1", "http://127.0.0.1:2"] for j in joins)
    first, second = sorted(joins, key=lambda j: j["stage"])
    assert first["end"] <= second["start"], "stage 1 began joining while stage 0 was still joining"
